"""Samplers over a token array: resumable training windows and fixed validation windows.

Training batches are a pure function of ``(seed, replica, step)``: no hidden iterator state,
so replicas see different data, every rank of a replica (pipeline stages, tensor ranks) can
build the same batch independently, and resuming is exact: ``state_dict()`` is the step.
The full replica batch of ``batch_size`` windows is drawn and a data-parallel rank takes its
contiguous ``batch_size / dp_size`` rows, so the data a replica sees does not depend on how
many inner data-parallel ranks share it.

Modes:

- ``random`` (default)  window starts uniform in ``[0, N - seq_len - 1]``, drawn by a
                        ``torch.Generator`` seeded with ``hash(seed, replica, step)``: i.i.d.
                        windows, with replacement; two replicas (or one, over time) read the
                        same tokens as often as two independent draws do.
- ``epoch``             non-overlapping windows (stride ``seq_len``) in a per-epoch random
                        order shared by all replicas; replica r takes the r-th slice of each
                        step's ``n_replicas * batch_size`` windows, so replicas never overlap
                        within an epoch; the remainder of an epoch is dropped.

``data.sampler`` picks the mode. The state holds what a batch depends on (the seed, the
corpus's content and tokenizer, the mode, and in ``epoch`` mode ``n_replicas``, ``batch_size``
and ``seq_len``, which map steps to windows); a resume that differs in one is refused.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dilocox.config import ConfigError
from dilocox.seeding import text_seed

MODES = ("random", "epoch")


def _check_ids(tokens: np.ndarray, x: torch.Tensor, y: torch.Tensor, vocab_size: int | None, what: str) -> None:
    """Refuse a batch holding an id >= ``vocab_size`` (a damaged token file: one line, not an IndexError inside the
    embedding, nor training on another token's row when it is below model.vocab_size)."""
    if vocab_size is None or not x.numel() or (top := max(int(x.max()), int(y[:, -1].max()))) < vocab_size:
        return
    from dilocox.data.sources import DataError

    raise DataError(
        f"{getattr(tokens, 'filename', None) or 'the token file'} holds token id {top} (in {what}), not below the "
        f"tokenizer's vocabulary of {vocab_size}: the file is damaged; prepare the data again (dilocox data prepare, "
        "into a new --out or after deleting it)"
    )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) LongTensors [len(starts), seq_len]; y is x shifted left by one token."""
    idx = starts.astype(np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    w = torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class TokenSampler:
    """Deterministic training batches over a 1-D token array (usually a ``np.memmap``)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        replica: int = 0,
        n_replicas: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        mode: str = "random",
        content: str | None = None,
        tokenizer: str | None = None,
        vocab_size: int | None = None,
    ):
        n = len(tokens)
        if n < seq_len + 2:
            raise ValueError(
                f"the training split has {n} tokens, too few for train.seq_len={seq_len} "
                "(need seq_len + 2); raise data.max_bytes or lower train.seq_len"
            )
        if not 0 <= replica < n_replicas:
            raise ValueError(f"replica={replica} must be in [0, n_replicas={n_replicas})")
        if batch_size % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"train.batch_size={batch_size} must split evenly over dp_size={dp_size} "
                f"data-parallel ranks (dp_rank={dp_rank})"
            )
        if mode not in MODES:
            raise ValueError(f"sampler mode={mode!r} is not one of {list(MODES)}")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.replica, self.n_replicas, self.dp_rank, self.dp_size, self.mode = (
            replica,
            n_replicas,
            dp_rank,
            dp_size,
            mode,
        )
        self.content = content  # the corpus's content hash (prepare's meta), checked on resume when both have one
        self.vocab_size = vocab_size  # every id of a batch must be below it (a damaged token file: one line)
        self.tokenizer = tokenizer  # its tokenizer's hash (PreparedData.identity): a new tokenizer file at the same
        # path, or another tokenization, leaves the text and often the token count as they were
        self.step = 0
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, window order) cache
        if mode == "epoch":
            self.n_windows = (n - 1) // seq_len
            self.steps_per_epoch = self.n_windows // (batch_size * n_replicas)
            if self.steps_per_epoch == 0:
                raise ConfigError(
                    f"data.sampler=epoch: the training split's {self.n_windows} windows of train.seq_len={seq_len} "
                    f"are fewer than one step of train.batch_size x replicas = {batch_size * n_replicas}; use a "
                    "larger corpus, a smaller train.batch_size or train.seq_len, or data.sampler=random"
                )

    @property
    def tokens_per_step(self) -> int:
        """Tokens this rank trains on per step."""
        return self.batch_size // self.dp_size * self.seq_len

    def starts(self, step: int) -> np.ndarray:
        """Window start offsets of the replica's full batch at ``step`` (int64 [batch_size])."""
        if self.mode == "random":
            g = torch.Generator().manual_seed(text_seed(repr((self.seed, self.replica, step))))
            return torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size,), generator=g).numpy()
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(text_seed(repr((self.seed, "epoch", epoch))))
            self._perm = (epoch, torch.randperm(self.n_windows, generator=g).numpy())
        first = (k * self.n_replicas + self.replica) * self.batch_size
        return self._perm[1][first : first + self.batch_size] * self.seq_len

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the batch at ``step``: x, y LongTensor [batch_size/dp_size, seq_len]."""
        b = self.batch_size // self.dp_size
        rows = self.starts(step)[self.dp_rank * b : (self.dp_rank + 1) * b]
        x, y = _windows(self.tokens, rows, self.seq_len)
        _check_ids(self.tokens, x, y, self.vocab_size, f"the batch of step {step}")
        return x, y

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "seed": self.seed,
            "replica": self.replica,
            "mode": self.mode,
            "n_tokens": len(self.tokens),
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "n_replicas": self.n_replicas,
            **({"content_sha256": self.content} if self.content else {}),
            **({"tokenizer_sha256": self.tokenizer} if self.tokenizer else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state['step']``. Refuses a state taken over different data, tokens or seed, and in ``epoch``
        mode one whose steps map to other windows (another n_replicas, batch_size or seq_len)."""
        mine_all = self.state_dict()
        keys = ["seed", "n_tokens", "mode", "content_sha256", "tokenizer_sha256"]  # (the content: an edit that kept
        if self.mode == "epoch":  # the token count; the tokenizer: the same text, other ids)
            keys += ["n_replicas", "batch_size", "seq_len"]
        for k in keys:
            mine, theirs = mine_all.get(k), state.get(k)
            if k in state and k in mine_all and theirs != mine:
                if k.endswith("_sha256"):
                    theirs, mine = f"{str(theirs)[:12]}...", f"{str(mine)[:12]}..."
                if k in ("n_replicas", "batch_size", "seq_len"):
                    raise ConfigError(
                        f"the checkpoint's sampler (data.sampler=epoch) has {k}={theirs!r}, this run's {k}={mine!r}: "
                        "its steps would read other windows than those it stands for (some twice, some never). "
                        "Resume with the replicas (outer.elastic.max_replicas when elastic), train.batch_size and "
                        "train.seq_len it was saved with, or start a fresh --log.run_dir"
                    )
                raise ConfigError(  # (an input error: exit 2, the checkpoint itself is fine)
                    f"the checkpoint was trained on different data or seed (its sampler has {k}={theirs!r}, this "
                    f"run's {k}={mine!r}): the corpus (data.path's files) or a data.* key changed since it was saved. "
                    "Resume on the data it was trained on, or train on the new data in a new --log.run_dir "
                    "(to start from these weights: dilocox export RUN_DIR --to hf OUT, then --model.init_from=OUT)"
                )
        self.step = int(state["step"])


