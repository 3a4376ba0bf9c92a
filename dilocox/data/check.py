"""``check_data``: prepare the configured corpus and check it can feed a run, before any rank starts.

``dilocox train`` calls it in the launching process (so a bad corpus is one line, not a traceback
buried in torchrun's report) and again on each rank (a cache hit). Every failure is a
:class:`DataError` (or a ``ConfigError`` for model.vocab_size) whose message names the file or
field and the fix.
"""

from __future__ import annotations

from dilocox.config import Config, ConfigError
from dilocox.data.prepare import PreparedData, prepare_or_error
from dilocox.data.sources import DataError


def check_data(cfg: Config) -> PreparedData:
    """Prepare (or reuse) ``cfg.data`` and check vocabulary and split sizes against ``cfg``."""
    p = prepare_or_error(cfg.data)
    if p.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the {p.meta['tokenizer']} "
            f"tokenizer's vocabulary ({p.vocab_size}, {p.dir}); set --model.vocab_size={p.vocab_size} "
            "or more (a multiple of parallel.tensor)"
        )
    tr = cfg.train
    need = tr.seq_len + 2  # one window of seq_len inputs plus the shifted target, with room to draw
    where = f"data.source={cfg.data.source!r}" + (f" data.path={cfg.data.path!r}" if cfg.data.path else "")
    if p.meta["train_tokens"] < need:
        raise DataError(
            f"{where} gives {p.meta['train_tokens']} training tokens, fewer than one sequence "
            f"(train.seq_len={tr.seq_len} needs {need}); give a larger corpus, raise data.max_bytes "
            "or lower train.seq_len"
        )
    step_tokens = tr.batch_size * (tr.seq_len + 1)
    if step_tokens > p.meta["train_tokens"]:  # (a typo such as 1e7: the validation windows alone filled the memory)
        raise DataError(
            f"one step reads train.batch_size x (train.seq_len + 1) = {tr.batch_size:,} x {tr.seq_len + 1} = "
            f"{step_tokens:,} tokens, more than the training split's {p.meta['train_tokens']:,} ({where}); lower "
            "train.batch_size (parallel.microbatches splits a step's batch) or give a larger corpus"
        )
    if tr.eval_batches and p.meta["val_tokens"] < need:
        raise DataError(
            f"{where} gives {p.meta['val_tokens']} validation tokens, fewer than one sequence "
            f"(train.seq_len={tr.seq_len} needs {need}); raise data.val_fraction, give a larger corpus "
            "or set train.eval_batches=0"
        )
    return p
