"""Tokenizers: bytes (vocab 256), a byte-level BPE trained on the corpus with ``tokenizers``, or a pretrained one.

``data.tokenizer: hf:PATH`` loads a model's own ``tokenizer.json`` (PATH: the file, or a Hugging Face model
directory holding it, e.g. GPT-2's or Qwen's), so ``model.init_from`` keeps that model's vocabulary and ``dilocox
export`` writes the same tokenizer back; its end-of-document token is the first of ``EOT_CANDIDATES`` it has.

Common interface: ``encode(str) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``eot_id`` (the end-of-document token appended after every document),
``encode_docs(docs) -> np.ndarray`` (all documents, each followed by ``eot_id``) and
``byte_count(ids) -> int`` (the UTF-8 bytes the tokens stand for, exact for any cut of a byte-level stream:
``dilocox eval``'s bits per byte).

The BPE is GPT-2 style (ByteLevel pre-tokenizer and decoder, so any text round-trips exactly),
with one special token ``<|endoftext|>`` (id 0). It is trained on the training split only and
cached as JSON; ``load_or_train_bpe`` reuses the cached file when it exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable

import numpy as np

from dilocox.fsutil import atomic_path

EOT = "<|endoftext|>"
EOT_CANDIDATES = (EOT, "</s>", "<eos>", "<|im_end|>")  # GPT-2 / Qwen, Llama / OPT, Gemma, chat models
PRETRAINED = "hf:"  # data.tokenizer = hf:PATH


def pretrained_path(spec: str) -> str:
    """The ``tokenizer.json`` that ``data.tokenizer = hf:PATH`` names (PATH a file or a directory holding it), or a
    FileNotFoundError naming the field and the fix."""
    path = os.path.abspath(os.path.expanduser(spec[len(PRETRAINED) :]))
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data.tokenizer={spec!r}: no tokenizer file {path}; give a tokenizer.json or a Hugging Face model "
            "directory that holds one (data.tokenizer=hf:/path/to/gpt2)"
        )
    return path


class ByteTokenizer:
    """ids = the UTF-8 bytes of the text. Documents are separated by byte 0 (NUL)."""

    kind = "byte"
    vocab_size = 256
    eot_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def byte_count(self, ids: Iterable[int]) -> int:
        return len(ids) if isinstance(ids, np.ndarray) else sum(1 for _ in ids)

    def encode_docs(self, docs: list[str]) -> np.ndarray:
        sep = bytes([self.eot_id])  # (a NUL inside a document, e.g. a JSON "\u0000", would read as its end: dropped)
        return np.frombuffer(sep.join(d.encode("utf-8").replace(sep, b"") for d in docs) + sep, np.uint8).copy()


def byte_level_alphabet() -> dict[str, int]:
    """ByteLevel's character for each byte (GPT-2's scheme): the printable Latin-1 bytes stand for themselves, the
    other 68 bytes, in order, for the characters from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + n)] = b
            n += 1
    return out


def eot_id_of(tok) -> int | None:
    """The id of the first of ``EOT_CANDIDATES`` a ``tokenizers.Tokenizer`` has, else None."""
    return next((i for i in map(tok.token_to_id, EOT_CANDIDATES) if i is not None), None)


class CountsBytes:
    """``byte_count`` for a class holding a ``tokenizers.Tokenizer`` as ``tok``, with ``vocab_size`` and ``decode``."""

    tok: object
    vocab_size: int
    _byte_lengths: np.ndarray | None = None

    def byte_count(self, ids: Iterable[int]) -> int:
        """The UTF-8 bytes of ``ids``: summed per token under a ByteLevel decoder (a cut inside a character counts
        the bytes its tokens hold), else the length of the decoded text."""
        ids = np.asarray(ids if isinstance(ids, np.ndarray) else [int(i) for i in ids], dtype=np.int64)
        if self._byte_lengths is None:
            self._byte_lengths = token_byte_lengths(self.tok, self.vocab_size)
        if not len(self._byte_lengths):
            return len(self.decode(ids.tolist()).encode("utf-8"))  # type: ignore[attr-defined] (the subclass's)
        return int(self._byte_lengths[ids].sum()) if len(ids) else 0


def token_byte_lengths(tok, vocab_size: int) -> np.ndarray:
    """Bytes per id of a ``tokenizers.Tokenizer`` whose decoder is ByteLevel, as that decoder writes them: a token
    of the byte alphabet's characters one byte each, any other token (an added one, or one with a character outside
    the alphabet) its text's UTF-8 bytes. Empty for another decoder."""
    import json

    decoder = json.loads(tok.to_str()).get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
    if kinds != ["ByteLevel"]:
        return np.zeros(0, dtype=np.int64)
    alphabet = byte_level_alphabet()
    out = np.zeros(max(vocab_size, max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1), np.int64)
    for token, i in tok.get_vocab(with_added_tokens=False).items():
        out[i] = len(token) if all(ch in alphabet for ch in token) else len(token.encode("utf-8"))
    for i, added in tok.get_added_tokens_decoder().items():
        out[i] = len(added.content.encode("utf-8"))
    return out


