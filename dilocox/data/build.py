"""``build_data``: everything the training loop needs from the data layer, for one rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dilocox.config import Config, ConfigError
from dilocox.data.prepare import PreparedData, prepare
from dilocox.data.sampler import TokenSampler, unigram_entropy


@dataclass
class DataBundle:
    train: TokenSampler  # this rank's resumable training batches
    val: list[tuple[torch.Tensor, torch.Tensor]]  # fixed validation batches (this dp rank's rows)
    vocab_size: int  # the tokenizer's vocabulary (<= model.vocab_size)
    prepared: PreparedData

    def tokenizer(self):
        return self.prepared.tokenizer()

    def unigram_entropy(self) -> float:
        """Unigram entropy of the training split (nats/token): the context-free loss floor."""
        return unigram_entropy(self.prepared.train_tokens())


def build_data(cfg: Config, replica: int = 0, dp_rank: int = 0, mode: str = "random") -> DataBundle:
    """Prepare (or reuse) the corpus and build this rank's sampler and validation batches.

    ``replica`` and ``dp_rank`` are the rank's replica index and inner data-parallel index
    (``topology.coord.replica``, ``topology.coord.data``); tensor-parallel ranks and pipeline
    stages of one (replica, dp_rank) get identical batches. Safe to call on every rank at once.
    """
    p = prepare(cfg.data)
    if p.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the {p.meta['tokenizer']} "
                          f"tokenizer's vocabulary ({p.vocab_size}, {p.dir}); set model.vocab_size >= {p.vocab_size}")
    par, tr = cfg.parallel, cfg.train
    train = TokenSampler(p.train_tokens(), tr.seq_len, tr.batch_size, tr.seed, replica, par.replicas,
                         dp_rank, par.data, mode=mode)
    val = p.val_batches(tr.eval_batches, tr.batch_size, tr.seq_len, dp_rank, par.data) if tr.eval_batches else []
    return DataBundle(train, val, p.vocab_size, p)
