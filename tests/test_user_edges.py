"""A new user's edges of the run-dir tools: TensorBoard across a resume, W&B that cannot start, ``dilocox generate``
(a model vocabulary padded past the tokenizer's, a prompt that is not UTF-8), the tokenizer a run is exported and
sampled with, and the finished-run message's command."""

from __future__ import annotations

import os
import sys
import types

import pytest

from dilocox.config import Config, ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tb_steps(tb_dir: str, tag: str = "loss") -> dict[int, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    ea.Reload()
    out: dict[int, list[float]] = {}
    for e in ea.Scalars(tag):
        out.setdefault(e.step, []).append(e.value)
    return out


def test_tensorboard_keeps_the_resumed_step_and_drops_the_later_ones(tmp_path):
    """A run logged steps 1..3 and saved at step 2; the resume (``resume_at(2)``) logs 3..4 again. TensorBoard shows
    1..4 once each, step 3 from the resume: the purge starts after the resumed step (it dropped step 2 for good)."""
    pytest.importorskip("torch.utils.tensorboard")
    from dilocox.metrics import MetricsLogger

    first = MetricsLogger(str(tmp_path), enabled=True, total_steps=4, jsonl=False, progress=False)
    for step in (1, 2, 3):
        first.write({"step": step, "loss": float(step)})
    first.close()
    again = MetricsLogger(str(tmp_path), enabled=True, total_steps=4, jsonl=False, progress=False)
    again.resume_at(2)
    for step in (3, 4):
        again.write({"step": step, "loss": 10.0 + step})
    again.close()
    assert _tb_steps(str(tmp_path / "tb")) == {1: [1.0], 2: [2.0], 3: [13.0], 4: [14.0]}


def _fake_wandb(init):
    mod = types.ModuleType("wandb")
    mod.Settings = lambda **kw: kw
    mod.init = init
    return mod


def test_wandb_that_cannot_start_is_one_config_line_not_a_traceback(tmp_path, monkeypatch):
    """``--log.wandb=true`` without ``wandb login`` (wandb.init raises): a ConfigError naming the fixes, which the
    command prints as one line with exit 2; it was wandb's UsageError and a traceback."""
    from dilocox.cli import _error_kind
    from dilocox.metrics import MetricsLogger

    def init(**kw):
        raise RuntimeError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(init))
    log = MetricsLogger(str(tmp_path), enabled=True, total_steps=1, tensorboard=False, wandb_project="p")
    with pytest.raises(ConfigError) as got:
        log.write({"event": "startup"})
    msg = str(got.value)
    assert "No API key configured" in msg and "wandb login" in msg and "WANDB_MODE=offline" in msg, msg
    assert "--log.wandb=false" in msg and "\n" not in msg
    assert _error_kind(got.value) == ("config error", 2)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: still a RuntimeError, now a ConfigError too
    with pytest.raises(RuntimeError, match="pip install wandb") as missing:
        MetricsLogger(str(tmp_path), enabled=True, total_steps=1, tensorboard=False, wandb_project="p").prepare()
    assert isinstance(missing.value, ConfigError)


@pytest.fixture(scope="module")
def byte_hf_512(tmp_path_factory):
    """A byte-level model (tokenizer: 256 bytes) whose vocabulary is padded to 512, as an HF directory."""
    from dilocox import hf
    from dilocox.data.tokenizer import ByteTokenizer
    from dilocox.model.transformer import build_model

    cfg = load_config(
        os.path.join(ROOT, "configs", "model", "qwen-tiny.yaml"),
        ["--model.n_layers=1", "--model.init_std=0.2", "--model.vocab_size=512"],
    )
    out = str(tmp_path_factory.mktemp("gen512") / "hf")
    hf.save_hf_dir(out, cfg.model, build_model(cfg.model, seed=3).gather_full_state_dict(), ByteTokenizer())
    return out


