"""Page-aligned host buffers and the pool that recycles them.

O_DIRECT needs the buffer address, file offset and length aligned, and ``torch.empty`` /
``np.empty`` give no such guarantee, so every buffer here is anonymous ``mmap`` memory (always
page-aligned). Tensor views are built with ``np.frombuffer`` + ``torch.from_numpy``: the numpy
array holds the mapping alive for as long as any tensor view exists (``torch.frombuffer`` does not,
and crashes once the mapping is closed).

A pool made with ``pin=True`` (a workload that copies to a device) page-locks each map for
asynchronous copies ([`tierstore.device.lock_pages`][], on the calling thread's current device); no
other pool touches CUDA. A pinned map is not inherited by a forked child (``MADV_DONTFORK``: a
child's copy-on-write fault would otherwise give the parent a new page while a DMA still targets the
old one), and it is unlocked exactly once, by a finalizer on the numpy array every view of it holds:
when the pool gives the map back, or when the last view is gone, whichever comes first, always
before the map is unmapped (a map unmapped while still registered would make a later map at the same
address fail to register).

The pool does not map one region per buffer: the kernel allows about 65,000 maps per process
(``vm.max_map_count``), so a cache of many small objects would fail with ENOMEM long before its
budget. It carves buffers out of a few large maps (`_Arena`: runs of pages, first fit, pinned once
per map), and objects under a page share pages as slots of a size class (`_Slab`). Buffers of a page
or more keep page-aligned addresses and page-multiple capacities, as O_DIRECT needs.

Freed pages normally go back to the kernel, so an idle pool costs nothing. A *resident* pool
(``resident=True``) keeps them instead, up to its capacity: memory reused for buffers of every
size without a page fault (a first touch costs several times what copying into a touched page
does), and never more resident than the capacity. For workloads whose buffer sizes change all the
time (saved activations) and that fill their budget every step anyway.

Large maps are backed by transparent huge pages (`_anonymous_map`): the block layer turns an
O_DIRECT request into one segment per physically contiguous piece of its buffer, so on 4 KiB pages a
4 MiB request is split into requests of a few hundred KiB (``max_segments``), and this machine's
disk moved about 0.7 GB/s that way against 2-3 GB/s with the whole 4 MiB in one request.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from .device_runtime import CUDA, DeviceRuntime, lock_pages, unlock_pages
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
    """A page-aligned, optionally page-locked block of host memory of fixed capacity.

    Built directly, it is a map of its own. A [`BufferPool`][] hands out buffers carved from its
    arenas instead: a slice of a shared map, whose pinning belongs to the map.

    Args:
        capacity: its size in bytes (rounded up to whole pages).
        pin: page-lock it for copies to the calling thread's current device.
        runtime: the device runtime that page-locks it; default CUDA's.

    Raises:
        PinnedMemoryError: page-locking failed (the message names the limits).
    """

    __slots__ = ("_array", "_tensor", "_unlock", "capacity", "offset", "pinned", "place")

    def __init__(self, capacity: int, *, pin: bool = False, runtime: DeviceRuntime | None = None) -> None:
        self.capacity = round_up(max(capacity, 1))
        self.offset = 0
        self.place: _Arena | _Slab | None = None
        """Where a pool buffer was carved from (None: its own map)."""
        memory, start = _anonymous_map(self.capacity)
        self._array = np.frombuffer(memory, dtype=np.uint8, count=self.capacity, offset=start)
        self._tensor = torch.from_numpy(self._array)
        self._unlock = None if not pin else _page_lock(memory, self._array, runtime)
        self.pinned = pin

    @classmethod
    def carved(cls, arena: _Arena, offset: int, capacity: int, place: _Arena | _Slab) -> AlignedBuffer:
        """``capacity`` bytes at ``offset`` of ``arena``'s map (no map of its own)."""
        buffer = cls.__new__(cls)
        buffer.capacity, buffer.offset, buffer.place = capacity, offset, place
        buffer._array, buffer._tensor = arena.array, arena.tensor
        buffer.pinned, buffer._unlock = arena.pinned, None
        return buffer

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a uint8 tensor sharing this memory."""
        return self.view(self.capacity)

    def view(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes as a uint8 tensor sharing this memory."""
        return self._tensor[self.offset : self.offset + nbytes]

    def array(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The first ``nbytes`` bytes as a new numpy array object sharing this memory."""
        return self._array[self.offset : self.offset + nbytes]

    def memoryview(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` bytes as a writable memoryview (what backends consume)."""
        return self._array[self.offset : self.offset + nbytes].data

    def free(self) -> None:
        """Unpin a buffer with a map of its own (at once: no copy may touch it any more); the
        mapping itself is unmapped once the last view of it is gone. (A pool buffer goes back to
        its pool instead.)"""
        if self._unlock is not None:
            self._unlock()
            self.pinned, self._unlock = False, None


def _anonymous_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous map with room for ``nbytes`` from the returned (page-aligned) offset.

    From `HUGE_MAP_BYTES` on it is backed by transparent huge pages, the offset aligned to one (the
    map is a huge page longer; the untouched slack is never resident); smaller maps are kept off
    them. Private, not Python's default shared map: shared anonymous memory is shmem, which the
    kernel does not back with huge pages here (``shmem_enabled`` is ``never``)."""
    huge = _huge(nbytes)
    memory = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not huge:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            memory.madvise(mmap.MADV_NOHUGEPAGE)
        return memory, 0
    memory.madvise(mmap.MADV_HUGEPAGE)
    return memory, -np.frombuffer(memory, dtype=np.uint8).ctypes.data % HUGE_PAGE


def _huge(nbytes: int) -> bool:
    """Whether a map of ``nbytes`` is backed by transparent huge pages (Linux only)."""
    return nbytes >= HUGE_MAP_BYTES and hasattr(mmap, "MADV_HUGEPAGE")


def aligned_tensor(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements in page-aligned memory of its own: O_DIRECT reads and
    writes go straight to and from it, without a bounce copy."""
    nbytes = numel * dtype.itemsize
    return AlignedBuffer(nbytes).view(nbytes).view(dtype)


def _page_lock(
    memory: mmap.mmap, array: np.ndarray[Any, np.dtype[np.uint8]], runtime: DeviceRuntime | None
) -> Callable[[], object]:
    """Page-lock ``array`` (all of a map's bytes that views use) and keep ``memory``, its map, out
    of forked children. The returned finalizer unlocks it exactly once: when called, or when the
    array is garbage (its last view gone, the map not yet unmapped), whichever comes first.

    Raises:
        PinnedMemoryError: page-locking failed (nothing is left locked).
    """
    if hasattr(mmap, "MADV_DONTFORK"):
        memory.madvise(mmap.MADV_DONTFORK)
    runtime = CUDA if runtime is None else runtime
    address = int(array.ctypes.data)
    lock_pages(runtime, address, array.nbytes)
    return weakref.finalize(array, unlock_pages, runtime, address, os.getpid())


ARENA_BYTES = 64 << 20
"""Largest arena map of a pool that gives pages back; a pool with a smaller budget maps arenas of
its budget, so pinning a whole arena never pins more than the budget."""

SLOT_SIZES = (64, 128, 256, 512, 1024, 2048)
"""Size classes of objects under a page: slots of one page (a slab). 64-byte alignment suits
every dtype's view; such objects are below O_DIRECT's block size anyway (the backend bounces
them through an aligned block)."""


class _Arena:
    """One large anonymous map carved into runs of whole pages, first fit in address order.

    Freed runs merge with free neighbours. Their pages go back to the kernel at once
    (``MADV_DONTNEED``), unless the map is pinned (pinned pages stay resident by definition) or
    ``resident_limit`` is set: then freed pages stay for the next runs, a new run goes where it
    needs the fewest pages made resident (first fit among equals), and only when it would take
    the resident pages over the limit are free ones given back, from the top of the map down.
    Resident pages are counted in huge pages on a huge-page map, as the kernel backs it. Runs of a
    huge page or more start on a huge-page boundary where one fits, so an O_DIRECT request from
    them crosses as few physically contiguous pieces as possible."""

    def __init__(
        self,
        nbytes: int,
        *,
        pin: bool,
        runtime: DeviceRuntime | None = None,
        resident_limit: int | None = None,
    ) -> None:
        self.nbytes = nbytes
        self._map, self._start = _anonymous_map(nbytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=self._start)
        self.tensor = torch.from_numpy(self.array)
        self.pinned = pin
        self._unlock = None if not pin else _page_lock(self._map, self.array, runtime)
        self._pages = nbytes // ALIGNMENT
        self._free: list[tuple[int, int]] = [(0, self._pages)]
        """Free runs as (first page, pages), in address order, never adjacent."""
        self._unit = HUGE_PAGE // ALIGNMENT if _huge(nbytes) else 1
        """Pages per unit of residency: what the kernel faults in at once."""
        self._limit = None if resident_limit is None else resident_limit // (self._unit * ALIGNMENT)
        self._touched = np.zeros(-(-self._pages // self._unit), dtype=bool)
        """Units made resident and not given back since (kept only with a resident limit)."""

    @property
    def empty(self) -> bool:
        return self._free == [(0, self._pages)]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the map kept resident for reuse (resident arenas only; others count 0)."""
        return int(self._touched.sum()) * self._unit * ALIGNMENT

    def allocate(self, pages: int, fresh_pages: bool = False) -> int | None:
        """Byte offset of a new run of ``pages`` pages, or None if no free run holds it. With a
        resident limit reached, a run needing pages made resident is taken only if
        ``fresh_pages`` (giving back free resident pages elsewhere)."""
        align = HUGE_PAGE // ALIGNMENT if pages * ALIGNMENT >= HUGE_PAGE else 1
        candidates = []
        for index, (first, length) in enumerate(self._free):
            if length < pages:
                continue
            start = -(-first // align) * align
            candidates.append((index, start if start + pages <= first + length else first))
            if self._limit is None and start + pages <= first + length:
                break  # first fit
        if not candidates:
            return None
        if self._limit is not None:  # the run that needs the fewest pages made resident
            candidates.sort(key=lambda candidate: self._cold_units(candidate[1], pages))
            cold = self._cold_units(candidates[0][1], pages)
            if cold and int(self._touched.sum()) + cold > self._limit and not fresh_pages:
                return None
        return self._take(*candidates[0], pages)

    def _cold_units(self, start: int, pages: int) -> int:
        """Units of the run at ``start`` that are not resident yet."""
        return int((~self._touched[start // self._unit : -(-(start + pages) // self._unit)]).sum())

    def _take(self, index: int, start: int, pages: int) -> int | None:
        first, length = self._free[index]
        rest = [(first, start - first), (start + pages, first + length - start - pages)]
        self._free[index : index + 1] = [(page, count) for page, count in rest if count]
        if self._limit is not None:
            units = slice(start // self._unit, -(-(start + pages) // self._unit))
            over = int(self._touched.sum()) + self._cold_units(start, pages) - self._limit
            if over > 0 and self._trim(over) < over:
                self.release(start * ALIGNMENT, pages)  # no room to make it resident
                return None
            self._touched[units] = True
        return start * ALIGNMENT

    def _trim(self, units: int) -> int:
        """Give back up to ``units`` resident units lying wholly in free runs, from the top of
        the map down; how many were given back."""
        released = 0
        for first, length in reversed(self._free):
            if released >= units:
                break
            whole = slice(-(-first // self._unit), (first + length) // self._unit)
            touched = int(self._touched[whole].sum())
            if touched:
                start, stop = whole.start * self._unit * ALIGNMENT, whole.stop * self._unit * ALIGNMENT
                self._map.madvise(mmap.MADV_DONTNEED, self._start + start, stop - start)
                self._touched[whole] = False
                released += touched
        return released

    def release(self, offset: int, pages: int) -> None:
        if self._limit is None and not self.pinned:
            self._map.madvise(mmap.MADV_DONTNEED, self._start + offset, pages * ALIGNMENT)
        first = offset // ALIGNMENT
        index = bisect.bisect(self._free, (first, 0))
        if index < len(self._free) and first + pages == self._free[index][0]:
            pages += self._free.pop(index)[1]
        if index and sum(self._free[index - 1]) == first:
            first, pages = self._free[index - 1][0], self._free[index - 1][1] + pages
            index -= 1
            del self._free[index]
        self._free.insert(index, (first, pages))

    def unpin(self) -> None:
        """Unlock a pinned map at once (the pool gives it back: no buffer of it is in use, so no
        copy touches it); its finalizer then has nothing left to do."""
        if self._unlock is not None:
            self._unlock()
            self.pinned, self._unlock = False, None


class _Slab:
    """One page of an arena cut into equal slots for objects smaller than a page."""

    __slots__ = ("arena", "free", "offset", "slot")

    def __init__(self, arena: _Arena, offset: int, slot: int) -> None:
        self.arena, self.offset, self.slot = arena, offset, slot
        self.free = list(range(offset + ALIGNMENT - slot, offset - 1, -slot))

    @property
    def unused(self) -> bool:
        return len(self.free) == ALIGNMENT // self.slot


def _pages(nbytes: int) -> int:
    """Pages of the run that holds ``nbytes``."""
    return round_up(nbytes) // ALIGNMENT


class Lease(NamedTuple):
    """Pool memory lent by [`BufferPool.try_lease`][]: two uint8 tensors over the same bytes."""

    tensor: torch.Tensor
    """Holds the lease: the buffer returns to the pool when no tensor shares this storage."""
    io: torch.Tensor
    """Does not hold it: hand this one to I/O (a store's ``put``/``get``) whose futures may keep
    references after they complete, and keep ``tensor`` until the I/O is done."""


class BufferPool:
    """Recycles aligned buffers under a hard byte budget.

    Buffers are kept per size (page-rounded, or a slot size under a page), so a workload of
    equal-sized objects (optimizer subgroups) allocates once and then only reuses.
    ``allocated_bytes`` (memory held: pages of buffers in use or idle, whole pages for slabs) never
    exceeds ``capacity``: idle buffers of other sizes are freed to make room, and when buffers in
    use leave no room [`try_acquire`][] returns ``None`` so the caller can evict.

    ``pin``: page-lock the memory for asynchronous copies to a device (for a workload that makes
    them; see the module docstring), on the calling thread's current device, through ``runtime``
    (default CUDA's). ``resident``: keep freed pages for reuse instead of giving them back (see the module
    docstring): the pool is then one map of twice its capacity, so that buffers in use rarely
    split its free pages into pieces too small for the next one, of which at most ``capacity``
    bytes are ever resident (rounded down to whole huge pages on a huge-page map). Pinned, it is
    one map of its capacity, all of it resident.
    """

    def __init__(
        self,
        capacity: int,
        *,
        pin: bool = False,
        resident: bool = False,
        runtime: DeviceRuntime | None = None,
    ) -> None:
        if capacity < 0:
            raise CapacityError(f"buffer pool capacity must be >= 0, got {capacity}")
        self.pin = pin
        self.runtime = runtime
        """The device runtime that page-locks a pinned pool's maps (None: CUDA's)."""
        self.resident = resident
        if resident:
            self.arena_bytes = round_up(max(capacity, ALIGNMENT)) * (1 if self.pin else 2)
            capacity -= capacity % (HUGE_PAGE if _huge(self.arena_bytes) else ALIGNMENT)
        else:
            self.arena_bytes = min(ARENA_BYTES, round_up(max(capacity, ALIGNMENT)))
        self.capacity = capacity
        self._arenas: list[_Arena] = []
        self._slabs: dict[int, dict[_Slab, None]] = {size: {} for size in SLOT_SIZES}
        """Slabs with a free slot, per slot size (an insertion-ordered set)."""
        self._idle: defaultdict[int, list[AlignedBuffer]] = defaultdict(list)
        self._idle_bytes = 0
        self._allocated = 0
        self._in_use = 0
        self._closed = False
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

    def try_acquire(self, nbytes: int, *, fresh_pages: bool = False) -> AlignedBuffer | None:
        """A buffer of at least ``nbytes``, or ``None`` while in-use buffers leave no room.

        A resident pool that has all the resident pages it may keep serves a buffer only from
        free ones, unless ``fresh_pages``: then, when buffers in use split its free resident
        pages into pieces too small, it gives some back and takes fresh ones (page faults) for a
        run elsewhere. Callers pass it when waiting can free nothing more.

        Raises [`CapacityError`][] if ``nbytes`` exceeds the whole pool, and its subclass
        [`PinnedMemoryError`][] if a pinned pool's new map cannot be page-locked.
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
                while (buffer := self._carve(size, fresh_pages)) is None and self._idle_bytes:
                    self._drop_one_idle()
            if buffer is not None:
                self._in_use += size
            return buffer

    def try_lease(
        self, nbytes: int, on_return: Callable[[], None] | None = None, *, fresh_pages: bool = False
    ) -> Lease | None:
        """A buffer of at least ``nbytes`` lent as tensors of exactly ``nbytes`` (see `Lease`), or
        ``None`` while in-use buffers leave no room (as [`try_acquire`][], which also says what
        ``fresh_pages`` means).

        The buffer comes back by itself once the last tensor sharing ``Lease.tensor``'s storage
        is gone, then ``on_return`` runs, on whichever thread let go last: lend memory to code
        whose lifetimes you do not control (autograd's) without a release call."""
        buffer = self.try_acquire(nbytes, fresh_pages=fresh_pages)
        if buffer is None:
            return None
        held = buffer.array(nbytes)
        weakref.finalize(held, self._returned, buffer, on_return)
        return Lease(torch.from_numpy(held), torch.from_numpy(buffer.array(nbytes)))

    def _returned(self, buffer: AlignedBuffer, on_return: Callable[[], None] | None) -> None:
        self.release(buffer)
        if on_return is not None:
            on_return()

    def release(self, buffer: AlignedBuffer) -> None:
        """Return a buffer for reuse; the caller must hold no view of it any more, and no copy may
        still touch it. A resident pool puts its pages back in the map at once (they stay
        resident, for any size); a closed pool frees them."""
        with self._lock:
            self._in_use -= buffer.capacity
            if self.resident or self._closed:
                self._free(buffer)
                if self._closed:
                    self._drop_empty_arenas()
                return
            self._idle[buffer.capacity].append(buffer)
            self._idle_bytes += buffer.capacity

    def clear(self) -> None:
        """Free every idle buffer, and a resident pool's map once no buffer is in use (buffers in
        use stay valid)."""
        with self._lock:
            while self._idle_bytes:
                self._drop_one_idle()
            self._drop_empty_arenas()

    def close(self) -> None:
        """[`clear`][], and free each buffer still in use as soon as it is released: its map, if
        pinned, is unlocked then, never while the buffer may still be in a copy."""
        with self._lock:
            self._closed = True
        self.clear()

    def _drop_empty_arenas(self) -> None:
        """Unpin and forget the maps no buffer uses (under the lock)."""
        for arena in [arena for arena in self._arenas if arena.empty]:
            arena.unpin()
            self._arenas.remove(arena)

    # -- carving (under the lock) -------------------------------------------------------------------
    def _carve(self, size: int, fresh_pages: bool) -> AlignedBuffer | None:
        """A new buffer of a size class, or None if the budget has no room for its pages."""
        if size < ALIGNMENT:
            return self._carve_slot(size, fresh_pages)
        if self._allocated + size > self.capacity:
            return None
        if size > self.arena_bytes:  # rare by the budget: a map of its own
            buffer = AlignedBuffer(size, pin=self.pin, runtime=self.runtime)
            self._allocated += size
            return buffer
        placed = self._run(_pages(size), fresh_pages)
        if placed is None:
            return None
        self._allocated += size
        arena, offset = placed
        return AlignedBuffer.carved(arena, offset, size, arena)

    def _carve_slot(self, size: int, fresh_pages: bool) -> AlignedBuffer | None:
        slabs = self._slabs[size]
        if not slabs:
            placed = self._run(1, fresh_pages) if self._allocated + ALIGNMENT <= self.capacity else None
            if placed is None:
                return None
            self._allocated += ALIGNMENT
            slabs[_Slab(*placed, size)] = None
        slab = next(iter(slabs))
        offset = slab.free.pop()
        if not slab.free:
            del slabs[slab]
        return AlignedBuffer.carved(slab.arena, offset, size, slab)

    def _run(self, pages: int, fresh_pages: bool) -> tuple[_Arena, int] | None:
        """A free run of ``pages`` pages in some arena, mapping a new arena if none has one; None if
        a resident pool's one map has none (see [`try_acquire`][])."""
        for arena in self._arenas:
            offset = arena.allocate(pages, fresh_pages)
            if offset is not None:
                return arena, offset
        if self.resident and self._arenas:
            return None
        limit = self.capacity if self.resident and not self.pin else None
        arena = _Arena(self.arena_bytes, pin=self.pin, runtime=self.runtime, resident_limit=limit)
        self._arenas.append(arena)
        offset = arena.allocate(pages, fresh_pages)
        assert offset is not None  # a fresh arena holds any run up to its own size
        return arena, offset

    def _drop_one_idle(self) -> None:
        size = max(s for s, bufs in self._idle.items() if bufs)
        self._idle_bytes -= size
        self._free(self._idle[size].pop())

    def _free(self, buffer: AlignedBuffer) -> None:
        """Give a buffer's memory back to its slab, arena or the kernel (under the lock)."""
        size, place = buffer.capacity, buffer.place
        if isinstance(place, _Slab):
            place.free.append(buffer.offset)
            self._slabs[size][place] = None
            if not place.unused:
                return
            del self._slabs[size][place]
            self._give_back(place.arena, place.offset, 1)
            self._allocated -= ALIGNMENT
            return
        self._allocated -= size
        if place is None:
            buffer.free()
        else:
            self._give_back(place, buffer.offset, _pages(size))

    def _give_back(self, arena: _Arena, offset: int, pages: int) -> None:
        arena.release(offset, pages)
        if arena.empty and not self.resident:
            arena.unpin()
            self._arenas.remove(arena)


def _size_class(nbytes: int) -> int:
    """The capacity a buffer for ``nbytes`` gets: a slot size under a page, else whole pages."""
    for slot in SLOT_SIZES:
        if nbytes <= slot:
            return slot
    return round_up(nbytes)
