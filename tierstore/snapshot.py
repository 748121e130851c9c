"""A store's objects as one portable HDF5 file, and back into a store with any backends.

`write_snapshot` and `open_snapshot` are the format's one writer and reader, over any named tensors
(the DeepSpeed integration's checkpoint of sub-group states uses them directly); [`export_hdf5`][]
and [`import_hdf5`][] apply them to a store.

Layout: one dataset per object under ``/objects``, named by position (``000000``...), holding the
object's raw bytes as ``uint8`` (so every torch dtype, bfloat16 included, survives exactly), with
attributes ``key``, ``dtype`` and ``shape``; the root carries ``format`` and ``count``. Any HDF5
tool can list it; ``h5py`` reads an object back as ``numpy.frombuffer(..., dtype)``.

The export writes a temporary file beside the target and renames it into place, so a crash never
leaves a half-written snapshot under the final name. It flushes the store's dirty objects first;
objects put while it runs may or may not be included, so quiesce writers for a consistent cut.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from .dtypes import dtype_from_name, dtype_name
from .errors import BufferMismatchError, InvalidKeyError
from .store import TierStore

FORMAT = 1
"""The snapshot format's version; a file of any other is refused, never half understood."""


def write_snapshot(
    path: str | os.PathLike[str],
    objects: Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, Any] | None = None,
) -> int:
    """Write named tensors (read one at a time from ``objects``) and ``metadata`` (JSON-ready) to
    ``path`` atomically; returns the object count."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp")
    count = 0
    try:
        with h5py.File(temporary, "w") as out:
            out.attrs["format"] = FORMAT
            out.attrs["metadata"] = json.dumps(dict(metadata or {}))
            group = out.create_group("objects")
            for count, (key, tensor) in enumerate(objects, start=1):
                raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                dataset = group.create_dataset(f"{count - 1:06d}", data=raw)
                dataset.attrs["key"] = key
                dataset.attrs["dtype"] = dtype_name(tensor.dtype)
                dataset.attrs["shape"] = np.asarray(tensor.shape, dtype=np.int64)
            out.attrs["count"] = count
        os.chmod(temporary, 0o600)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return count


class Snapshot:
    """An open snapshot: its ``metadata`` and its named tensors, read one at a time. Made by
    `open_snapshot`, which checks the header first.

    Args:
        path: the file's path, which error messages name.
        source: the file, open for reading; it must stay open while the snapshot is used.
    """

    def __init__(self, path: str | os.PathLike[str], source: h5py.File) -> None:
        self.path = path
        self._objects = source["objects"]
        self.metadata: dict[str, Any] = json.loads(source.attrs["metadata"])

    def keys(self) -> list[str]:
        """The store keys of the objects, in `items` order, without reading their data."""
        return [str(self._objects[name].attrs["key"]) for name in sorted(self._objects)]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each object's key and tensor, read as the iteration reaches it.

        Raises:
            BufferMismatchError: an object's dtype is not a torch dtype, or its bytes do not fit
                its dtype and shape.
        """
        for name in sorted(self._objects):
            dataset = self._objects[name]
            dtype = dtype_from_name(str(dataset.attrs["dtype"]), f"{self.path}: object {name}")
            shape = tuple(int(n) for n in dataset.attrs["shape"])
            raw = torch.from_numpy(dataset[()])
            if raw.numel() != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise BufferMismatchError(
                    f"{self.path}: object {name} holds {raw.numel()} bytes, not {dtype} {shape}"
                )
            tensor = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
            yield str(dataset.attrs["key"]), tensor


@contextmanager
def open_snapshot(path: str | os.PathLike[str]) -> Iterator[Snapshot]:
    """Open a snapshot written by `write_snapshot`, checking its header.

    Raises:
        BufferMismatchError: the file is not readable HDF5, not a snapshot of `FORMAT`, or holds
            another number of objects than its header says.
    """
    try:
        source = h5py.File(path, "r")
    except OSError as error:
        raise BufferMismatchError(f"{path} is not a readable HDF5 snapshot: {error}") from None
    with source:
        if source.attrs.get("format") != FORMAT or "objects" not in source:
            raise BufferMismatchError(f"{path} is not a tierstore snapshot (format {FORMAT})")
        if len(source["objects"]) != int(source.attrs["count"]):
            raise BufferMismatchError(
                f"{path}: {len(source['objects'])} objects, the header says {source.attrs['count']}"
            )
        yield Snapshot(path, source)


def export_hdf5(
    store: TierStore,
    path: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> int:
    """Write ``keys`` (default: every committed key) and ``metadata`` (JSON-serialisable, e.g. an
    optimizer's step count) to ``path``; returns the object count."""
    one_string = isinstance(keys, str)  # iterating it would export one key per character
    if one_string or not (keys is None or isinstance(keys, Iterable)):
        raise InvalidKeyError(f"export_hdf5 takes an iterable of keys or None, not {keys!r}: use [key]")
    store.flush()
    selected = store.keys() if keys is None else list(keys)
    objects = ((key, store.get(key, cache=False).result()) for key in selected)
    return write_snapshot(path, objects, metadata)


def import_hdf5(path: str | os.PathLike[str], store: TierStore) -> dict[str, Any]:
    """Put every object of a snapshot into ``store`` (same keys); returns its metadata."""
    with open_snapshot(path) as snapshot:
        for key, tensor in snapshot.items():
            store.put(key, tensor).result()
        return snapshot.metadata