@contextlib.contextmanager
def special_tokens_as_text(tok):
    """A ``tokenizers.Tokenizer`` that encodes a special token's text inside a document as text ("<|endoftext|>" in
    code about tokenizers, Qwen's "<|im_end|>": matched as the token, it cut the document in two and the model never
    saw the string); its setting is given back after."""
    literal, tok.encode_special_tokens = tok.encode_special_tokens, True
    try:
        yield tok
    finally:
        tok.encode_special_tokens = literal


class BPETokenizer(CountsBytes):
    """A ``tokenizers.Tokenizer`` (byte-level BPE) behind the common interface."""

    kind = "bpe"

    def __init__(self, tok, path: str | None = None):
        self.tok, self.path = tok, path
        # the largest id + 1, not the count of tokens: a tokenizer.json whose ids have gaps (or added tokens above its
        # vocabulary) would otherwise pass the model.vocab_size check and index past the embedding
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        eot = eot_id_of(tok)
        if eot is None and self.vocab_size == ByteTokenizer.vocab_size:  # (hf.byte_tokenizer_json: an export's)
            raise ValueError(
                f"tokenizer {path or ''} is a byte-level tokenizer of 256 ids, as `dilocox export` writes dilocox's "
                "byte tokenizer (its documents end with byte 0, not a token of their own): use data.tokenizer=byte"
            )
        if eot is None:
            raise ValueError(
                f"tokenizer {path or ''} has none of the end-of-document tokens {list(EOT_CANDIDATES)}; dilocox "
                "separates documents with one: use a tokenizer that has one (GPT-2's, Qwen's, Llama's)"
            )
        self.eot_id = eot

    @classmethod
    def from_file(cls, path: str) -> BPETokenizer:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(
                f"{path} is not a tokenizer file that the tokenizers package loads ({' '.join(str(e).split())[:200]}); "
                "data.tokenizer=hf:PATH needs a Hugging Face tokenizer.json (or the model directory holding one)"
            ) from None
        return cls(tok, path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_docs(self, docs: list[str]) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        parts = []
        # encode_batch_fast (tokenizers >= 0.20): the same ids without the offsets, ~2x faster; memory is ~70 bytes
        # per input byte either way (the Encoding objects), so callers keep batches small (prepare: 1 MB)
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        with special_tokens_as_text(self.tok):
            for enc in encode(docs, add_special_tokens=False):
                parts += [np.asarray(enc.ids, dtype=dtype), np.array([self.eot_id], dtype=dtype)]
        return np.concatenate(parts)

    def save(self, path: str) -> None:
        """Write the tokenizer JSON atomically (temp file + rename)."""
        with atomic_path(path) as tmp:
            self.tok.save(tmp)
        self.path = path


def train_bpe(docs: Iterable[str], vocab_size: int, length: int | None = None) -> BPETokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (256 bytes + EOT + merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"data.bpe_vocab_size={vocab_size} must be >= 257 (256 byte symbols + {EOT})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs) if length is None else length)
    return BPETokenizer(tok)


def load_or_train_bpe(
    train_docs: Iterable[str], vocab_size: int, cache_path: str, length: int | None = None
) -> BPETokenizer:
    """The BPE cached at ``cache_path`` if present, else train it on ``train_docs`` (a list, or an iterable of
    ``length`` documents: read once, as a stream) and cache it."""
    if os.path.exists(cache_path):
        tok = BPETokenizer.from_file(cache_path)
        if tok.vocab_size <= vocab_size:
            return tok
    tok = train_bpe(train_docs, vocab_size, length)
    tok.save(cache_path)
    return tok


def load_tokenizer(kind: str, path: str | None = None) -> ByteTokenizer | BPETokenizer:
    """Rebuild a tokenizer from a prepared directory's meta (``kind``, tokenizer file)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if not path or not os.path.exists(path):
            raise FileNotFoundError(f"BPE tokenizer file {path!r} is missing; re-run `dilocox data prepare`")
        return BPETokenizer.from_file(path)
    raise ValueError(f"unknown tokenizer kind {kind!r} (expected 'byte' or 'bpe')")


def tokenizer_sha256(path: str | None, kind: str | None) -> str | None:
    """The SHA-256 of a tokenizer file, of ``kind`` (``byte``) when it has none, None when the file is missing."""
    if path is None:
        return hashlib.sha256(str(kind).encode()).hexdigest()
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
