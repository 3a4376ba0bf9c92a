"""A new user's journey through README.md and docs/ on their own corpus: each test is a problem such a user hit (a
file dropped without a word, an error without its fix, torchrun's report around one line), fixed."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dilocox.cli import main as cli_main
from dilocox.config import ConfigError, DataConfig, load_config
from dilocox.data import prepare
from dilocox.data.prepare import prepare_main
from dilocox.data.sampler import TokenSampler
from dilocox.launch.local_run import local_run_argv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _tiny_text_run(tmp_path):
    """A one-file text corpus and the `dilocox train` command of a tiny run on it (seq 32, batch 2)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 300)
    cmd = [sys.executable, "-m", "dilocox.cli", "train", TINY, "--data.source=text", f"--data.path={corpus}",
           f"--data.cache_dir={tmp_path / 'cache'}", f"--log.run_dir={tmp_path / 'run'}", "--train.seq_len=32",
           "--train.batch_size=2", "--train.eval_batches=1", "--log.progress=false",
           "--log.tensorboard=false"]  # fmt: skip
    return corpus, cmd


def _mixed_corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(3):
        (d / f"doc{i}.txt").write_text(f"document {i}: " + "some plain text. " * 400 + "\n")
    (d / "notes_latin1.txt").write_bytes("caf\xe9 na\xefve r\xe9sum\xe9\n".encode("latin-1") * 50)
    return d


def test_text_dir_names_the_files_it_leaves_out(tmp_path, capsys, monkeypatch):
    """A latin-1 file among UTF-8 ones was left out of `data prepare` and `train` without a word (the summary said
    "3 documents"): now both say which file and how to convert it; the documents kept are unchanged."""
    d = _mixed_corpus(tmp_path)
    cache = str(tmp_path / "cache")
    args = ["--data.source=text", f"--data.path={d}", f"--data.cache_dir={cache}"]
    assert prepare_main([TINY, *args]) == 0
    out = capsys.readouterr().out
    assert "3 documents" in out
    skipped = [line for line in out.splitlines() if line.startswith("skipped")]
    assert len(skipped) == 1 and "notes_latin1.txt" in skipped[0] and "iconv" in skipped[0], out
    p = prepare(DataConfig(source="text", path=str(d), cache_dir=cache))
    assert p.meta["skipped_count"] == 1 and p.meta["train_docs"] + p.meta["val_docs"] >= 3
    # train says it too (once, rank 0), before any step
    from dilocox.cli import _check_data

    monkeypatch.delenv("RANK", raising=False)
    _check_data(load_config(TINY, args))
    assert "notes_latin1.txt" in capsys.readouterr().out
    # a directory of clean text says nothing
    os.remove(d / "notes_latin1.txt")
    assert prepare_main([TINY, *args]) == 0
    assert "skipped" not in capsys.readouterr().out


def test_bpe_larger_than_the_model_names_the_fix():
    """`--data.tokenizer=bpe` on configs/tiny.yaml said only that the BPE "exceeds" the model's vocabulary."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["--data.tokenizer=bpe", "--data.bpe_vocab_size=2048"])
    assert "model.vocab_size=256" in str(e.value) and "set it to that or more" in str(e.value)


def test_nproc_that_does_not_match_the_layout_names_the_fix(capsys, monkeypatch):
    """`dilocox train configs/tiny.yaml --nproc 2` said the layout is 1, not how to run it."""
    monkeypatch.delenv("RANK", raising=False)
    assert cli_main(["train", TINY, "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert "1*1*1*1 = 1" in err and "--nproc 1" in err and "--parallel.data" in err, err


def test_resume_on_changed_data_names_the_fix():
    """Files added to data.path between a run and its resume: the sampler's refusal said only "different data or
    seed"; now it says what changed and the two ways on."""
    saved = TokenSampler(np.arange(1000, dtype=np.uint16), 2, 16, seed=1)
    now = TokenSampler(np.arange(1200, dtype=np.uint16), 2, 16, seed=1)
    with pytest.raises(ValueError) as e:
        now.load_state_dict(saved.state_dict())
    msg = str(e.value)
    assert "n_tokens=1000" in msg and "n_tokens=1200" in msg
    assert "data.path" in msg and "--log.run_dir" in msg and "--model.init_from" in msg


def test_generate_on_a_missing_dir_is_one_line(monkeypatch):
    """`dilocox generate runs/typo` (offline) printed the hub client's multi-line error inside ours."""
    import huggingface_hub

    from dilocox.hf import ExportError, resolve_hf_dir

    def offline(*a, **k):
        raise OSError("Got: ConnectError: Name or service not known\nAn error happened while trying to locate ...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ExportError) as e:
        resolve_hf_dir("runs/no_such_run_dir")
    assert "\n" not in str(e.value) and "runs/no_such_run_dir" in str(e.value)


@pytest.mark.parametrize("code", [2, 1])
def test_local_launch_config_error_is_the_ranks_line_only(tmp_path, code):
    """`dilocox train CONFIG --nproc 2` whose ranks refuse the config (e.g. a resume that changes
    outer.streaming.fragments) printed each rank's one line, then torchrun's 20-line "dilocox.cli FAILED" report.
    Now a config error (every rank exits 2) is the ranks' lines only; any other failure keeps torchrun's report."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "print(f\"config error (rank {os.environ['RANK']}): bad key\", file=sys.stderr)\n"
        f"sys.exit({code})\n"
    )
    r = subprocess.run(
        local_run_argv(2, [str(script)]), env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == code, r.stderr
    # (rank 0 at least: under load torchrun may stop rank 1 once rank 0 exited, before rank 1 printed)
    assert r.stderr.count("config error (rank") >= 1, r.stderr
    if code == 2:
        assert "FAILED" not in r.stderr and "exitcode: 2" not in r.stderr, r.stderr
    else:
        assert "FAILED" in r.stderr


def test_diloco_final_val_says_it_is_the_outer_params(tmp_path):
    """A DiLoCo run's last step logged one val loss and the `done:` line another for the same step, unexplained:
    the done line's is the outer params θ (what `dilocox export` writes); now it says so."""
    corpus, cmd = _tiny_text_run(tmp_path)
    cmd += ["--outer.method=diloco", "--outer.sync_every=2", "--train.steps=4"]
    r = subprocess.run(cmd, env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    done = [line for line in r.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and "of the outer params" in done[0], r.stdout


def test_the_docs_H_names_its_key():
    """README's method table calls the inner steps "H"; `--outer.H=4` suggested outer.lr."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["--outer.H=4"])
    assert "did you mean outer.sync_every" in str(e.value), e.value


def test_a_resume_on_a_grown_corpus_is_a_config_error_exit_2(tmp_path):
    """A file added to data.path between a run and its resume: the sampler refused the checkpoint, but as
    "checkpoint error: restoring ...: ValueError" with exit 1 (as if the checkpoint were damaged); it is this run's
    input that differs: a config error naming the fix, exit 2, as at start-up."""
    corpus, cmd = _tiny_text_run(tmp_path)
    cmd += ["--checkpoint.every=2"]
    r = subprocess.run([*cmd, "--train.steps=2"], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    (corpus / "b.txt").write_text("a second document, added after the run\n" * 100)
    r = subprocess.run([*cmd, "--train.steps=4"], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "config error" in r.stderr and "trained on different data" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