def val_batches(
    tokens: np.ndarray,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    vocab_size: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` fixed validation batches: windows evenly spaced over the whole split.

    No randomness and no replica dependence, so every replica, method and call evaluates the
    same tokens and validation losses are comparable. ``dp_rank``/``dp_size`` select rows the
    same way as :class:`TokenSampler`.
    """
    n = len(tokens)
    if n < seq_len + 2:
        raise ValueError(
            f"the validation split has {n} tokens, too few for train.seq_len={seq_len}; "
            "raise data.val_fraction or data.max_bytes"
        )
    if batch_size % dp_size:
        raise ValueError(f"batch_size={batch_size} must split evenly over dp_size={dp_size}")
    starts = np.linspace(0, n - seq_len - 1, n_batches * batch_size).round().astype(np.int64)
    b = batch_size // dp_size
    out = []
    for i in range(n_batches):
        rows = starts[i * batch_size : (i + 1) * batch_size][dp_rank * b : (dp_rank + 1) * b]
        out.append(_windows(tokens, rows, seq_len))
        _check_ids(tokens, *out[-1], vocab_size, f"validation batch {i}")
    return out


def unigram_entropy(tokens: np.ndarray, chunk: int = 1 << 24) -> float:
    """Entropy of the token frequency distribution, in nats/token.

    The loss of the best context-free model: a model that trains at all should go below it.
    """
    counts = np.zeros(0, dtype=np.int64)
    for i in range(0, len(tokens), chunk):
        c = np.bincount(np.asarray(tokens[i : i + chunk]))
        if len(c) > len(counts):
            c[: len(counts)] += counts
            counts = c
        else:
            counts[: len(c)] += c
    p = counts[counts > 0] / max(int(counts.sum()), 1)
    return float(-(p * np.log(p)).sum()) if len(p) else math.nan
