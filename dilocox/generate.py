"""``dilocox generate RUN_DIR|HF_DIR --prompt TEXT``: sample from a trained model (a quick look).

The model is the run's final model (gathered from the latest checkpoint of any layout, see
``dilocox.checkpoint.full.final_model``; a SWARM run's from its stages, ``dilocox.swarm.final``) or a Hugging Face
directory of the supported families (read through ``dilocox.hf``), run as one process on CPU or GPU. Sampling: greedy
(``--temperature 0``), or softmax(logits / temperature) restricted to the ``--top-k`` most likely
tokens, drawn from a ``torch.Generator`` seeded with ``--seed``: the same seed gives the same text. Generation stops
after the tokenizer's end-of-document token (as transformers' generate stops at ``eos_token_id``) unless ``--no-stop``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import torch

from dilocox.data.tokenizer import CountsBytes

USAGE = (
    "dilocox generate RUN_DIR|HF_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] "
    "[--seed S] [--device cpu|cuda] [--no-stop] [--replica-params]"
)


def load_model(path: str, device: str = "cpu", allow_replica_params: bool = False):
    """``(model, tokenizer, model_config)`` of a run directory or an HF model directory."""
    from dilocox import hf
    from dilocox.config import ModelConfig, load_config
    from dilocox.model.transformer import build_model

    if os.path.exists(os.path.join(path, "config.yaml")):  # a dilocox run
        from dilocox import checkpoint as ckpt
        from dilocox.checkpoint.full import final_model
        from dilocox.swarm import final as swarm_final

        cfg = load_config(os.path.join(path, "config.yaml"))
        if swarm_final.is_swarm_run(path):  # a `dilocox swarm --out` directory
            full, _ = swarm_final.final_model(path, cfg, allow_replica_params)
        else:
            ckpt_dir = run_checkpoint_dir(path, cfg)
            step_dir = ckpt.find_latest(ckpt_dir)
            if step_dir is None:
                raise FileNotFoundError(f"{path}: no complete checkpoint under {ckpt_dir}; train first")
            full = final_model(step_dir, cfg.model, allow_replica_params)
        mcfg = cfg.model
        tokenizer = run_tokenizer(cfg, path)
    else:
        hf_dir = hf.resolve_hf_dir(path)
        mcfg = ModelConfig(**hf.model_fields_from_hf(hf.read_hf_config(hf_dir)))
        full = hf.from_hf_state_dict(mcfg, hf.load_hf_tensors(hf_dir), src=hf_dir)
        tokenizer = hf_tokenizer(hf_dir)
    model = build_model(mcfg, device="meta")
    model.to_empty(device=device)
    model.load_full_state_dict(full)
    model.eval()
    return model, tokenizer, mcfg


def run_checkpoint_dir(run_dir: str, cfg) -> str:
    """Where a run's checkpoints are: ``checkpoint.dir`` where that directory exists, else ``RUN_DIR/checkpoints`` (a
    run dir copied or moved away from the absolute ``checkpoint.dir`` it trained with, its checkpoints inside it)."""
    ckpt_dir = cfg.checkpoint.dir
    return ckpt_dir if ckpt_dir and os.path.isdir(ckpt_dir) else os.path.join(run_dir, "checkpoints")


def run_tokenizer(cfg, run_dir: str | None = None):
    """The tokenizer a run trained with: bytes; the copy the trainer kept in ``run_dir`` (``rundir.keep_tokenizer``);
    a model's own (``data.tokenizer=hf:PATH``: read from PATH, no corpus needed); or the BPE of the run's prepared
    data under ``data.cache_dir``. Where that is missing too (a run from before the kept copy, with another current
    directory than the run's and a relative cache_dir, a deleted cache, a corpus changed since) the corpus is prepared
    again, with a note on stderr: a corpus that changed gives another BPE than the one the model learned."""
    from dilocox.data.tokenizer import PRETRAINED, BPETokenizer, ByteTokenizer, pretrained_path
    from dilocox.rundir import TOKENIZER

    data = cfg.data
    if data.tokenizer == "byte":
        return ByteTokenizer()
    if run_dir and os.path.isfile(kept := os.path.join(run_dir, TOKENIZER)):
        return BPETokenizer.from_file(kept)
    if data.tokenizer.startswith(PRETRAINED):
        return BPETokenizer.from_file(pretrained_path(data.tokenizer))
    from dilocox.data import prepare

    note_if_prepared_again(data, "to rebuild the run's BPE tokenizer; if the corpus changed since the run, that BPE is "
                           "not the one the model was trained with")  # fmt: skip
    return prepare(data).tokenizer()


def note_if_prepared_again(data, why: str) -> None:
    """A note on stderr when ``prepare(data)`` will tokenize the corpus again: the run's prepared data is not where
    its config says (a relative data.cache_dir read from another directory, a deleted cache, a moved corpus)."""
    from dilocox.data.prepare import default_out_dir

    if data.source != "memmap" and not os.path.exists(os.path.join(out := default_out_dir(data), "meta.json")):
        print(
            f"note: the run's tokenized data is not at {out} (data.cache_dir={data.cache_dir!r}, read from the "
            f"current directory when relative, and data.path={data.path!r} as it is now): preparing it again {why}",
            file=sys.stderr,
            flush=True,
        )


class _HFTokenizer(CountsBytes):
    """A tokenizer.json behind dilocox's encode/decode interface."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        from dilocox.data.tokenizer import eot_id_of

        self.tok = Tokenizer.from_file(path)
        self.kind = "bpe"
        # the largest id + 1 (as BPETokenizer): the ids below it are the ones :func:`sample` may draw
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eot_id = eot_id_of(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_docs(self, docs: list[str]):
        """As training tokenized them (``BPETokenizer.encode_docs``: a special token's text inside a document is
        text), each followed by the end-of-document token: ``dilocox eval HF_DIR --text`` scores what ``eval RUN``
        does."""
        import numpy as np

        from dilocox.data.tokenizer import BPETokenizer, special_tokens_as_text

        if self.eot_id is None:  # (a tokenizer without one: no separator, as before)
            with special_tokens_as_text(self.tok) as tok:
                return np.asarray([i for d in docs for i in tok.encode(d, add_special_tokens=False).ids])
        return BPETokenizer.encode_docs(self, docs)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def hf_tokenizer(hf_dir: str):
    meta = os.path.join(hf_dir, "tokenizer_config.json")
    if os.path.exists(meta):
        with open(meta) as f:
            if json.load(f).get("dilocox_tokenizer") == "byte":
                from dilocox.data.tokenizer import ByteTokenizer

                return ByteTokenizer()
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{hf_dir} has no tokenizer.json; generate needs one to encode the prompt")
    return _HFTokenizer(path)


def check_device(device: str) -> None:
    """ValueError naming ``--device`` unless it is ``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has."""
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if device != "cpu" and m is None:
        raise ValueError(f"--device {device!r} is not a device here; use --device cpu, cuda or cuda:N")
    if m and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if m and m.group(1) is not None and int(m.group(1)) >= (n := torch.cuda.device_count()):
        raise ValueError(f"--device {device}: this machine has {n} CUDA device(s); use cuda:0 .. cuda:{n - 1}")


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    """ValueError naming the flag whose value :func:`sample` cannot use."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={max_new_tokens} must be >= 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature={temperature} must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise ValueError(f"--top-k={top_k} must be >= 0 (0 = the whole vocabulary)")


@torch.no_grad()
def sample(
    model,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_id: int | None = None,
    vocab_size: int | None = None,
) -> list[int]:
    """Continue ``ids`` by up to ``max_new_tokens`` tokens, stopping after ``stop_id`` (see the module docstring).

    ``vocab_size``: the tokenizer's; ids at or above it (a model vocabulary padded past the tokenizer's, e.g.
    ``--model.vocab_size=512`` with the 256 bytes) have no text and are never drawn."""
    check_sampling(max_new_tokens, temperature, top_k)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(int(seed))
    ctx = model.mcfg.max_seq_len
    out = list(ids)
    for _ in range(max_new_tokens):
        x = torch.tensor([out[-ctx:]], dtype=torch.long, device=device)
        logits = model(x)[0, -1].float()
        if vocab_size is not None and 0 < vocab_size < logits.numel():
            logits = logits[:vocab_size]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:  # max subtracted, fp64 (a tiny T is no 0 in fp32): a tiny T gives -inf, not inf - inf = nan: greedy
            logits = (logits - logits.max()).double() / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        out.append(nxt)
        if stop_id is not None and nxt == stop_id:
            break
    return out[len(ids) :]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox generate", usage=USAGE)
    ap.add_argument("path", help="a run directory (its latest checkpoint) or a Hugging Face model directory")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default 100)")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (default 0.8)")
    ap.add_argument("--top-k", type=int, default=50, help="sample among the K most likely tokens (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--no-stop", action="store_true", help="keep going past the end-of-document token")
    ap.add_argument("--replica-params", action="store_true", help="allow a mid-run checkpoint of a DiLoCo run")
    a = ap.parse_args(argv)
    try:
        check_sampling(a.max_new_tokens, a.temperature, a.top_k)  # before the (slow) model load
        if not -(2**63) <= a.seed < 2**64:  # (torch.Generator.manual_seed's range)
            raise ValueError(f"--seed={a.seed} is out of range: give a whole number in [-2**63, 2**64)")
        check_device(a.device)
        model, tok, _ = load_model(a.path, a.device, a.replica_params)
        stop = None if a.no_stop else getattr(tok, "eot_id", None)
        ids = prompt_ids(tok, a.prompt)
        vocab = getattr(tok, "vocab_size", None)
        new = sample(model, ids, a.max_new_tokens, a.temperature, a.top_k, a.seed, stop, vocab)
        # a byte model's text is its bytes: decoded whole, a character cut between the prompt and the rest is kept
        text = tok.decode(ids + new) if tok.kind == "byte" else a.prompt + tok.decode(new)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text + "\n")
    return 0


def prompt_ids(tok, prompt: str) -> list[int]:
    """The token ids of ``--prompt``. Command-line bytes that are not UTF-8 reach Python as surrogates (PEP 383): a
    byte-level model takes those bytes as they are (all 256 are in its vocabulary); another tokenizer needs text."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(prompt)
        if tok.kind == "byte":
            return list(raw)
        raise ValueError(f"--prompt {raw!r} is not UTF-8 text, which this model's tokenizer needs") from None
    return tok.encode(prompt)
