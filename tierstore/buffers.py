"""Page-aligned host buffers and the pool that recycles them.

O_DIRECT needs the buffer address, file offset and length aligned, and ``torch.empty`` /
``np.empty`` give no such guarantee, so every buffer here is an anonymous ``mmap`` (always
page-aligned). Where CUDA exists the same memory is page-locked with ``cudaHostRegister`` so
host<->device copies can run asynchronously. The tensor view is built with ``np.frombuffer`` +
``torch.from_numpy``: the numpy array holds the mapping alive for as long as any tensor view exists
(``torch.frombuffer`` does not, and crashes once the mapping is closed).
"""

from __future__ import annotations

import mmap
import threading
from collections import defaultdict

import numpy as np
import torch

from .errors import CapacityError

ALIGNMENT = 4096
"""Alignment of every pool buffer: the page size, a multiple of any block device's sector."""


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Smallest multiple of ``alignment`` that is >= ``nbytes``."""
    return -(-nbytes // alignment) * alignment


def buffer_address(buffer: memoryview) -> int:
    """Address of the first byte of ``buffer`` (read-only buffers included)."""
    if buffer.nbytes == 0:
        return 0
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class AlignedBuffer:
    """A page-aligned, optionally CUDA-pinned block of host memory of fixed capacity."""

    __slots__ = ("_array", "capacity", "pinned", "tensor")

    def __init__(self, capacity: int, *, pin: bool = False) -> None:
        self.capacity = round_up(max(capacity, 1))
        self._array = np.frombuffer(mmap.mmap(-1, self.capacity), dtype=np.uint8)
        self.tensor = torch.from_numpy(self._array)
        self.pinned = False
        if pin:
            _cuda_host_register(self.tensor)
            self.pinned = True

    def view(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes as a uint8 tensor sharing this memory."""
        return self.tensor[:nbytes]

    def memoryview(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` bytes as a writable memoryview (what backends consume)."""
        return self._array[:nbytes].data

    def free(self) -> None:
        """Unpin; the mapping itself is unmapped once the last view of it is gone."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]
            self.pinned = False


def _cuda_host_register(tensor: torch.Tensor) -> None:
    status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)  # type: ignore[no-untyped-call]
    if int(status) != 0:
        raise CapacityError(f"cudaHostRegister of {tensor.numel()} bytes failed (status {status})")


class BufferPool:
    """Recycles aligned buffers under a hard byte budget.

    Buffers are kept per page-rounded size, so a workload of equal-sized objects (optimizer
    subgroups) allocates once and then only reuses. ``allocated_bytes`` (buffers in use plus idle
    ones) never exceeds ``capacity``: idle buffers of other sizes are freed to make room, and when
    in-use buffers alone leave no room :meth:`try_acquire` returns ``None`` so the caller can evict.
    """

    def __init__(self, capacity: int, *, pin: bool | None = None) -> None:
        if capacity < 0:
            raise CapacityError(f"buffer pool capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._idle: defaultdict[int, list[AlignedBuffer]] = defaultdict(list)
        self._idle_bytes = 0
        self._allocated = 0
        self._lock = threading.Lock()

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the pool: buffers handed out plus idle ones kept for reuse."""
        return self._allocated

    @property
    def in_use_bytes(self) -> int:
        return self._allocated - self._idle_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` could ever get a buffer from this pool."""
        return round_up(max(nbytes, 1)) <= self.capacity

    def try_acquire(self, nbytes: int) -> AlignedBuffer | None:
        """A buffer of at least ``nbytes``, or ``None`` while in-use buffers leave no room.

        Raises :class:`CapacityError` if ``nbytes`` exceeds the whole pool.
        """
        size = round_up(max(nbytes, 1))
        if size > self.capacity:
            raise CapacityError(
                f"a buffer of {nbytes} bytes exceeds the pool's capacity of {self.capacity} bytes"
            )
        with self._lock:
            same_size = self._idle.get(size)
            if same_size:
                self._idle_bytes -= size
                return same_size.pop()
            while self._allocated + size > self.capacity and self._idle_bytes:
                self._drop_one_idle()
            if self._allocated + size > self.capacity:
                return None
            self._allocated += size
        return AlignedBuffer(size, pin=self.pin)

    def release(self, buffer: AlignedBuffer) -> None:
        """Return a buffer for reuse; the caller must hold no view of it any more."""
        with self._lock:
            self._idle[buffer.capacity].append(buffer)
            self._idle_bytes += buffer.capacity

    def clear(self) -> None:
        """Free every idle buffer (buffers in use stay valid)."""
        with self._lock:
            while self._idle_bytes:
                self._drop_one_idle()

    def _drop_one_idle(self) -> None:
        size = max(s for s, bufs in self._idle.items() if bufs)
        self._idle[size].pop().free()
        self._idle_bytes -= size
        self._allocated -= size
