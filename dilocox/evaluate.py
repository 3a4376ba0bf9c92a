"""``dilocox eval RUN_DIR|HF_DIR [--text PATH]``: the held-out loss of a trained model, over every token once.

The model is loaded as ``dilocox generate`` loads it (a run's final model from its latest checkpoint of any layout, a
SWARM run's, or a Hugging Face directory of the supported families). The tokens are either the run's own validation
split (its prepared data under ``data.cache_dir``; the default for a run directory) or ``--text PATH``: a UTF-8 file,
a directory or a glob, read as ``data.source=text`` reads it (one file = one document; a file over 1 MB, one per MB)
and encoded with the model's tokenizer, each document followed by the end-of-document token, as training saw them.

The stream is cut into consecutive windows of ``--seq-len`` + 1 tokens (default: a run's ``train.seq_len``, the
positions it trained; for a Hugging Face directory ``model.max_seq_len``, at most 1,024) that overlap by one token
(each window predicts its last ``seq-len`` tokens from the ones before them, inside the window): every token but the
first is predicted exactly once, with at most ``seq-len`` tokens of context (the non-overlapping evaluation of GPT-2's
and nanoGPT's reports; a sliding window with more context gives a lower loss). Reported:

* ``loss``: the mean cross-entropy in nats per predicted token (fp32 logits, the model's whole vocabulary, as in
  training), and ``perplexity`` = exp(loss);
* ``bits_per_byte``: the summed cross-entropy in bits over the UTF-8 bytes of the text evaluated (end-of-document
  tokens have no bytes, their loss counts): comparable across tokenizers, where the loss per token is not. The bytes
  are counted per token (``byte_count``), so a ``--max-tokens`` cut inside a character counts the bytes its tokens
  hold; under a tokenizer without a byte-level decoder (a SentencePiece ``hf:`` one), the decoded text's bytes.

Windows run in batches of ``--batch-size`` under ``torch.no_grad``; the result does not depend on the batch size
beyond float summation order. ``--max-tokens`` evaluates only the first N tokens (a quick look at a large corpus).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

HF_WINDOW = 1024  # an HF directory's default window: at most this (Qwen2's max_seq_len of 32,768 with fp32 logits over
# its 152k vocabulary would be ~20 GB a window)

USAGE = (
    "dilocox eval RUN_DIR|HF_DIR [--text PATH] [--seq-len S] [--batch-size B] [--max-tokens N] [--device cpu|cuda] "
    "[--json] [--replica-params]"
)


def windows(n_tokens: int, seq_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each window of the stream (``end - start`` <= seq_len + 1; consecutive windows share one
    token), so that the predicted positions ``start+1 .. end-1`` cover ``1 .. n_tokens-1`` once each."""
    if seq_len < 1:
        raise ValueError(f"--seq-len={seq_len} must be >= 1")
    return [(s, min(s + seq_len + 1, n_tokens)) for s in range(0, max(n_tokens - 1, 0), seq_len)]


@torch.no_grad()
def token_nll(model, tokens: np.ndarray, seq_len: int, batch_size: int = 8) -> tuple[float, int]:
    """(summed cross-entropy in nats, number of predicted tokens) of ``model`` over the stream ``tokens``."""
    if batch_size < 1:
        raise ValueError(f"--batch-size={batch_size} must be >= 1")
    device = next(model.parameters()).device
    spans = windows(len(tokens), seq_len)
    total, count = 0.0, 0
    # full windows in batches; the last, shorter one (if any) by itself
    full = [s for s in spans if s[1] - s[0] == seq_len + 1]
    rest = [s for s in spans if s[1] - s[0] != seq_len + 1]
    groups = [full[i : i + batch_size] for i in range(0, len(full), batch_size)] + [[s] for s in rest]
    for group in groups:
        w = torch.as_tensor(np.stack([tokens[a:b] for a, b in group]).astype(np.int64), device=device)
        logits = model(w[:, :-1]).float()
        total += float(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    return total, count


def encode_docs(tok, docs: list[str]) -> np.ndarray:
    """The documents as one token stream, each followed by the tokenizer's end-of-document token (as training)."""
    if hasattr(tok, "encode_docs"):
        return np.asarray(tok.encode_docs(docs)).astype(np.int64)
    eot = getattr(tok, "eot_id", None)
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d) + ([] if eot is None else [eot])
    return np.asarray(ids, dtype=np.int64)


def text_tokens(tok, path: str) -> tuple[np.ndarray, int]:
    """(tokens, UTF-8 bytes) of ``--text PATH`` read as ``data.source=text``."""
    from dilocox.config import DataConfig
    from dilocox.data.sources import DataError, read_corpus

    if not path.strip():
        raise ValueError("--text is empty: give a UTF-8 text file, a directory of them or a glob")
    try:
        docs = read_corpus(DataConfig(source="text", path=path)).docs
    except (DataError, FileNotFoundError) as e:  # (their messages name data.path and data.source: say --text)
        why = str(e).split("; ")[0].replace(f"data.path={path!r}", "").replace("data.source='text'", "").strip()
        raise ValueError(f"--text {path}: {why}; give a UTF-8 text file, a directory of them or a glob") from None
    return encode_docs(tok, docs), sum(len(d.encode("utf-8")) for d in docs)


