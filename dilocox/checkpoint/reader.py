"""DCP's file reader without an unrestricted unpickler.

``torch.distributed.checkpoint.FileSystemReader`` reads a checkpoint's index (``.metadata``) with ``pickle.load``
(torch 2.13), so a crafted index runs code, whatever hash check came first when the record and the index lie on
the same shared file system. And an index that declares a key as bytes (``BytesStorageMetadata``) makes DCP's
load planner read that key with a full, unrestricted ``torch.load``. dilocox saves only tensors (everything else is
JSON in a uint8 tensor, ``names.encode``), so its index holds nothing but DCP's own metadata classes, torch sizes,
dtypes and layouts, and paths. :func:`reader` reads the index with an unpickler that resolves exactly those
(``ALLOWED``) and never sets attributes of a class; anything else, bytes entries included, is refused with
:class:`CorruptCheckpointError`. The tensor
data DCP reads with ``torch.load(weights_only=True)`` itself.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from dilocox.checkpoint.layout import CorruptCheckpointError

# module -> the names an index may refer to (what torch 2.11-2.13 pickle into one of dilocox's checkpoints)
ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath"}),  # (Python 3.13's module of the same classes)
    "collections": frozenset({"OrderedDict"}),
}


class _IndexUnpickler(pickle._Unpickler):
    """Python's own (pure-Python) unpickler with ``find_class`` restricted to ``ALLOWED`` and ``BUILD`` refused on a
    class: the C unpickler would let an index set attributes of an allowed class (``PurePosixPath``, DCP's
    dataclasses) for the whole process, even though the load is refused afterwards. Likewise ``BUILD`` only on a
    new DCP record (not on an enum member or ``_get_layout``: process-wide objects), calls only with the arguments
    DCP pickles, and dict keys only names and ``MetadataIndex``es (a hash of a deep tuple overflows the C stack;
    references to one long string make a gigantic path or repr; colliding keys make a dict quadratic)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, f: Any):
        super().__init__(f)
        import pathlib
        from collections import OrderedDict

        from torch.distributed.checkpoint import filesystem
        from torch.distributed.checkpoint import metadata as m

        self._m = m
        self._records = (m.Metadata, m.TensorStorageMetadata, m.ChunkStorageMetadata, m.TensorProperties)
        self._records += (m.MetadataIndex, m.StorageMeta, filesystem._StorageInfo)
        self._empty = self._records + (OrderedDict,)  # (called without arguments: NEWOBJ, then BUILD / SETITEMS)
        self._paths = (pathlib.PosixPath, pathlib.PurePosixPath)
        self._hashes: dict[int, Any] = {}  # a MetadataIndex key's hash -> that key

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):  # (no lazy submodule import)
            return torch.__dict__[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not a part of a dilocox checkpoint's index")

    def _call(self, f: Any, args: Any, kwargs: Any = None) -> None:
        """Refuse a call of ``f`` with arguments that DCP's index does not hold (identity tests only: no hash of
        ``f``)."""
        if kwargs or type(args) is not tuple:
            ok = False
        elif any(f is c for c in self._empty):
            ok = not args
        elif f is self._m._MEM_FORMAT_ENCODING:
            ok = len(args) == 1 and type(args[0]) is int
        elif f is torch.serialization._get_layout:
            ok = len(args) == 1 and type(args[0]) is str and len(args[0]) <= 64
        elif f is torch.Size:
            ok = len(args) == 1 and type(args[0]) in (tuple, list) and all(type(x) is int for x in args[0])
        elif any(f is c for c in self._paths):
            ok = len(args) <= 256 and all(type(a) is str for a in args) and sum(map(len, args)) <= 4096
        else:
            ok = False
        if not ok:
            name = f.__qualname__ if isinstance(getattr(f, "__qualname__", None), str) else type(f).__name__
            raise pickle.UnpicklingError(f"a call of {name} with other arguments than a DCP index's")

    def _key(self, k: Any) -> None:
        """Refuse a dict key other than a name or a ``MetadataIndex`` (of a name and a ``torch.Size``), and a second
        ``MetadataIndex`` of the same hash."""
        if type(k) is str:
            return
        if type(k) is self._m.MetadataIndex and type(getattr(k, "fqn", None)) is str:
            if k.offset is None or type(k.offset) is torch.Size:
                seen = self._hashes.setdefault(hash(k), k)
                if seen is not k and seen != k:
                    raise pickle.UnpicklingError(f"two keys of the same hash ({k.fqn[:100]})")
                return
        raise pickle.UnpicklingError(f"a dict key of type {type(k).__name__} (a DCP index's keys are names)")

    def _build(self) -> None:
        inst, state = self.stack[-2], self.stack[-1]
        if isinstance(inst, type):
            raise pickle.UnpicklingError(f"BUILD on the class {inst.__name__} (it would change the class)")
        if not any(type(inst) is c for c in self._records):
            raise pickle.UnpicklingError(f"BUILD on a {type(inst).__name__} (not a new DCP record)")
        if type(inst) is self._m.TensorProperties:  # (its __setstate__ takes a tuple)
            ok = type(state) is tuple and len(state) == 5 and type(state[3]) is self._m._MEM_FORMAT_ENCODING
        else:
            ok = type(state) is dict and all(type(k) is str for k in state)
            if ok and type(inst) is self._m.MetadataIndex:  # (a key: its hash is of these two)
                ok = type(state.get("fqn", "")) is str and type(state.get("offset", torch.Size())) is torch.Size
        if not ok:
            raise pickle.UnpicklingError(f"BUILD of a {type(inst).__name__} with a state DCP does not write")
        pickle._Unpickler.load_build(self)

    def _reduce(self) -> None:
        self._call(self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_reduce(self)

    def _newobj(self) -> None:
        self._call(self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_newobj(self)

    def _newobj_ex(self) -> None:
        self._call(self.stack[-3], self.stack[-2], self.stack[-1])
        pickle._Unpickler.load_newobj_ex(self)

    def _instantiate(self, klass: Any, args: Any) -> None:  # (INST, OBJ)
        self._call(klass, tuple(args))
        super()._instantiate(klass, args)

    def _setitem(self) -> None:
        self._key(self.stack[-2])
        pickle._Unpickler.load_setitem(self)

    def _setitems(self) -> None:
        items = self.pop_mark()
        for k in items[::2]:
            self._key(k)
        d = self.stack[-1]
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]

    def _dict(self) -> None:
        items = self.pop_mark()
        for k in items[::2]:
            self._key(k)
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _refused(self) -> None:  # sets (their items are hashed) and protocol 0's text memo (its indices are too)
        raise pickle.UnpicklingError("an opcode DCP's index does not use")

    dispatch[pickle.BUILD[0]] = _build
    dispatch[pickle.REDUCE[0]] = _reduce
    dispatch[pickle.NEWOBJ[0]] = _newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _newobj_ex
    dispatch[pickle.SETITEM[0]] = _setitem
    dispatch[pickle.SETITEMS[0]] = _setitems
    dispatch[pickle.DICT[0]] = _dict
    for _op in (pickle.ADDITEMS, pickle.FROZENSET, pickle.PUT, pickle.GET):
        dispatch[_op[0]] = _refused


def read_index(f: Any, where: str) -> Any:
    """A DCP ``Metadata`` from the open file ``f`` (the index at ``where``), through the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    try:
        md = _IndexUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure to read the index is a corrupt (or hostile) index
        why = "; ".join(a for a in e.args if type(a) is str)[:300]  # (no str(e): a KeyError's repr of its key)
        raise CorruptCheckpointError(
            f"checkpoint index {where} is refused ({type(e).__name__}: {why}): it was not written by dilocox's DCP "
            "save (or is damaged); resume from an earlier step directory"
        ) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"checkpoint index {where} holds a {type(md).__name__}, not DCP's Metadata")
    if not isinstance(getattr(md, "storage_meta", None), (StorageMeta, type(None))):
        raise CorruptCheckpointError(
            f"checkpoint index {where} has a storage_meta of type {type(md.storage_meta).__name__}"
        )
    why = _unsound(md)
    if why:
        raise CorruptCheckpointError(
            f"checkpoint index {where} is refused ({why}): it was not written by dilocox's DCP save (or is damaged); "
            "resume from an earlier step directory"
        )
    return md


MAX_INDEX_BYTES = 512 << 20  # an index larger than this is refused before it is read (a real one: ~200 B a chunk)
MAX_NUMEL = 1 << 40  # elements of one declared tensor (4 TiB of fp32): a size beyond it is not a checkpoint's


def _shape(x: Any) -> bool:
    return type(x) is torch.Size and len(x) <= 64 and all(type(d) is int and d >= 0 for d in x)


def _unsound(md: Any) -> str | None:
    """Why the loaded index is not one DCP writes for dilocox (None if it is): the callers read names, sizes,
    chunks and file names from it, and DCP opens each ``relative_path`` in the checkpoint directory."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    sd = getattr(md, "state_dict_metadata", None)
    if type(sd) is not dict:
        return "state_dict_metadata is not a dict"
    for name, t in sd.items():
        if type(t) is not TensorStorageMetadata:  # (BytesStorageMetadata: DCP would torch.load it unrestricted)
            return f"{name[:100]!r} is a {type(t).__name__}, not a tensor"
        size, chunks = getattr(t, "size", None), getattr(t, "chunks", None)
        if not _shape(size) or size.numel() > MAX_NUMEL or type(chunks) is not list:
            return f"{name[:100]!r} declares a size or chunks no tensor has"
        for c in chunks:
            off, sz = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if type(c) is not ChunkStorageMetadata or not (_shape(off) and _shape(sz)) or not len(off) == len(sz):
                return f"a chunk of {name[:100]!r} is malformed"
            if len(off) != len(size) or any(o + n > d for o, n, d in zip(off, sz, size)):
                return f"a chunk of {name[:100]!r} lies outside its tensor"
    data = getattr(md, "storage_data", None)
    if type(data) is not dict:
        return "storage_data is not a dict"
    for info in data.values():
        rel = getattr(info, "relative_path", None)
        plain = type(rel) is str and rel not in ("", ".", "..") and "/" not in rel and "\\" not in rel
        if type(info) is not _StorageInfo or not plain:
            return f"a storage entry names {str(rel)[:100]!r}, not a file of the checkpoint's own directory"
        if not all(type(v) is int and v >= 0 for v in (info.offset, info.length)):
            return f"a storage entry of {rel!r} has a negative or non-integer offset or length"
        if getattr(info, "transform_descriptors", None):
            return f"a storage entry of {rel!r} names transforms (dilocox writes none)"
    return None


def _within_files(md: Any, directory: str) -> str | None:
    """Why a storage entry reads past the end of its file, or from a file that is not there (None if none does)."""
    sizes: dict[str, int] = {}
    for info in md.storage_data.values():
        if info.relative_path not in sizes:
            path = os.path.join(directory, info.relative_path)
            sizes[info.relative_path] = os.path.getsize(path) if os.path.isfile(path) else -1
        if info.offset + info.length > sizes[info.relative_path]:
            return f"{info.relative_path!r} is missing or shorter than its entries (offset + length)"
    return None


def reader(path: str):
    """A ``FileSystemReader`` of the DCP checkpoint at ``path`` whose index goes through :func:`read_index`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            get = getattr(self, "_get_metadata_path", None)
            index = get(kwargs.get("rank")) if get else self.fs.concat_path(self.path, ".metadata")
            n = os.path.getsize(index) if os.path.isfile(index) else 0
            if n > MAX_INDEX_BYTES:
                raise CorruptCheckpointError(
                    f"checkpoint index {index} is {n} bytes (at most {MAX_INDEX_BYTES}): not one dilocox writes"
                )
            with self.fs.create_stream(index, "rb") as f:
                md = read_index(f, str(index))
            why = _within_files(md, str(self.path))
            if why:
                raise CorruptCheckpointError(f"checkpoint {self.path}: {why}; resume from an earlier step directory")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _Reader(path)