def test_generate_never_draws_an_id_the_tokenizer_has_no_text_for(byte_hf_512, capsys):
    """Near-uniform sampling over 512 logits with a 256-byte tokenizer: every drawn id is a byte. It drew ids >= 256
    and ``bytes(...)`` raised ``ValueError: bytes must be in range(0, 256)`` (a traceback after the sampling)."""
    from dilocox.generate import load_model, main, sample

    args = [byte_hf_512, "--prompt", "x = ", "--temperature", "1000", "--top-k", "0", "--max-new-tokens", "40"]
    assert main([*args, "--no-stop", "--seed", "1"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("x = ")
    model, tok, _ = load_model(byte_hf_512)
    ids = sample(model, tok.encode("x"), 40, temperature=1000.0, seed=2, vocab_size=tok.vocab_size)
    assert len(ids) == 40 and max(ids) < 256


def test_generate_takes_a_prompt_that_is_not_utf8_as_bytes_on_a_byte_model(byte_hf_512, capsys):
    """Command-line bytes that are not UTF-8 (``--prompt $'ab\\xff'``) are the prompt's bytes for a byte-level model
    (all 256 are in its vocabulary); it stopped with ``'utf-8' codec can't encode characters ...``."""
    from dilocox.data.tokenizer import ByteTokenizer
    from dilocox.generate import main, prompt_ids

    prompt = os.fsdecode(b"ab\xff")
    assert prompt_ids(ByteTokenizer(), prompt) == [97, 98, 255]
    args = [byte_hf_512, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "3", "--no-stop"]
    assert main(args) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ab\ufffd")


def test_run_tokenizer_of_a_pretrained_tokenizer_reads_its_file_not_the_corpus(tmp_path):
    """``data.tokenizer=hf:PATH``: generate and export load PATH's tokenizer.json, as training did; they prepared
    the whole corpus again for it (and failed where the corpus was gone)."""
    from dilocox.generate import run_tokenizer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from test_pretrained_tokenizer import _gpt2_style_tokenizer
    finally:
        sys.path.pop(0)
    tok_file = str(tmp_path / "tok" / "tokenizer.json")
    _gpt2_style_tokenizer(tok_file)
    cfg = Config()
    cfg.data.source, cfg.data.path = "text", str(tmp_path / "gone")  # (the corpus is not there any more)
    cfg.data.tokenizer, cfg.data.cache_dir = f"hf:{tok_file}", str(tmp_path / "cache")
    tok = run_tokenizer(cfg)
    assert tok.decode(tok.encode("x = [i * 2 for i in range(9)]")) == "x = [i * 2 for i in range(9)]"
    assert not (tmp_path / "cache").exists()


def test_run_tokenizer_says_when_it_prepares_the_corpus_again(tmp_path, capsys):
    """A BPE run whose prepared data is not in its cache (another current directory with a relative
    data.cache_dir, a deleted cache, a corpus changed since): the BPE is rebuilt from the corpus as it is now, with a
    note saying so; it was silent, and a changed corpus gave the exported model another tokenizer than its own."""
    from dilocox.generate import run_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 5)
    cfg = Config()
    cfg.data.source, cfg.data.path, cfg.data.tokenizer = "text", str(corpus), "bpe"
    cfg.data.bpe_vocab_size, cfg.data.cache_dir = 300, str(tmp_path / "cache")
    tok = run_tokenizer(cfg)
    assert tok.kind == "bpe" and "preparing it again" in capsys.readouterr().err
    run_tokenizer(cfg)  # now cached: nothing to say
    assert "preparing it again" not in capsys.readouterr().err


def test_export_takes_the_bpe_the_run_trained_with_after_its_corpus_changed(tmp_path):
    """The trainer keeps RUN_DIR/tokenizer.json; export read the BPE of the corpus as it is now (prepared again when
    the cache was gone or the corpus had changed: another tokenizer than the model's, without a word)."""
    import shutil

    from dilocox.export import export_run
    from tests.small_run import small_cfg
    from tests.test_resume_edges import _run

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 5)
    run = tmp_path / "run"
    bpe = ["--data.source=text", f"--data.path={corpus}", "--data.tokenizer=bpe", "--data.bpe_vocab_size=300"]
    t = _run(small_cfg(str(run), *bpe, "--data.max_bytes=null", "--model.vocab_size=512", steps=2))
    kept = (run / "tokenizer.json").read_bytes()
    assert kept == open(os.path.join(t.prepared.dir, "tokenizer.json"), "rb").read()
    shutil.rmtree(t.prepared.dir)  # the cache gone and the corpus changed: a rebuilt BPE would differ
    for i in range(40):
        (corpus / f"new{i:02d}.txt").write_text(f"class K{i}:\n    value = '{i * 7}'\n" * 9)
    export_run(str(run), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == kept


def test_finished_message_quotes_a_run_dir_with_spaces():
    """The command the "already finished" line suggests works when pasted: a run dir with a space is quoted."""
    from dilocox.rundir import finished_message

    cfg = Config()
    cfg.train.steps, cfg.log.run_dir = 5, "my runs/first try"
    msg = finished_message(5, 0, cfg, "my runs/first try/checkpoints/step_00000005", skip=True)
    assert "`dilocox report 'my runs/first try'`" in msg, msg


def test_a_records_time_is_when_its_step_ran_not_when_its_batch_was_written(tmp_path):
    """Records are held and written every log.every steps; ``time``/``wall`` were the write's, so steps 1..9 of a
    10-step batch carried one time (a staircase in `dilocox report`'s loss-vs-time plot)."""
    import json
    import time

    from tests.small_run import small_cfg
    from tests.test_resume_edges import _run

    t0 = time.time()
    _run(small_cfg(str(tmp_path / "run"), "--log.every=10", steps=10))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        recs = [r for r in map(json.loads, f) if "loss" in r and "step" in r]
    times = [r["time"] for r in recs]
    assert [r["step"] for r in recs] == list(range(1, 11)) and times == sorted(times), times
    assert len(set(times)) > 2, times  # (written at once: one time, to the ms)
    assert all(t0 <= r["wall"] <= time.time() for r in recs)