def val_tokens(run_dir: str, tok, max_tokens: int | None = None) -> tuple[np.ndarray, int]:
    """(tokens, UTF-8 bytes) of a run's validation split, or of its first ``max_tokens`` (its prepared data;
    prepared again where missing); only those are read from the memmap."""
    from dilocox.config import load_config
    from dilocox.data import prepare
    from dilocox.generate import note_if_prepared_again

    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    note_if_prepared_again(cfg.data, "for its validation split")
    prepared = prepare(cfg.data)
    mine, theirs = (getattr(getattr(t, "tok", None), "to_str", lambda: None)() for t in (tok, prepared.tokenizer()))
    if mine != theirs:  # (a BPE trained again on a corpus that changed since the run: other ids for the same text)
        raise ValueError(
            f"{run_dir}: the run's validation split (prepared at {prepared.dir}) is tokenized with another tokenizer "
            "than the model's: the corpus changed since the run; evaluate on a text with --text PATH"
        )
    tokens = np.asarray(prepared.val_tokens()[:max_tokens]).astype(np.int64)
    return tokens, text_bytes(tok, tokens)


def text_bytes(tok, tokens: np.ndarray) -> int:
    """The UTF-8 bytes the ``tokens`` stand for (end-of-document tokens have none; a stream cut inside a character
    counts the bytes its tokens hold under a byte-level tokenizer, the decoded text's under another)."""
    eot = getattr(tok, "eot_id", None)
    ids = np.asarray(tokens, dtype=np.int64)
    ids = ids if eot is None else ids[ids != eot]  # (vectorised: a split of 10^8 tokens is no Python list)
    count = getattr(tok, "byte_count", None)
    return count(ids) if count is not None else len(tok.decode(ids.tolist()).encode("utf-8"))


def evaluate(path: str, text: str | None = None, seq_len: int | None = None, batch_size: int = 8,
             max_tokens: int | None = None, device: str = "cpu", replica_params: bool = False) -> dict:  # fmt: skip
    """The report of the module docstring, as a dict."""
    from dilocox.config import load_config
    from dilocox.generate import load_model

    if max_tokens is not None and max_tokens < 2:  # (the flags first: before the slow model load)
        raise ValueError(f"--max-tokens={max_tokens} must be >= 2 (one token predicted from one before it)")
    if batch_size < 1:
        raise ValueError(f"--batch-size={batch_size} must be >= 1")
    model, tok, mcfg = load_model(path, device, replica_params)
    is_run = os.path.exists(os.path.join(path, "config.yaml"))
    if seq_len is None:  # a run: the positions it trained (a learned position table is untrained beyond them)
        trained = load_config(os.path.join(path, "config.yaml")).train.seq_len if is_run else HF_WINDOW
        seq_len = min(trained, mcfg.max_seq_len)
    if not 1 <= seq_len <= mcfg.max_seq_len:
        raise ValueError(f"--seq-len={seq_len} must be in [1, model.max_seq_len={mcfg.max_seq_len}]")
    if text is not None:
        tokens, n_bytes = text_tokens(tok, text)
        source = f"text {text}"
    elif is_run:
        tokens, n_bytes = val_tokens(path, tok, max_tokens)
        source = "the run's validation split"
    else:
        raise ValueError(f"{path} is a Hugging Face directory: give the text to evaluate on with --text PATH")
    if max_tokens is not None and len(tokens) > max_tokens:
        tokens = tokens[:max_tokens]
        n_bytes = text_bytes(tok, tokens)
    if len(tokens) < 2:
        raise ValueError(f"{source}: {len(tokens)} token(s); at least 2 are needed to predict one")
    if int(tokens.max()) >= mcfg.vocab_size:
        raise ValueError(f"{source}: token id {int(tokens.max())} is outside model.vocab_size={mcfg.vocab_size}")
    nll, count = token_nll(model, tokens, seq_len, batch_size)
    loss = nll / count
    return {
        "model": path,
        "source": source,
        "tokens": int(len(tokens)),
        "predicted": count,
        "bytes": n_bytes,
        "seq_len": seq_len,
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "bits_per_byte": nll / math.log(2) / n_bytes if n_bytes else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox eval", usage=USAGE, description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a run directory (its latest checkpoint) or a Hugging Face model directory")
    ap.add_argument("--text", help="a UTF-8 file, directory or glob to evaluate on (default: the run's val split)")
    ap.add_argument("--seq-len", type=int, help="tokens per window (default: a run's train.seq_len; HF: <= 1024)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    ap.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--replica-params", action="store_true", help="allow a mid-run checkpoint of a DiLoCo run")
    a = ap.parse_args(argv)
    try:
        from dilocox.generate import check_device

        check_device(a.device)
        r = evaluate(a.path, a.text, a.seq_len, a.batch_size, a.max_tokens, a.device, a.replica_params)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"eval: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(r))
    else:
        bpb = "-" if r["bits_per_byte"] is None else f"{r['bits_per_byte']:.4f}"
        print(f"{r['source']}: {r['predicted']:,} tokens predicted ({r['bytes']:,} bytes, windows of {r['seq_len']}) "
              f"| loss {r['loss']:.4f} | ppl {r['perplexity']:.2f} | bits/byte {bpb}")  # fmt: skip
    return 0
