"""Bad input found by a black-box review of the CLI (2026-12-03): each is one line naming the field and the fix, before
any work, and nothing the user had is replaced."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dilocox.config import ConfigError, load_config
from dilocox.data import DataError, TokenSampler, check_data, prepare
from dilocox.data.sampler import val_batches
from dilocox.fits import check_model_fits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


@pytest.mark.parametrize(
    "args,match",
    [
        (["--train.seed=99999999999999999999"], "train.seed=.* must be in \\[-2\\*\\*63, 2\\*\\*64 - 2\\*\\*32\\)"),
        ([f"--train.seed={-(1 << 63) - 1}"], "train.seed=-9223372036854775809"),
        (["--data.cache_dir="], "data.cache_dir='' is empty"),
        (["--verbose"], "unknown option '--verbose'"),
    ],
)
def test_a_value_that_failed_later_is_named_at_load(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, args)


def test_a_section_written_as_a_scalar_is_refused_also_when_an_override_touches_it(tmp_path):
    """``train: 3`` alone was refused, but an override of train.steps replaced the scalar with its own section and the
    rest of the file's train keys were silently the defaults."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("include: " + os.path.join(ROOT, "configs", "model", "gpt2-tiny.yaml") + "\ntrain: 3\n")
    for over in ([], ["--train.steps=2"]):
        with pytest.raises(ConfigError, match="train"):
            load_config(str(cfg), over)
    ok = tmp_path / "ok.yaml"
    ok.write_text("train:\n  steps: 7\n")
    assert load_config(str(ok), ["--train.seq_len=32"]).train.steps == 7  # (a section merges as before)


def _data(tmp_path, max_bytes=60_000):
    return load_config(TINY, [f"--data.cache_dir={tmp_path}/cache", f"--data.max_bytes={max_bytes}"]).data


def test_prepare_into_an_out_dir_of_other_data_is_refused_and_leaves_it(tmp_path):
    """``dilocox data prepare --out DIR`` over a directory of other data replaced it (and the files beside it): a
    run trained on it could no longer resume."""
    out = str(tmp_path / "mm")
    first = prepare(_data(tmp_path), out)
    (tmp_path / "mm" / "NOTES.txt").write_text("mine")
    before = open(first.train_path, "rb").read()
    with pytest.raises(DataError, match="holds other data than this build.*content_sha256, train_tokens.*give --out"):
        prepare(_data(tmp_path, 50_000), out)
    assert open(first.train_path, "rb").read() == before and (tmp_path / "mm" / "NOTES.txt").read_text() == "mine"
    assert prepare(_data(tmp_path), out).cache_hit  # the same settings: reused
    os.remove(os.path.join(out, "val.bin"))  # the same data, damaged: built again
    again = prepare(_data(tmp_path), out)
    assert not again.cache_hit and open(again.train_path, "rb").read() == before


def test_a_prepared_file_given_as_data_path_and_a_missing_split_are_named(tmp_path):
    p = prepare(_data(tmp_path), str(tmp_path / "mm"))
    with pytest.raises(FileNotFoundError, match="is a file of a prepared data directory; give the directory"):
        prepare(load_config(TINY, ["--data.source=memmap", f"--data.path={p.train_path}"]).data)
    os.remove(p.val_path)
    with pytest.raises(ValueError, match="val.bin is missing"):
        prepare(load_config(TINY, ["--data.source=memmap", f"--data.path={p.dir}"]).data)


