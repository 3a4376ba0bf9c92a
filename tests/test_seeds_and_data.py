"""Two holes of the last review: the pipeline stages drew the same dropout masks (one global seed for every rank),
and a corpus edited without changing its token count resumed on other text without a word."""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.config import ConfigError, load_config
from dilocox.data.sampler import TokenSampler
from tests.small_run import TINY_RUN_ARGS
from tests.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "the quick brown fox jumps over the lazy dog\n" * 400


def _cfg(tmp: str, *extra: str, steps: int = 2):
    args = [f"--log.run_dir={tmp}/run", f"--data.cache_dir={tmp}/cache", f"--train.steps={steps}", *TINY_RUN_ARGS]
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*args, *extra])


def _stage_seed(rank, world, tmp):
    from dilocox.train import Trainer

    cfg = _cfg(tmp, "--parallel.pipeline=2", "--parallel.microbatches=2", "--model.dropout=0.1")
    t = Trainer(cfg)
    return t.topo.stage, torch.initial_seed(), torch.rand(4).tolist()


def test_each_pipeline_stage_draws_its_own_dropout_masks(tmp_path):
    """Megatron seeds stage p with seed + 100 p: with one seed, stage 1's first layer drew stage 0's first layer's
    masks at every step (the global generator draws dropout masks only)."""
    out = sorted(run_ranks(2, _stage_seed, str(tmp_path)))
    seed = _cfg(str(tmp_path)).train.seed
    assert [(s, init) for s, init, _ in out] == [(0, seed), (1, seed + 100)]
    assert out[0][2] != out[1][2]  # the streams differ


def _corpus_cfg(tmp_path, steps):
    return _cfg(str(tmp_path), "--data.source=text", f"--data.path={tmp_path / 'corpus'}", "--checkpoint.every=2",
                steps=steps)  # fmt: skip


def test_a_resume_on_a_corpus_edited_to_the_same_length_is_refused(tmp_path):
    """ "fox" -> "cat" keeps every byte count (byte tokenizer): the sampler's checks (seed, token count, mode) all
    passed and the run went on over other text. The prepared corpus's content hash is now in the sampler's state."""
    from dilocox.train import Trainer

    (tmp_path / "corpus").mkdir()
    f = tmp_path / "corpus" / "a.txt"
    f.write_text(TEXT)
    t = Trainer(_corpus_cfg(tmp_path, 2))
    t.run()
    f.write_text(TEXT.replace("fox", "cat"))
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))  # a new mtime even on a coarse file system
    with pytest.raises(ConfigError, match="content_sha256") as e:
        Trainer(_corpus_cfg(tmp_path, 4))
    assert "corpus" in str(e.value) and "new --log.run_dir" in str(e.value)
    f.write_text(TEXT)  # the original text back: the resume goes on
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**10))
    t = Trainer(_corpus_cfg(tmp_path, 4))
    assert t.sampler.step == 2


def test_a_sampler_state_without_a_content_hash_still_loads():
    """Checkpoints of earlier versions have no content hash: the other checks only."""
    import numpy as np

    tokens = np.arange(1000, dtype=np.uint16)
    old = TokenSampler(tokens, 16, 2, 0)
    old.step = 3
    new = TokenSampler(tokens, 16, 2, 0, content="ab" * 32)
    new.load_state_dict(old.state_dict())
    assert new.step == 3 and "content_sha256" not in old.state_dict()
    other = TokenSampler(tokens, 16, 2, 0, content="cd" * 32)
    with pytest.raises(ConfigError, match="content_sha256='cdcd"):
        new.load_state_dict(other.state_dict())


def test_a_byte_order_mark_is_skipped_not_trained_on(tmp_path):
    """A text file saved with a UTF-8 BOM (Windows editors write one) reads as the same documents as without it: the
    BOM (U+FEFF) used to stay in the first document, three tokens of a byte tokenizer trained on as text. Small
    files, a file read in pieces and local .txt files read through data.source=hf alike; a BOM inside the text is
    left alone."""
    from dilocox.config import DataConfig
    from dilocox.data import sources

    body = "".join(f"line {i} \u00e9\n" for i in range(300))
    for name, raw in (("plain.txt", body.encode()), ("bom.txt", sources.UTF8_BOM + body.encode())):
        (tmp_path / name).write_bytes(raw)
    (tmp_path / "mid.txt").write_bytes(b"a" + sources.UTF8_BOM + b"b")
    read = lambda p: sources.read_corpus(DataConfig(source="text", path=str(p))).docs  # noqa: E731
    assert read(tmp_path / "bom.txt") == read(tmp_path / "plain.txt") == [body]
    assert read(tmp_path / "mid.txt") == ["a\ufeffb"]
    # data.source=hf reads local .txt files as one row per file (datasets keeps the BOM as U+FEFF): the same
    hf = lambda p: sources.read_corpus(DataConfig(source="hf", path=str(p))).docs  # noqa: E731
    assert hf(tmp_path / "bom.txt") == hf(tmp_path / "plain.txt") == [body]
    # in pieces of 1 kB (as a file over TEXT_PIECE_BYTES is read)
    pieces = list(sources._file_raws([str(tmp_path / "bom.txt")], piece=1000))
    assert b"".join(pieces) == body.encode() and len(pieces) > 1
