"""The data layer at its edges: a user's large file, null and non-text cells, a corpus that changes while it is
prepared, the prepare command's errors, a tokenizer whose ids have gaps, and a killed build's leftovers."""

from __future__ import annotations

import importlib
import io
import json
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest

import dilocox.data.sources as srcmod
from dilocox.cli import main as cli_main
from dilocox.config import DataConfig
from dilocox.data import ByteTokenizer, DataError, prepare

prepmod = importlib.import_module("dilocox.data.prepare")  # (the package's `prepare` is the function)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(tmp_path, **kw) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def test_pieces_are_whole_characters_cut_at_line_ends():
    """``_pieces``: the pieces join to the file, each at most the limit, each ending at a newline when its window has
    one, and never inside a UTF-8 character (random text of 1-4 byte characters, with and without newlines)."""
    rng = random.Random(0)
    for trial in range(400):
        alphabet = ["a", "é", "€", "😀", " "] + (["\n"] if trial % 2 else [])
        data = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))).encode()
        limit = rng.randint(8, 64)
        pieces = list(srcmod._pieces(io.BytesIO(data), limit))
        assert b"".join(pieces) == data, trial
        for i, p in enumerate(pieces):
            assert 0 < len(p) <= limit and p.decode("utf-8") is not None
            if i < len(pieces) - 1:  # cut after the last newline of its window, or it has none
                assert p.endswith(b"\n") or b"\n" not in p, (trial, i)


