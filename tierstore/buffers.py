"""Page-aligned host buffers and the pool that recycles them.

O_DIRECT needs the buffer address, file offset and length aligned, and ``torch.empty`` /
``np.empty`` give no such guarantee, so every buffer here is anonymous ``mmap`` memory (always
page-aligned). Where CUDA exists the memory is page-locked with ``cudaHostRegister`` so
host<->device copies can run asynchronously. Tensor views are built with ``np.frombuffer`` +
``torch.from_numpy``: the numpy array holds the mapping alive for as long as any tensor view exists
(``torch.frombuffer`` does not, and crashes once the mapping is closed).

The pool does not map one region per buffer: the kernel allows about 65,000 maps per process
(``vm.max_map_count``), so a cache of many small objects would fail with ENOMEM long before its
budget. It carves buffers out of a few large maps (:class:`_Arena`, a buddy allocator of pages,
pinned once per map), and objects under a page share pages as slots of a size class
(:class:`_Slab`). Buffers of a page or more keep page-aligned addresses and page-multiple
capacities, as O_DIRECT needs.

Large maps are backed by transparent huge pages (:func:`_anonymous_map`): the block layer turns an
O_DIRECT request into one segment per physically contiguous piece of its buffer, so on 4 KiB
pages a 4 MiB request is split into requests of a few hundred KiB (``max_segments``), and this
machine's disk moved about 0.7 GB/s that way against 2-3 GB/s with the whole 4 MiB in one request.
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


HUGE_PAGE = 2 << 20
HUGE_MAP_BYTES = 64 << 20
"""Maps at least this large are huge-page backed; smaller ones stay on 4 KiB pages, where a
touched page would otherwise make a whole 2 MiB resident and push a small pool past its budget."""


def round_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """Smallest multiple of ``alignment`` that is >= ``nbytes``."""
    return -(-nbytes // alignment) * alignment


def buffer_address(buffer: memoryview) -> int:
    """Address of the first byte of ``buffer`` (read-only buffers included)."""
    if buffer.nbytes == 0:
        return 0
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class AlignedBuffer:
    """A page-aligned, optionally CUDA-pinned block of host memory of fixed capacity.

    Built directly, it is a map of its own. A :class:`BufferPool` hands out buffers carved from
    its arenas instead: a slice of a shared map, whose pinning belongs to the map."""

    __slots__ = ("_array", "_owns_pin", "_tensor", "capacity", "offset", "pinned", "place")

    def __init__(self, capacity: int, *, pin: bool = False) -> None:
        self.capacity = round_up(max(capacity, 1))
        self.offset = 0
        self.place: _Arena | _Slab | None = None
        """Where a pool buffer was carved from (None: its own map)."""
        memory, start = _anonymous_map(self.capacity)
        self._array = np.frombuffer(memory, dtype=np.uint8, count=self.capacity, offset=start)
        self._tensor = torch.from_numpy(self._array)
        self.pinned = self._owns_pin = False
        if pin:
            _cuda_host_register(self._tensor)
            self.pinned = self._owns_pin = True

    @classmethod
    def carved(cls, arena: _Arena, offset: int, capacity: int, place: _Arena | _Slab) -> AlignedBuffer:
        """``capacity`` bytes at ``offset`` of ``arena``'s map (no map of its own)."""
        buffer = cls.__new__(cls)
        buffer.capacity, buffer.offset, buffer.place = capacity, offset, place
        buffer._array, buffer._tensor = arena.array, arena.tensor
        buffer.pinned, buffer._owns_pin = arena.pinned, False
        return buffer

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a uint8 tensor sharing this memory."""
        return self.view(self.capacity)

    def view(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes as a uint8 tensor sharing this memory."""
        return self._tensor[self.offset : self.offset + nbytes]

    def memoryview(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` bytes as a writable memoryview (what backends consume)."""
        return self._array[self.offset : self.offset + nbytes].data

    def free(self) -> None:
        """Unpin a buffer with a map of its own; the mapping itself is unmapped once the last view
        of it is gone. (A pool buffer goes back to its pool instead.)"""
        if self._owns_pin:
            torch.cuda.cudart().cudaHostUnregister(self._tensor.data_ptr())  # type: ignore[no-untyped-call]
            self.pinned = self._owns_pin = False


def _anonymous_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous map with room for ``nbytes`` from the returned (page-aligned) offset.

    From :data:`HUGE_MAP_BYTES` on it is backed by transparent huge pages, the offset aligned to
    one (the map is a huge page longer; the untouched slack is never resident); smaller maps are
    kept off them. Private, not Python's default shared map: shared anonymous memory is shmem,
    which the kernel does not back with huge pages here (``shmem_enabled`` is ``never``)."""
    huge = nbytes >= HUGE_MAP_BYTES and hasattr(mmap, "MADV_HUGEPAGE")  # Linux only
    memory = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not huge:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            memory.madvise(mmap.MADV_NOHUGEPAGE)
        return memory, 0
    memory.madvise(mmap.MADV_HUGEPAGE)
    return memory, -np.frombuffer(memory, dtype=np.uint8).ctypes.data % HUGE_PAGE


def aligned_tensor(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements in page-aligned memory of its own: O_DIRECT reads and
    writes go straight to and from it, without a bounce copy."""
    nbytes = numel * dtype.itemsize
    return AlignedBuffer(nbytes).view(nbytes).view(dtype)


def _cuda_host_register(tensor: torch.Tensor) -> None:
    status = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)  # type: ignore[no-untyped-call]
    if int(status) != 0:
        raise CapacityError(f"cudaHostRegister of {tensor.numel()} bytes failed (status {status})")


ARENA_BYTES = 64 << 20
"""Largest arena map; a pool with a smaller budget maps arenas of its budget (rounded up to a
power of two), so pinning a whole arena never pins much more than the budget."""

SLOT_SIZES = (64, 128, 256, 512, 1024, 2048)
"""Size classes of objects under a page: slots of one page (a slab). 64-byte alignment suits
every dtype's view; such objects are below O_DIRECT's block size anyway (the backend bounces
them through an aligned block)."""


class _Arena:
    """One large anonymous map carved into power-of-two runs of pages (a buddy allocator).

    A buffer of ``n`` pages takes a run of the next power of two, but only its first ``n`` pages
    are ever touched, so resident memory is the page-rounded size; freed runs merge with their
    free buddy and are given back to the kernel (``MADV_DONTNEED``) unless the map is pinned."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.nbytes = nbytes
        self._map, self._start = _anonymous_map(nbytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=self._start)
        self.tensor = torch.from_numpy(self.array)
        self.pinned = pin
        if pin:
            _cuda_host_register(self.tensor)
        self.top = (nbytes // ALIGNMENT).bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.top + 1)]
        """First page of each free run, per order (a run of ``2**order`` pages)."""
        self._free[self.top].add(0)

    @property
    def empty(self) -> bool:
        return 0 in self._free[self.top]

    def allocate(self, order: int) -> int | None:
        """Byte offset of a free run of ``2**order`` pages, or None if there is none."""
        level = next((lv for lv in range(order, self.top + 1) if self._free[lv]), None)
        if level is None:
            return None
        page = self._free[level].pop()
        while level > order:  # split, keeping the upper halves free
            level -= 1
            self._free[level].add(page + (1 << level))
        return page * ALIGNMENT

    def release(self, offset: int, order: int) -> None:
        if not self.pinned:  # pinned pages stay resident by definition
            self._map.madvise(mmap.MADV_DONTNEED, self._start + offset, ALIGNMENT << order)
        page = offset // ALIGNMENT
        while order < self.top and (buddy := page ^ (1 << order)) in self._free[order]:
            self._free[order].remove(buddy)
            page, order = min(page, buddy), order + 1
        self._free[order].add(page)

    def unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]
            self.pinned = False


class _Slab:
    """One page of an arena cut into equal slots for objects smaller than a page."""

    __slots__ = ("arena", "free", "offset", "slot")

    def __init__(self, arena: _Arena, offset: int, slot: int) -> None:
        self.arena, self.offset, self.slot = arena, offset, slot
        self.free = list(range(offset + ALIGNMENT - slot, offset - 1, -slot))

    @property
    def unused(self) -> bool:
        return len(self.free) == ALIGNMENT // self.slot


def _order(nbytes: int) -> int:
    """Buddy order of the smallest run of pages that holds ``nbytes``."""
    return (round_up(nbytes) // ALIGNMENT - 1).bit_length()


class BufferPool:
    """Recycles aligned buffers under a hard byte budget.

    Buffers are kept per size (page-rounded, or a slot size under a page), so a workload of
    equal-sized objects (optimizer subgroups) allocates once and then only reuses.
    ``allocated_bytes`` (memory held: pages of buffers in use or idle, whole pages for slabs)
    never exceeds ``capacity``: idle buffers of other sizes are freed to make room, and when
    buffers in use leave no room :meth:`try_acquire` returns ``None`` so the caller can evict.
    """

    def __init__(self, capacity: int, *, pin: bool | None = None) -> None:
        if capacity < 0:
            raise CapacityError(f"buffer pool capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.arena_bytes = min(ARENA_BYTES, 1 << (max(capacity, ALIGNMENT) - 1).bit_length())
        self._arenas: list[_Arena] = []
        self._slabs: dict[int, dict[_Slab, None]] = {size: {} for size in SLOT_SIZES}
        """Slabs with a free slot, per slot size (an insertion-ordered set)."""
        self._idle: defaultdict[int, list[AlignedBuffer]] = defaultdict(list)
        self._idle_bytes = 0
        self._allocated = 0
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the pool: buffers handed out plus idle ones kept for reuse."""
        return self._allocated

    @property
    def in_use_bytes(self) -> int:
        """Capacity of the buffers handed out and not yet released."""
        return self._in_use

    def fits(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` could ever get a buffer from this pool."""
        return round_up(max(nbytes, 1)) <= self.capacity

    def try_acquire(self, nbytes: int) -> AlignedBuffer | None:
        """A buffer of at least ``nbytes``, or ``None`` while in-use buffers leave no room.

        Raises :class:`CapacityError` if ``nbytes`` exceeds the whole pool.
        """
        if not self.fits(nbytes):
            raise CapacityError(
                f"a buffer of {nbytes} bytes exceeds the pool's capacity of {self.capacity} bytes"
            )
        size = _size_class(nbytes)
        with self._lock:
            same_size = self._idle.get(size)
            if same_size:
                self._idle_bytes -= size
                buffer: AlignedBuffer | None = same_size.pop()
            else:
                while (buffer := self._carve(size)) is None and self._idle_bytes:
                    self._drop_one_idle()
            if buffer is not None:
                self._in_use += size
            return buffer

    def release(self, buffer: AlignedBuffer) -> None:
        """Return a buffer for reuse; the caller must hold no view of it any more."""
        with self._lock:
            self._idle[buffer.capacity].append(buffer)
            self._idle_bytes += buffer.capacity
            self._in_use -= buffer.capacity

    def clear(self) -> None:
        """Free every idle buffer (buffers in use stay valid)."""
        with self._lock:
            while self._idle_bytes:
                self._drop_one_idle()

    # -- carving (under the lock) -------------------------------------------------------------------
    def _carve(self, size: int) -> AlignedBuffer | None:
        """A new buffer of a size class, or None if the budget has no room for its pages."""
        if size < ALIGNMENT:
            return self._carve_slot(size)
        if self._allocated + size > self.capacity:
            return None
        self._allocated += size
        if size > self.arena_bytes:  # rare by the budget: a map of its own
            return AlignedBuffer(size, pin=self.pin)
        arena, offset = self._run(_order(size))
        return AlignedBuffer.carved(arena, offset, size, arena)

    def _carve_slot(self, size: int) -> AlignedBuffer | None:
        slabs = self._slabs[size]
        if not slabs:
            if self._allocated + ALIGNMENT > self.capacity:
                return None
            self._allocated += ALIGNMENT
            arena, offset = self._run(0)
            slabs[_Slab(arena, offset, size)] = None
        slab = next(iter(slabs))
        offset = slab.free.pop()
        if not slab.free:
            del slabs[slab]
        return AlignedBuffer.carved(slab.arena, offset, size, slab)

    def _run(self, order: int) -> tuple[_Arena, int]:
        """A free run of ``2**order`` pages in some arena, mapping a new arena if none has one."""
        for arena in self._arenas:
            offset = arena.allocate(order)
            if offset is not None:
                return arena, offset
        arena = _Arena(self.arena_bytes, pin=self.pin)
        self._arenas.append(arena)
        offset = arena.allocate(order)
        assert offset is not None  # a fresh arena holds any run up to its own size
        return arena, offset

    def _drop_one_idle(self) -> None:
        size = max(s for s, bufs in self._idle.items() if bufs)
        buffer = self._idle[size].pop()
        self._idle_bytes -= size
        place = buffer.place
        if isinstance(place, _Slab):
            place.free.append(buffer.offset)
            self._slabs[size][place] = None
            if not place.unused:
                return
            del self._slabs[size][place]
            self._give_back(place.arena, place.offset, 0)
            self._allocated -= ALIGNMENT
            return
        self._allocated -= size
        if place is None:
            buffer.free()
        else:
            self._give_back(place, buffer.offset, _order(size))

    def _give_back(self, arena: _Arena, offset: int, order: int) -> None:
        arena.release(offset, order)
        if arena.empty:
            arena.unpin()
            self._arenas.remove(arena)


def _size_class(nbytes: int) -> int:
    """The capacity a buffer for ``nbytes`` gets: a slot size under a page, else whole pages."""
    for slot in SLOT_SIZES:
        if nbytes <= slot:
            return slot
    return round_up(nbytes)
