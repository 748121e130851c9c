"""``dram://``: objects held in process memory.

Useful as a fast, volatile tier and as the reference implementation of the backend contract.
Each object is a numpy ``uint8`` array, grown by reallocation when a write goes past its end;
copies go through numpy, which releases the GIL for large ones.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from .._futures import completed
from ..errors import KeyNotFoundError
from .base import Backend, BackendOptions, Capabilities

_EMPTY = np.empty(0, np.uint8)


class DramOptions(BackendOptions):
    """The DRAM backend has no options."""


class DramBackend(Backend):
    """Volatile in-memory objects (copies complete before the future is returned)."""

    scheme = "dram"
    Options = DramOptions

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        self._objects: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(alignment=1, partial_writes=True, persistent=False, direct_io=False)

    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        end = offset + data.nbytes
        with self._lock:
            blob = self._objects.get(name, _EMPTY)
            if blob.size < end or name not in self._objects:
                grown = np.empty(end, np.uint8)  # np.empty, not zeros: no pass over fresh pages
                grown[: blob.size] = blob
                grown[blob.size : offset] = 0  # a gap before the written range reads as zeros
                self._objects[name] = blob = grown
        blob[offset:end] = np.frombuffer(data, np.uint8)
        return completed(None)

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        with self._lock:
            blob = self._blob(name)
        np.frombuffer(out, np.uint8)[:] = blob[offset : offset + out.nbytes]
        return completed(None)

    def _delete(self, name: str) -> None:
        with self._lock:
            self._blob(name)
            del self._objects[name]

    def _exists(self, name: str) -> bool:
        return name in self._objects

    def _size(self, name: str) -> int:
        with self._lock:
            return int(self._blob(name).size)

    def _list(self) -> list[str]:
        with self._lock:
            return list(self._objects)

    def _close(self) -> None:
        with self._lock:
            self._objects.clear()

    def _blob(self, name: str) -> np.ndarray:
        try:
            return self._objects[name]
        except KeyError:
            raise KeyNotFoundError(f"dram: no object {name!r}") from None
