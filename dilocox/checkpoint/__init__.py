"""Sharded, atomic, verified checkpoints of the whole training state, on ``torch.distributed.checkpoint``.

Layout (one directory per saved step, one DCP checkpoint per replica inside)::

    <dir>/step_00000100/replica0/.metadata      DCP's index: every key's global shape and where its chunks are
    <dir>/step_00000100/replica0/__3_0.distcp   the chunks of replica 0's rank 3: model, inner + outer optimizer
                                                state by global parameter name, its data position, RNG, ...
                                                (``names``)
    <dir>/step_00000100/COMPLETE.json           written by rank 0 after every rank has saved; holds
                                                each file's size and SHA-256, the layout and the config
    <dir>/latest                                text: the name of the newest COMPLETE step dir

Each replica saves and reads its own DCP checkpoint over its own ranks (DCP's plan exchange stays inside the
cluster, never on the slow link); only the agreements (a flag per rank) span the replicas, at an outer sync.

The keys name what a tensor is, not where it lived (``dilocox.checkpoint.names``), so a checkpoint loads onto
another pipeline / tensor / data layout by DCP's own resharding. Checkpoints of the earlier format (one
``torch.save`` file per rank) convert once with ``dilocox checkpoint convert`` (``dilocox.checkpoint.legacy``).

DCP's files are complete (and fsynced) before rank 0 writes COMPLETE.json; it and ``latest`` are written to a
temporary name and moved into place with ``os.replace`` (atomic on POSIX), ``latest`` only after
``COMPLETE.json``. A crash at any point therefore leaves the previous checkpoint and the previous ``latest``
untouched; a step directory without ``COMPLETE.json`` is ignored on resume (and cleared by the next save at that
step). None of our values is pickled (DCP's tensor files, and JSON for the rest); DCP's ``.metadata`` index is a
pickle, read only after its SHA-256 matched COMPLETE.json and then only by an unpickler that resolves DCP's own
metadata classes and nothing else (``dilocox.checkpoint.reader``).

What is refused, so that a bad checkpoint never replaces a good one:

* a state with a NaN/Inf tensor anywhere (params, optimizer moments, outer state) is not
  saved (:class:`NonFiniteStateError`, naming the last good checkpoint); pruning runs only
  after a new checkpoint is complete, so the good ones stay;
* a file whose size or SHA-256 does not match COMPLETE.json (flipped bits, truncation)
  raises :class:`CorruptCheckpointError` naming the file; :func:`load_latest` then falls back
  to the previous complete checkpoint (all ranks agree on which) and sets the bad one aside
  as ``step_XXXXXXXX.corrupt``;
* a full disk gives "no space left on device while writing <file> (needs ~N MB, free M MB)"
  and removes the partial step directory; :func:`preflight` checks writability and room for
  ``keep + 1`` checkpoints at start-up.

Layout: ``layout`` (names, atomic writes, COMPLETE.json, verification, the errors), ``state``
(NaN/Inf check, sizes, RNG state), ``save`` (``save_checkpoint``, ``preflight``), ``load``
(``load_step``, ``load_latest``, the rank agreements), ``names`` (the state by global names, to DCP and back),
``legacy`` (the converter of the earlier format). Import from ``dilocox.checkpoint``
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
    rank_files,
    read_meta,
    step_dir_name,
    verify_files,
)
from dilocox.checkpoint.load import (
    CONTINUE_DIR,
    Reader,
    WholeReader,
    all_ranks_agree,
    all_ranks_min,
    check_meta,
    load_checkpoint,
    load_latest,
    load_step,
    set_aside_later,
)
from dilocox.checkpoint.save import disk_free, preflight, remove_step_dir, save_checkpoint
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
    "Reader",
    "WholeReader",
    "check_meta",
    "load_checkpoint",
    "load_latest",
    "load_step",
    "nonfinite_tensors",
    "preflight",
    "remove_step_dir",
    "read_meta",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "set_aside_later",
    "CONTINUE_DIR",
    "rank_files",
    "state_nbytes",
    "step_dir_name",
    "verify_files",
]
