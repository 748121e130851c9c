"""``dram://``: objects held in process memory.

Useful as a fast, volatile tier and as the reference implementation of the backend contract.
Each object is a numpy ``uint8`` array, grown geometrically when a write goes past its end;
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
    """Volatile in-memory objects (copies complete before the future is returned).

    Args:
        options: a `DramOptions` (no fields).
    """

    scheme = "dram"
    Options = DramOptions

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        self._buffers: dict[str, np.ndarray] = {}
        """Each object's memory; may be longer than the object (room to grow)."""
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        """Implements [`Backend.capabilities`][]: any offset, partial writes, not persistent."""
        return Capabilities(alignment=1, partial_writes=True, persistent=False, direct_io=False)

    def view(self, name: str) -> np.ndarray:
        """The object's bytes, without copying (the raw medium, for tests and wrappers)."""
        with self._lock:
            return self._buffer(name)[: self._sizes[name]]

    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        """Implements `Backend._write`: copies at once and returns a resolved future."""
        end = offset + data.nbytes
        with self._lock:
            buffer = self._buffers.get(name, _EMPTY)
            size = self._sizes.get(name, 0)
            if buffer.size < end or name not in self._buffers:  # grow geometrically: linear time
                grown = np.empty(max(end, 2 * buffer.size), np.uint8)  # empty: no pass over new pages
                grown[:size] = buffer[:size]
                self._buffers[name] = buffer = grown
            if offset > size:
                buffer[size:offset] = 0  # a gap before the written range reads as zeros
            self._sizes[name] = max(size, end)
        buffer[offset:end] = np.frombuffer(data, np.uint8)
        return completed(None)

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        """Implements `Backend._read_into`: copies at once and returns a resolved future."""
        with self._lock:
            buffer = self._buffer(name)
        np.frombuffer(out, np.uint8)[:] = buffer[offset : offset + out.nbytes]
        return completed(None)

    def _delete(self, name: str) -> None:
        """Implements `Backend._delete`."""
        with self._lock:
            self._buffer(name)
            del self._buffers[name], self._sizes[name]

    def _exists(self, name: str) -> bool:
        """Implements `Backend._exists`."""
        return name in self._sizes

    def _size(self, name: str) -> int:
        """Implements `Backend._size`."""
        with self._lock:
            self._buffer(name)
            return self._sizes[name]

    def _list(self) -> list[str]:
        """Implements `Backend._list`."""
        with self._lock:
            return list(self._sizes)

    def _close(self) -> None:
        """Implements `Backend._close`: the objects' memory is freed."""
        with self._lock:
            self._buffers.clear()
            self._sizes.clear()

    def _buffer(self, name: str) -> np.ndarray:
        try:
            return self._buffers[name]
        except KeyError:
            raise KeyNotFoundError(f"dram: no object {name!r}") from None