def test_a_text_file_over_the_piece_size_is_read_as_documents_cut_at_line_ends(tmp_path, monkeypatch):
    """data.source=text: a file larger than TEXT_PIECE_BYTES becomes one document per piece (each followed by the
    end-of-document token), every byte kept in order; a smaller file stays one document."""
    monkeypatch.setattr(srcmod, "TEXT_PIECE_BYTES", 4096)
    d = tmp_path / "c"
    d.mkdir()
    big = "".join(f"ligne {i} é€ {'x' * (i % 50)}\n" for i in range(600))  # ~27 kB, multi-byte characters
    (d / "a.txt").write_text(big)
    (d / "b.txt").write_text("small file\n")
    p = prepare(_cfg(tmp_path, source="text", path=str(d), val_fraction=0.1))
    tokens = np.concatenate([p.train_tokens(), p.val_tokens()]).astype(np.uint8).tobytes()
    docs = tokens.split(b"\0")[:-1]
    assert b"".join(docs[:-1]) == big.encode() and docs[-1] == b"small file\n"
    assert len(docs) - 1 >= -(-len(big.encode()) // 4096)
    assert all(len(x) <= 4096 and x.endswith(b"\n") for x in docs[:-1])
    assert p.meta["train_docs"] + p.meta["val_docs"] == len(docs) and p.meta["format"] == prepmod.FORMAT


def test_hf_null_cells_are_no_document_and_other_types_name_the_field(tmp_path):
    pytest.importorskip("datasets", reason="the datasets package is not installed")
    f = tmp_path / "rows.jsonl"
    rows = [{"text": None if i % 3 == 0 else f"row {i} " + "w " * i, "n": i} for i in range(30)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = prepare(_cfg(tmp_path, source="hf", path=str(f), val_fraction=0.1))
    stream = np.concatenate([p.train_tokens(), p.val_tokens()]).astype(np.uint8).tobytes()
    assert stream == b"\0".join(r["text"].encode() for r in rows if r["text"] is not None) + b"\0"
    assert b"None" not in stream
    with pytest.raises(DataError, match=r"data.hf_text_field='n' .* holds a int, not text \(row 0"):
        prepare(_cfg(tmp_path, source="hf", path=str(f), hf_text_field="n"))


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_corpus_that_changes_between_the_passes_is_refused(tmp_path, monkeypatch, change):
    """prepare reads the corpus twice (sizes, then tokens): a file added or the last one removed in between is an
    error (before: the added file went into val.bin, or the split lost its validation documents), and nothing is
    published."""
    d = tmp_path / "c"
    d.mkdir()
    for i in range(6):
        (d / f"{i}.txt").write_text(f"document {i}\n" * 50)
    real = prepmod.split_plan

    def between(sizes, frac):
        if change == "added":
            (d / "9.txt").write_text("LATE FILE\n" * 50)
        else:
            os.remove(d / "5.txt")
        return real(sizes, frac)

    monkeypatch.setattr(prepmod, "split_plan", between)
    with pytest.raises(DataError, match="the corpus changed while it was being prepared"):
        prepare(_cfg(tmp_path, source="text", path=str(d), val_fraction=0.3))
    assert not [n for n in os.listdir(tmp_path / "cache" / "prepared") if not n.endswith(".lock")]


def test_data_prepare_errors_are_one_line_with_exit_2(tmp_path, capsys):
    """`dilocox data prepare` gives the data layer's failures as `dilocox train` does: one line, exit 2."""
    cache = f"--data.cache_dir={tmp_path}"
    cases = {
        "does not exist": ["--data.source=text", f"--data.path={tmp_path}/nope.txt", cache],
        "has no meta.json": ["--data.source=memmap", f"--data.path={tmp_path}", cache],
        "no tokenizer file": [f"--data.tokenizer=hf:{tmp_path}/nope", cache],
        "--out needs a directory": [cache, "--out"],
    }
    for want, args in cases.items():
        assert cli_main(["data", "prepare", *args]) == 2, want
        err = capsys.readouterr().err.strip()
        assert err.startswith("data error: ") and want in err and "\n" not in err, err


def test_a_tokenizer_with_gaps_in_its_ids_counts_its_largest_id(tmp_path):
    """vocab_size = the largest id + 1: a tokenizer.json whose ids skip (here up to 1001) must not pass a
    model.vocab_size check sized by its token count (257), or the embedding is indexed past its end."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from dilocox.data.tokenizer import BPETokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    j = json.loads(path.read_text())
    j["model"]["vocab"]["h"] = 1000
    j["added_tokens"][0]["id"] = j["model"]["vocab"]["<|endoftext|>"] = 1001
    path.write_text(json.dumps(j))
    t = BPETokenizer.from_file(str(path))
    assert t.tok.get_vocab_size() == 257 and t.vocab_size == 1002 and t.eot_id == 1001
    assert max(t.encode("hh")) < t.vocab_size


def test_a_killed_builds_leftovers_are_removed_and_live_ones_kept(tmp_path):
    """A build killed by SIGKILL (the OOM killer) leaves its .tmp-<host>-<pid>-* directory; the next prepare in that
    directory removes those of this host whose process is gone, and keeps a live process's and another host's."""
    parent = tmp_path / "cache" / "prepared"
    parent.mkdir(parents=True)
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {
        "dead": f".tmp-{host}-{dead.pid}-abc",
        "live": f".tmp-{host}-{os.getppid()}-def",
        "other host": f".tmp-{host}x-{dead.pid}-ghi",
    }
    for n in names.values():
        (parent / n).mkdir()
        (parent / n / "train.bin").write_bytes(b"\0" * 100)
    p = prepare(_cfg(tmp_path, max_bytes=50_000))
    left = set(os.listdir(parent))
    assert names["dead"] not in left and names["live"] in left and names["other host"] in left
    assert ByteTokenizer().decode(p.train_tokens()[:10])


def test_an_exported_byte_tokenizer_given_as_hf_names_data_tokenizer_byte(tmp_path):
    """Found by review: `dilocox export` of a byte-level run writes a tokenizer.json of 256 ids (hf.byte_tokenizer_json;
    documents end with byte 0, no token of their own); given back as data.tokenizer=hf:DIR it failed with "has none
    of the end-of-document tokens ... use GPT-2's". It names data.tokenizer=byte, which reads the same ids."""
    from dilocox.data.tokenizer import BPETokenizer, ByteTokenizer
    from dilocox.hf import byte_tokenizer_json

    path = str(tmp_path / "tokenizer.json")
    byte_tokenizer_json(path)
    with pytest.raises(ValueError, match="use data.tokenizer=byte"):
        BPETokenizer.from_file(path)
    from tokenizers import Tokenizer

    text = "héllo, wörld\n"
    assert Tokenizer.from_file(path).encode(text).ids == ByteTokenizer().encode(text)  # (the advice's ids: the same)
