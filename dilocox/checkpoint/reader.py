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
    dataclasses) for the whole process, even though the load is refused afterwards."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):  # (no lazy submodule import)
            return torch.__dict__[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not a part of a dilocox checkpoint's index")

    def _build(self) -> None:
        if len(self.stack) >= 2 and isinstance(self.stack[-2], type):
            raise pickle.UnpicklingError(f"BUILD on the class {self.stack[-2].__name__} (it would change the class)")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def read_index(f: Any, where: str) -> Any:
    """A DCP ``Metadata`` from the open file ``f`` (the index at ``where``), through the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _IndexUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure to read the index is a corrupt (or hostile) index
        raise CorruptCheckpointError(
            f"checkpoint index {where} is refused ({type(e).__name__}: {e}): it was not written by dilocox's DCP "
            "save (or is damaged); resume from an earlier step directory"
        ) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"checkpoint index {where} holds a {type(md).__name__}, not DCP's Metadata")
    return md


def reader(path: str):
    """A ``FileSystemReader`` of the DCP checkpoint at ``path`` whose index goes through :func:`read_index`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            get = getattr(self, "_get_metadata_path", None)
            index = get(kwargs.get("rank")) if get else self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(index, "rb") as f:
                md = read_index(f, str(index))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _Reader(path)
