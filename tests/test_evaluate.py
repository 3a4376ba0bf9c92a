"""``dilocox eval``: every token but the first predicted once; the loss equals transformers' on the same windows of an
exported model; a zeroed head gives exactly ln(vocab); a run's validation split by default; bad input is one line."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dilocox import hf
from dilocox.config import load_config
from dilocox.data.tokenizer import ByteTokenizer
from dilocox.evaluate import evaluate, main, token_nll, val_tokens, windows
from dilocox.model.transformer import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(40)) + "caf\u00e9 \u00fcber\n"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = load_config(os.path.join(ROOT, "configs", "model", "qwen-tiny.yaml"), ["--model.n_layers=2"])
    out = str(tmp_path_factory.mktemp("eval") / "hf")
    hf.save_hf_dir(out, cfg.model, build_model(cfg.model, seed=3).gather_full_state_dict(), ByteTokenizer())
    (tmp_path_factory.getbasetemp() / "eval.txt").write_text(TEXT)
    return out


@pytest.mark.parametrize("n", [2, 3, 17, 64, 65, 66, 200])
@pytest.mark.parametrize("s", [1, 16, 64])
def test_windows_predict_every_token_but_the_first_once(n, s):
    spans = windows(n, s)
    predicted = [i for a, b in spans for i in range(a + 1, b)]
    assert predicted == list(range(1, n))
    assert all(2 <= b - a <= s + 1 for a, b in spans)


def test_the_loss_equals_transformers_on_the_same_windows(hf_dir, tmp_path_factory):
    """The exported model read back by transformers (an independent implementation), each window's mean loss (its
    ``labels``) times its predicted tokens, summed: the same nats as ``dilocox eval --text`` over the same stream."""
    transformers = pytest.importorskip("transformers")
    text = str(tmp_path_factory.getbasetemp() / "eval.txt")
    r = evaluate(hf_dir, text=text, seq_len=48, batch_size=3)
    ids = list(TEXT.encode()) + [0]  # the byte tokenizer's document, then its end-of-document token
    assert (r["tokens"], r["predicted"], r["bytes"]) == (len(ids), len(ids) - 1, len(TEXT.encode()))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    nll = 0.0
    with torch.no_grad():
        for a, b in windows(len(ids), 48):
            w = torch.tensor([ids[a:b]])
            nll += float(ref(input_ids=w, labels=w).loss) * (b - a - 1)
    assert r["loss"] == pytest.approx(nll / (len(ids) - 1), rel=1e-5)
    assert r["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(TEXT.encode()), rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))


def test_the_batch_size_does_not_change_the_sum():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--model.n_layers=1"])
    model = build_model(cfg.model, seed=0).eval()
    tokens = np.random.default_rng(0).integers(0, 256, 1000)
    one = token_nll(model, tokens, 64, batch_size=1)
    assert one[1] == 999
    for bs in (2, 5, 100):
        got = token_nll(model, tokens, 64, batch_size=bs)
        assert got[1] == 999 and got[0] == pytest.approx(one[0], rel=1e-6)


def test_a_zeroed_head_scores_exactly_ln_vocab(tmp_path, monkeypatch):
    """Uniform logits: the loss is ln(V) for every token, whatever the text (a known answer, no reference model)."""
    import dilocox.generate as gen

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--model.n_layers=1"])
    model = build_model(cfg.model, seed=0).eval()
    head = [p for n, p in model.named_parameters() if n.startswith("lm_head") or n.startswith("head")]
    assert head, [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        for p in head:
            p.zero_()
    monkeypatch.setattr(gen, "load_model", lambda *a, **k: (model, ByteTokenizer(), cfg.model))
    (tmp_path / "t.txt").write_text(TEXT)
    r = evaluate("any", text=str(tmp_path / "t.txt"), seq_len=100)
    v = cfg.model.vocab_size
    assert r["loss"] == pytest.approx(math.log(v), rel=1e-6)
    assert r["bits_per_byte"] == pytest.approx(r["predicted"] * math.log2(v) / len(TEXT.encode()), rel=1e-6)


def test_a_run_is_evaluated_on_its_validation_split(tmp_path, capsys, monkeypatch):
    from dilocox.data import prepare
    from dilocox.train import train
    from tests.small_run import small_cfg

    cfg = small_cfg(str(tmp_path / "run"), "--train.seq_len=64", steps=4)
    train(cfg)
    monkeypatch.chdir(tmp_path)  # (the run's data.cache_dir is absolute: the eval finds it from anywhere)
    run_dir = cfg.log.run_dir
    capsys.readouterr()
    assert main([run_dir, "--json", "--seq-len", "32"]) == 0
    r = json.loads(capsys.readouterr().out)
    val = prepare(cfg.data).val_tokens()
    assert r["source"] == "the run's validation split" and r["tokens"] == len(val) and r["predicted"] == len(val) - 1
    assert r["bytes"] == int(np.count_nonzero(np.asarray(val) != 0))  # bytes: the non-separator byte tokens
    assert 0 < r["loss"] < math.log(cfg.model.vocab_size) + 0.5
    assert main([run_dir, "--max-tokens", "100"]) == 0
    out = capsys.readouterr().out  # the default window: the run's train.seq_len (64), not model.max_seq_len
    assert "99 tokens predicted" in out and "windows of 64)" in out and cfg.model.max_seq_len > 64, out
    head, n_bytes = val_tokens(run_dir, ByteTokenizer(), 100)  # (only those are read: not the whole split first)
    assert head.tolist() == np.asarray(val[:100]).tolist() and n_bytes == int(np.count_nonzero(head))
    # a validation split tokenized otherwise than the model's tokenizer (a BPE trained again on an edited corpus)
    other = SimpleNamespace(tok=SimpleNamespace(to_str=lambda: "another BPE"), eot_id=0, decode=lambda ids: "")
    with pytest.raises(ValueError, match="tokenized with another tokenizer than the model's"):
        val_tokens(run_dir, other)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--seq-len", "0"], "--seq-len=0 must be in [1, model.max_seq_len="),
        (["--seq-len", "100000"], "--seq-len=100000 must be in [1, model.max_seq_len="),
        (["--max-tokens", "1"], "--max-tokens=1 must be >= 2"),
        (["--batch-size", "0"], "--batch-size=0 must be >= 1"),
        ([], "is a Hugging Face directory: give the text to evaluate on with --text PATH"),
        (["--text", "/nonexistent/x.txt"], "--text /nonexistent/x.txt: does not exist"),
        (["--text", ""], "--text is empty"),
    ],
)
def test_bad_input_is_one_line_exit_2(hf_dir, args, msg, capsys):
    assert main([hf_dir, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eval: ") and msg in err and len(err.strip().splitlines()) == 1, err


def test_a_cut_inside_a_character_counts_the_bytes_its_tokens_hold(hf_dir, tmp_path_factory):
    """``--max-tokens`` cutting inside "é" (2 bytes): the byte tokenizer's count is the cut's length (decoding the cut
    gave U+FFFD, 3 bytes, before)."""
    text = str(tmp_path_factory.getbasetemp() / "eval.txt")
    cut = TEXT.encode().index("é".encode()) + 1
    r = evaluate(hf_dir, text=text, seq_len=48, max_tokens=cut)
    assert (r["tokens"], r["bytes"]) == (cut, cut)


def test_a_byte_level_bpe_counts_every_cut_exactly():
    """For every cut of a byte-level BPE stream, the two sides' bytes add up to the text's, and a cut the decoder
    renders whole (no U+FFFD) counts the decoded text's bytes (tokenizers' own ByteLevel decoder as the reference)."""
    from tokenizers import pre_tokenizers

    from dilocox.data.tokenizer import byte_level_alphabet, train_bpe

    assert set(byte_level_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    docs = ["caf\u00e9 \u00fcber \u65e5\u672c\u8a9e \u2713 " * 15, "emoji \U0001f389\U0001f389 d\u00e9j\u00e0 vu " * 12]
    tok = train_bpe(docs, 320)
    whole = 0
    for d in docs:
        ids, n = tok.encode(d), len(d.encode("utf-8"))
        assert tok.byte_count(ids) == n
        for k in range(len(ids) + 1):
            head = tok.byte_count(ids[:k])
            assert head + tok.byte_count(ids[k:]) == n, k
            text = tok.decode(ids[:k])
            if "\ufffd" not in text:
                whole += 1
                assert head == len(text.encode("utf-8")), k
    assert whole > 20


def test_another_decoder_counts_the_decoded_text():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dilocox.data.tokenizer import BPETokenizer

    t = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "ab": 1, "\u00e9t\u00e9": 2, "[UNK]": 3}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = BPETokenizer(t)
    ids = tok.encode("ab \u00e9t\u00e9 ab")
    assert ids == [1, 2, 1] and tok.byte_count(ids) == len(tok.decode(ids).encode("utf-8"))


def test_a_hugging_face_directory_with_a_byte_level_bpe_counts_a_cut_exactly(tmp_path):
    from dilocox.data.tokenizer import train_bpe

    text = "".join(chr(0x4E00 + 7 * i) for i in range(150)) + " caf\u00e9 " * 20  # few merges: characters split
    tok = train_bpe([text], 270)
    over = ["--model.n_layers=1", "--model.vocab_size=320"]
    cfg = load_config(os.path.join(ROOT, "configs", "model", "qwen-tiny.yaml"), over)
    out = str(tmp_path / "hf")
    hf.save_hf_dir(out, cfg.model, build_model(cfg.model, seed=3).gather_full_state_dict(), tok)
    (tmp_path / "t.txt").write_text(text)
    ids = tok.encode(text)
    cuts = [k for k in range(2, 40) if "\ufffd" in tok.decode(ids[:k])]  # cuts inside a character
    assert cuts
    for k in cuts[:3]:
        r = evaluate(out, text=str(tmp_path / "t.txt"), seq_len=16, max_tokens=k)
        assert r["bytes"] == tok.byte_count(ids[:k]) and r["bytes"] + tok.byte_count(ids[k:]) == len(text.encode())


def test_a_token_outside_the_byte_alphabet_counts_as_the_decoder_writes_it():
    """ByteLevel's decoder writes a token with any character outside its alphabet as that token's UTF-8 text (a
    vocabulary extended with raw text); an added token is its text too."""
    from tokenizers import Tokenizer, decoders, models

    from dilocox.data.tokenizer import token_byte_lengths

    t = Tokenizer(models.BPE({"<|endoftext|>": 0, "a": 1, "\u0120\u65e5": 2, "\u0120a\u00c3\u00a9": 3}, []))
    t.decoder = decoders.ByteLevel()
    t.add_tokens(["d\u00e9j\u00e0"])
    want = [len(t.decode([i]).encode("utf-8")) for i in (1, 2, 3)]
    assert want == [1, 5, 4]  # "a"; "\u0120\u65e5" whole as its UTF-8; "\u0120a\u00c3\u00a9" is " a\u00e9"
    # the added token: its text's 6 bytes (tokenizers 0.23's ByteLevel decoder garbles it to "d\ufffdj\ufffd")
    assert list(token_byte_lengths(t, 5))[1:] == [*want, 6]
