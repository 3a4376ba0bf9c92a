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


def test_a_crafted_index_neither_changes_the_process_nor_crashes_hangs_or_blows_up():
    # each refused with a CorruptCheckpointError, quickly: before, a BUILD rewrote an enum member or _get_layout's
    # cache for the process, a deep tuple hashed as a key crashed the process (C stack), references to one string
    # made a gigantic repr or path (GBs from 140 KB), colliding keys made a dict quadratic, and a KeyError of a
    # 5000-digit int or a storage_meta of another type escaped as a ValueError / AttributeError
    import io
    import struct
    import time

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from dilocox.checkpoint.reader import read_index

    u = lambda t: b"X" + struct.pack("<I", len(t)) + t.encode()  # noqa: E731
    g = lambda m, n: u(m) + u(n) + b"\x93"  # noqa: E731
    M = "torch.distributed.checkpoint.metadata"
    layout, size, index = g("torch.serialization", "_get_layout"), g("torch", "Size"), g(M, "MetadataIndex")
    refs = u("a" * 10_000) + b"\x940(" + b"h\x00" * 2000 + b"t"  # (a repr / a path of 20 MB)
    # (hash(-1) == hash(-2): two MetadataIndex keys of offsets (-1,) and (-2,) have one hash)
    key = lambda off: index + b")\x81}" + u("fqn") + u("w") + b"s" + u("offset") + size + b"(" + off + b"t\x85Rsb"  # noqa: E731
    ints = b"".join(b"\x8a\x09" + (i * (2**61 - 1)).to_bytes(9, "little") + b"N" for i in range(1, 50))  # one hash
    puts = b"".join(b"p%d\n" % (i * (2**61 - 1)) for i in range(1, 50))
    meta = g(M, "Metadata") + b")\x81}(" + u("state_dict_metadata") + b"}" + u("storage_meta")
    crafted = {
        "BUILD on a _MEM_FORMAT_ENCODING": g(M, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R}" + u("_value_") + b"Kcsb.",
        "BUILD on a function": layout + b"}" + u("cache") + b"}" + u("torch.strided") + u("x") + b"ssb.",
        "a dict key of type tuple": b"})" + b"\x85" * 10**5 + b"Ns.",
        "a call of _get_layout": layout + b"\x8b" + struct.pack("<I", 2100) + b"\x11" * 2100 + b"\x85R.",
        "a call of PosixPath": g("pathlib", "PosixPath") + refs + b"R.",
        "a call of _MEM_FORMAT_ENCODING": g(M, "_MEM_FORMAT_ENCODING") + refs + b"\x85R.",
        "BUILD of a TensorProperties": g(M, "TensorProperties") + b")\x81(NNN" + refs + b"Ntb.",
        "a dict key of type int": b"}(" + ints + b"u.",
        "two keys of the same hash": b"}(" + key(b"J\xff\xff\xff\xff") + b"N" + key(b"J\xfe\xff\xff\xff") + b"Nu.",
        "an opcode DCP's index does not use": b"N" + puts + b".",
        "storage_meta of type int": meta + b"K\x05ub.",
    }
    strided, member = torch.strided, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    for why, raw in crafted.items():
        t = time.perf_counter()
        with pytest.raises(CorruptCheckpointError, match=why) as e:
            read_index(io.BytesIO(b"\x80\x04" + raw), "x")
        assert time.perf_counter() - t < 10 and len(str(e.value)) < 1000, why
    assert torch.serialization._get_layout("torch.strided") is strided and member.value == 0
    assert _MEM_FORMAT_ENCODING(0) is member and member.name == "TORCH_CONTIGUOUS_FORMAT"


def test_an_index_that_points_outside_its_directory_or_past_its_files_is_refused(tmp_path, monkeypatch):
    """An index made only of allowed classes can still lie: a storage entry naming another directory's file (DCP
    would read a tensor from there, outside every record's hash), an entry past the end of its file, a chunk outside
    its tensor, a size no tensor has, transforms, or an index too large to read. Each is refused by name."""
    import copy

    import dilocox.checkpoint.reader as rd

    other, good = str(tmp_path / "other"), str(tmp_path / "good")
    _save(other, {"a": torch.full((3,), 42.0)})
    _save(good, {"a": torch.zeros(3)})
    with open(os.path.join(good, ".metadata"), "rb") as f:
        md = pickle.load(f)  # (our own file: the test's writer side)
    info = next(iter(md.storage_data.values()))
    theirs = os.path.join(other, info.relative_path)

    def refused(change, match: str) -> None:
        bad = copy.deepcopy(md)
        change(bad)
        with open(os.path.join(good, ".metadata"), "wb") as f:
            pickle.dump(bad, f)
        with pytest.raises(CorruptCheckpointError, match=match):
            reader(good).read_metadata()

    def entry(**kw):
        def change(m):
            for v in m.storage_data.values():
                for k, x in kw.items():
                    setattr(v, k, x)

        return change

    outside = "not a file of the checkpoint's own directory"
    refused(entry(relative_path=theirs), outside)
    refused(entry(relative_path="../other/" + info.relative_path), outside)
    refused(entry(relative_path=".."), outside)
    refused(entry(length=info.length + 1), "shorter than its entries")
    refused(entry(relative_path="missing.distcp"), "missing or shorter")
    refused(entry(offset=-1), "negative or non-integer")
    refused(entry(transform_descriptors=["zstd"]), "names transforms")
    refused(lambda m: setattr(m.state_dict_metadata["a"], "size", torch.Size([1 << 41])), "a size or chunks")
    refused(lambda m: setattr(m.state_dict_metadata["a"].chunks[0], "sizes", torch.Size([4])), "outside its tensor")
    refused(lambda m: setattr(m, "state_dict_metadata", 5), "state_dict_metadata is not a dict")
    with open(os.path.join(good, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    assert reader(good).read_metadata().state_dict_metadata["a"].size == torch.Size([3])
    monkeypatch.setattr(rd, "MAX_INDEX_BYTES", os.path.getsize(os.path.join(good, ".metadata")) - 1)
    with pytest.raises(CorruptCheckpointError, match=r"bytes \(at most"):
        reader(good).read_metadata()
