"""Sharded, atomic, verified checkpoints of the whole training state.

Layout (one directory per saved step, one file per rank)::

    <dir>/step_00000100/rank_00003.pt     this rank's shard: model, inner + outer optimizer,
                                          data position, RNG, ... (plain tensors/containers)
    <dir>/step_00000100/COMPLETE.json     written by rank 0 after every rank has saved; holds
                                          each shard's size and SHA-256
    <dir>/latest                          text: the name of the newest COMPLETE step dir

Every file is written to a temporary name and moved into place with ``os.replace`` (atomic
on POSIX), ``latest`` only after ``COMPLETE.json``. A crash at any point therefore leaves
the previous checkpoint and the previous ``latest`` untouched; a step directory without
``COMPLETE.json`` is ignored on resume. Loading uses ``torch.load(weights_only=True)``.

What is refused, so that a bad checkpoint never replaces a good one:

* a state with a NaN/Inf tensor anywhere (params, optimizer moments, outer state) is not
  saved (:class:`NonFiniteStateError`, naming the last good checkpoint); pruning runs only
  after a new checkpoint is complete, so the good ones stay;
* a shard whose size or SHA-256 does not match COMPLETE.json (flipped bits, truncation)
  raises :class:`CorruptCheckpointError` naming the file; :func:`load_latest` then falls back
  to the previous complete checkpoint (all ranks agree on which) and sets the bad one aside
  as ``step_XXXXXXXX.corrupt``;
* a full disk gives "no space left on device while writing <file> (needs ~N MB, free M MB)"
  and removes the partial step directory; :func:`preflight` checks writability and room for
  ``keep + 1`` checkpoints at start-up.

Layout: ``layout`` (names, atomic writes, COMPLETE.json, verification, the errors), ``state``
(NaN/Inf check, sizes, RNG state), ``save`` (``save_checkpoint``, ``preflight``), ``load``
(``load_checkpoint``, ``load_latest``, the rank agreements). Import from ``dilocox.checkpoint``
(``from dilocox import checkpoint as ckpt``): every name is re-exported here.
"""

from dilocox.checkpoint.layout import (
    HASH,
    CheckpointError,
    CorruptCheckpointError,
    NonFiniteStateError,
    complete_steps,
    file_hash,
    find_latest,
    read_meta,
    shard_path,
    step_dir_name,
    verify_shard,
)
from dilocox.checkpoint.load import all_ranks_agree, all_ranks_min, load_checkpoint, load_latest
from dilocox.checkpoint.save import disk_free, preflight, save_checkpoint
from dilocox.checkpoint.state import (
    estimate_bytes,
    iter_tensors,
    nonfinite_tensors,
    rng_state,
    set_rng_state,
    state_nbytes,
)

__all__ = [
    "HASH",
    "CheckpointError",
    "CorruptCheckpointError",
    "NonFiniteStateError",
    "all_ranks_agree",
    "all_ranks_min",
    "complete_steps",
    "disk_free",
    "estimate_bytes",
    "file_hash",
    "find_latest",
    "iter_tensors",
    "load_checkpoint",
    "load_latest",
    "nonfinite_tensors",
    "preflight",
    "read_meta",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "shard_path",
    "state_nbytes",
    "step_dir_name",
    "verify_shard",
]
