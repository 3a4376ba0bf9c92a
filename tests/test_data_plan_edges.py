"""Bad input to the data layer that used to give a traceback, or a line that names neither the file nor the fix: a
prepared directory with a broken meta.json, a data.tokenizer=hf:FILE that is no tokenizer, an --out or data.cache_dir
that is a file or another directory, a config whose section is not a mapping; and data.max_bytes cutting inside a
character."""

from __future__ import annotations

import os

import numpy as np

from dilocox.cli import main as cli_main


def _prepare(capsys, *args) -> tuple[int, str]:
    rc = cli_main(["data", "prepare", *args])
    return rc, capsys.readouterr().err.strip()


def _text(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld\n" * 40)
    return f"--data.path={path}"


def test_a_prepared_directory_with_a_broken_meta_json_names_the_file_and_the_fix(tmp_path, capsys):
    """Bug: a memmap directory whose meta.json lacks a key printed `data error: train_tokens`, and one that is not
    JSON printed the JSON parser's message: neither named the directory nor said to re-run `dilocox data prepare`."""
    for name, text in {"partial": '{"dtype": "uint16"}', "garbled": "{"}.items():
        d = tmp_path / name
        d.mkdir()
        (d / "meta.json").write_text(text)
        rc, err = _prepare(capsys, "--data.source=memmap", f"--data.path={d}", f"--data.cache_dir={tmp_path}")
        assert rc == 2 and err.startswith("data error: ") and "\n" not in err, err
        assert str(d) in err and "meta.json" in err and "dilocox data prepare" in err, err


def test_a_pretrained_tokenizer_file_that_does_not_parse_is_one_line(tmp_path, capsys):
    """Bug: data.tokenizer=hf:FILE where FILE is JSON but no tokenizer (a model's config.json, say) raised the
    tokenizers package's bare Exception: a traceback from `dilocox data prepare` and `dilocox train`."""
    bad = tmp_path / "config.json"
    bad.write_text('{"a": 1}')
    rc, err = _prepare(capsys, _text(tmp_path), "--data.source=text", f"--data.tokenizer=hf:{bad}",
                       f"--data.cache_dir={tmp_path}/cache")  # fmt: skip
    assert rc == 2 and err.startswith("data error: ") and "\n" not in err, err
    assert str(bad) in err and "tokenizer.json" in err, err


def test_an_out_dir_or_cache_dir_that_holds_something_else_is_one_line_and_kept(tmp_path, capsys):
    """Bug: --out naming a directory of other files (or a file), or a data.cache_dir that is a file, raised
    FileExistsError / NotADirectoryError tracebacks (--out: only after tokenizing the whole corpus)."""
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    cache = f"--data.cache_dir={tmp_path}/cache"
    cases = {
        "--out dir": [cache, "--out", str(other)],
        "--out file": [cache, "--out", str(a_file)],
        "--out under a file": [cache, "--out", str(a_file / "sub")],
        "cache_dir file": [f"--data.cache_dir={a_file}"],
        "cache_dir file, bpe": [f"--data.cache_dir={a_file}", "--data.tokenizer=bpe", "--data.bpe_vocab_size=300",
                                "--out", str(tmp_path / "new")],
    }  # fmt: skip
    for what, args in cases.items():
        rc, err = _prepare(capsys, "--data.source=text", _text(tmp_path), *args)
        assert rc == 2 and err.startswith("data error: ") and "\n" not in err, (what, err)
        assert str(other if "dir" in what and "cache" not in what else a_file) in err, (what, err)
    assert os.listdir(other) == ["keep.txt"] and a_file.read_text() == "mine"


def test_data_prepare_with_a_config_section_that_is_not_a_mapping_is_a_config_error(tmp_path, capsys):
    """Bug: `dilocox data prepare CONFIG` with data.tokenizer=bpe and `model: 3` (or `parallel: 4`) crashed with
    AttributeError: 'int' object has no attribute 'get', where `dilocox train` says the section is not a mapping."""
    for section in ("model: 3", "parallel: 4"):
        cfg = tmp_path / "run.yaml"
        cfg.write_text(f"data:\n  tokenizer: bpe\n  bpe_vocab_size: 9000\n{section}\n")
        rc, err = _prepare(capsys, str(cfg), f"--data.cache_dir={tmp_path}/cache")
        assert rc == 2 and err.startswith("config error: ") and "must be a mapping" in err and "\n" not in err, err


def test_max_bytes_cutting_inside_a_character_keeps_no_empty_document(tmp_path):
    """Bug: data.max_bytes ending inside a multi-byte character of a document's first bytes kept that document as
    an empty one (a spurious end-of-document token in the validation split, one more document counted) and said
    kept_bytes = max_bytes though the partial character was dropped (meta "bytes" disagreed with it)."""
    from dilocox.config import DataConfig
    from dilocox.data import prepare, read_corpus

    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_bytes(b"abcd")
    (d / "b.txt").write_text("été\n")  # its first byte, 0xC3, alone is no character
    (d / "c.txt").write_text("x" * 10)  # after the cut: never read
    cfg = DataConfig(source="text", path=str(d), cache_dir=str(tmp_path / "cache"), max_bytes=5)
    c = read_corpus(cfg)
    assert c.docs == ["abcd"] and c.cut["kept_bytes"] == 4, (c.docs, c.cut)
    p = prepare(cfg)
    m = p.meta
    assert m["bytes"] == m["cut"]["kept_bytes"] == 4, m
    tokens = np.concatenate([p.train_tokens(), p.val_tokens()])
    assert int((tokens == 0).sum()) == 2 and bytes(tokens[tokens != 0].astype(np.uint8)) == b"abcd", tokens
