"""DCP's index read without an unrestricted unpickler (dilocox/checkpoint/reader.py).

torch 2.13's ``FileSystemReader.read_metadata`` is ``pickle.load``: a checkpoint index written by someone who can
write the checkpoint directory (a shared file system) runs code in every process that resumes from it, and an index
entry declared as bytes is read with ``torch.load(weights_only=False)``. Here: a real index loads; a crafted one
and one with a bytes entry are refused, and the crafted one's code does not run (through the SWARM loader too,
with its record rewritten to match).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings

import pytest
import torch

from dilocox.checkpoint import CorruptCheckpointError
from dilocox.checkpoint.reader import reader


def _save(where: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(where), no_dist=True)


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_real_index_loads_and_a_crafted_or_bytes_index_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    good = str(tmp_path / "good")
    state = {"a": torch.randn(3, 4), "b": torch.tensor(7), "c": torch.arange(5, dtype=torch.uint8)}
    _save(good, state)
    md = reader(good).read_metadata().state_dict_metadata
    got = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(got, storage_reader=reader(good), no_dist=True)
    assert all(torch.equal(got[k], state[k]) for k in state)

    marker = str(tmp_path / "ran")
    with open(os.path.join(good, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(CorruptCheckpointError, match=r"posix\.system is not a part of a dilocox checkpoint's index"):
        reader(good).read_metadata()
    assert not os.path.exists(marker)
    assert pickle.loads(pickle.dumps(_Payload(marker))) == 0 and os.path.exists(marker)  # (the payload does run)

    # BUILD on an allowed class: the C unpickler would set PurePosixPath._str for the whole process (every Path
    # would then be that string) before the load is refused; this one refuses before it changes anything
    import pathlib

    u = lambda t: b"\x8c" + bytes([len(t)]) + t.encode()  # noqa: E731
    build = b"\x80\x02cpathlib\nPurePosixPath\nN}" + u("_str") + u(str(tmp_path / "evil")) + b"s\x86b."
    with open(os.path.join(good, ".metadata"), "wb") as f:
        f.write(build)
    with pytest.raises(CorruptCheckpointError, match="BUILD on the class PurePosixPath"):
        reader(good).read_metadata()
    assert str(pathlib.PurePosixPath("a")) == "a" and str(pathlib.Path("b")) == "b"

    with_bytes = str(tmp_path / "bytes")
    _save(with_bytes, {"a": torch.ones(2), "meta": {"step": 3}})  # a non-tensor value: DCP stores it as bytes
    with pytest.raises(CorruptCheckpointError, match="BytesStorageMetadata"):
        reader(with_bytes).read_metadata()


def test_a_swarm_save_whose_step_is_pruned_meanwhile_is_skipped_and_a_write_error_names_the_checkpoint(
    tmp_path, monkeypatch
):
    # DCP wraps a writer's error in a CheckpointException (a BaseException): the SWARM save unwraps it, so a step
    # pruned by a faster peer while this one writes is skipped (sync=diloco), and another OSError names the newest
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from dilocox.swarm import checkpoint as ck
    from dilocox.swarm.common import SwarmError
    from tests.test_swarm_checkpoint import _cfg, _peer, _train

    cfg = _cfg("--swarm.sync=diloco", "--outer.sync_every=2", "--model.n_layers=4")
    a = _peer(cfg, 0, seed=0, out=str(tmp_path))
    _train(a, 2, seed=1)
    real = FileSystemWriter.write_data
    pruned = FileNotFoundError(2, "No such file or directory")
    for err, outcome in ((pruned, None), (OSError(28, "No space left on device"), SwarmError)):

        def failing(self, plan, planner, err=err):
            raise err

        monkeypatch.setattr(FileSystemWriter, "write_data", failing)
        if outcome is None:
            assert ck.save(a, 2) is None
        else:
            with pytest.raises(SwarmError, match=r"No space left on device.*no complete SWARM checkpoint"):
                ck.save(a, 2)
        left = os.listdir(os.path.join(str(tmp_path), "checkpoints", "step_00000002"))
        assert not [n for n in left if n.endswith(".json") or ".tmp-" in n], left  # no record, no temp dir
    monkeypatch.setattr(FileSystemWriter, "write_data", real)
    assert ck.save(a, 2).endswith("s0p0")


def test_a_swarm_checkpoint_with_a_crafted_index_and_a_matching_record_runs_nothing(tmp_path):
    from dilocox.swarm import checkpoint as ck
    from dilocox.swarm.common import SwarmError
    from tests.test_swarm_checkpoint import _cfg, _peer, _train

    cfg = _cfg("--swarm.sync=diloco", "--outer.sync_every=2", "--model.n_layers=4")
    a = _peer(cfg, 0, seed=0, out=str(tmp_path))
    _train(a, 2, seed=1)
    where = ck.save(a, 2)
    marker = str(tmp_path / "ran")
    index = os.path.join(where, ".metadata")
    with open(index, "wb") as f:
        pickle.dump(_Payload(marker), f)
    rec_path = ck.record_path(where)
    with open(rec_path) as f:
        rec = json.load(f)
    raw = open(index, "rb").read()  # whoever can write the directory can rewrite the record too
    rec["files"]["s0p0/.metadata"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    with open(rec_path, "w") as f:
        json.dump(rec, f)
    assert ck._verify(os.path.dirname(where), rec) is None
    with pytest.raises(SwarmError, match="is refused"):
        ck.load(_peer(cfg, 0, seed=1, out=str(tmp_path)), where)
    assert not os.path.exists(marker)
