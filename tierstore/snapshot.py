"""A store's objects as one portable HDF5 file, and back into a store with any backends.

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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from .errors import BufferMismatchError, InvalidKeyError
from .store import TierStore

FORMAT = 1


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
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp")
    selected = store.keys() if keys is None else list(keys)
    try:
        with h5py.File(temporary, "w") as out:
            out.attrs["format"] = FORMAT
            out.attrs["metadata"] = json.dumps(dict(metadata or {}))
            objects = out.create_group("objects")
            for index, key in enumerate(selected):
                tensor = store.get(key, cache=False).result()
                raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                dataset = objects.create_dataset(f"{index:06d}", data=raw)
                dataset.attrs["key"] = key
                dataset.attrs["dtype"] = str(tensor.dtype).removeprefix("torch.")
                dataset.attrs["shape"] = np.asarray(tensor.shape, dtype=np.int64)
            out.attrs["count"] = len(selected)
        os.chmod(temporary, 0o600)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return len(selected)


def import_hdf5(path: str | os.PathLike[str], store: TierStore) -> dict[str, Any]:
    """Put every object of a snapshot into ``store`` (same keys); returns its metadata."""
    try:
        source = h5py.File(path, "r")
    except OSError as error:
        raise BufferMismatchError(f"{path} is not a readable HDF5 snapshot: {error}") from None
    with source:
        if source.attrs.get("format") != FORMAT or "objects" not in source:
            raise BufferMismatchError(f"{path} is not a tierstore snapshot (format {FORMAT})")
        objects = source["objects"]
        if len(objects) != int(source.attrs["count"]):
            raise BufferMismatchError(
                f"{path}: {len(objects)} objects, the header says {source.attrs['count']}"
            )
        for name in sorted(objects):
            dataset = objects[name]
            dtype = getattr(torch, str(dataset.attrs["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise BufferMismatchError(
                    f"{path}: object {name} has unknown dtype {dataset.attrs['dtype']!r}"
                )
            shape = tuple(int(n) for n in dataset.attrs["shape"])
            raw = torch.from_numpy(dataset[()])
            if raw.numel() != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise BufferMismatchError(
                    f"{path}: object {name} holds {raw.numel()} bytes, not {dtype} {shape}"
                )
            tensor = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
            store.put(str(dataset.attrs["key"]), tensor).result()
        metadata: dict[str, Any] = json.loads(source.attrs["metadata"])
        return metadata