def test_a_token_id_outside_the_vocabulary_is_one_line_naming_the_file(tmp_path):
    """A damaged train.bin ended in an IndexError inside the embedding (or, below model.vocab_size, trained on
    another token's row without a word)."""
    p = prepare(_data(tmp_path), str(tmp_path / "mm"))
    toks = np.memmap(p.train_path, dtype=p.dtype, mode="r+")
    toks[1000:1300] = p.vocab_size  # one past the tokenizer's last id
    toks.flush()
    args = p.sampler_args()
    s = TokenSampler(np.memmap(p.train_path, dtype=p.dtype, mode="r"), 128, 8, seed=1, **args)
    bad = next(k for k in range(100_000) if ((s.starts(k) < 1300) & (s.starts(k) + 129 > 1000)).any())
    for k in range(bad):
        s.batch_at(k)  # (the batches before it are fine)
    with pytest.raises(DataError, match=f"train.bin holds token id {p.vocab_size} \\(in the batch of step {bad}\\)"):
        s.batch_at(bad)
    val = np.memmap(p.val_path, dtype=p.dtype, mode="r+")
    val[5] = 60_000
    val.flush()
    with pytest.raises(DataError, match="val.bin holds token id 60000 \\(in validation batch 0\\)"):
        val_batches(np.memmap(p.val_path, dtype=p.dtype, mode="r"), 2, 4, 64, vocab_size=p.vocab_size)


def test_a_batch_larger_than_the_training_split_is_refused_before_the_validation_windows_are_built(tmp_path):
    """--train.batch_size=1e7 hung: the validation batches (eval_batches x batch_size windows) filled the memory."""
    cfg = load_config(TINY, [f"--data.cache_dir={tmp_path}/cache", "--data.max_bytes=60000", "--train.batch_size=1e7"])
    with pytest.raises(DataError, match="one step reads train.batch_size x .* lower train.batch_size"):
        check_data(cfg)
    check_data(load_config(TINY, [f"--data.cache_dir={tmp_path}/cache", "--data.max_bytes=60000"]))


def test_a_model_that_cannot_fit_the_machine_is_refused_before_it_is_built():
    """--model.vocab_size=1e10 failed inside the first allocation with a C++ traceback."""
    big = load_config(TINY, ["--model.vocab_size=1e10"])
    with pytest.raises(ConfigError, match="model.vocab_size=1e\\+10.*needs at least .* GB per rank.*lower model"):
        check_model_fits(big, on_cpu=True, memory=64 * 10**9)
    with pytest.raises(ConfigError, match="any accelerator has"):
        check_model_fits(load_config(TINY, ["--model.d_model=1e300"]), on_cpu=False)
    check_model_fits(load_config(TINY, []), on_cpu=True, memory=64 * 10**9)  # the control
    split = load_config(TINY, ["--model.vocab_size=2048", "--model.d_model=1024", "--model.n_heads=8"])
    need = split.model.num_params() * 16
    check_model_fits(split, on_cpu=True, memory=need)  # (exactly what it needs: fits)
    with pytest.raises(ConfigError):
        check_model_fits(split, on_cpu=True, memory=need - 1)


def test_seeds_torch_takes_are_kept():
    """(The first range, [0, 2**62), refused seeds torch takes: a run trained with one could no longer be exported.)"""
    for seed in (-1, -(1 << 63), (1 << 63) - 1):
        assert load_config(TINY, [f"--train.seed={seed}"]).train.seed == seed


def test_prepare_again_into_its_own_out_dir_after_a_touch_replaces_it(tmp_path):
    """The same corpus with a new mtime (a git checkout, an rsync) changes the cache key, not the data: prepare
    --out into the directory it wrote before builds it again and replaces it, as before the refusal of other data."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"document {i}\n" + "some text here\n" * 400)
    cfg = load_config(TINY, ["--data.source=text", f"--data.path={corpus}", f"--data.cache_dir={tmp_path}/c"]).data
    out = str(tmp_path / "mm")
    first = prepare(cfg, out)
    os.utime(corpus / "0.txt", ns=(1, 1))
    again = prepare(cfg, out)
    assert not again.cache_hit and again.meta["key"] != first.meta["key"]
    assert again.meta["content_sha256"] == first.meta["content_sha256"]
    (corpus / "0.txt").write_text("another text\n" * 400)  # other data: refused, the directory kept
    with pytest.raises(DataError, match="holds other data than this build.*content_sha256"):
        prepare(cfg, out)
    assert prepare(load_config(TINY, ["--data.source=memmap", f"--data.path={out}"]).data).meta == again.meta
