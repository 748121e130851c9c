"""The DRAM write-back cache: an optional layer over the catalog and the tier chain that keeps
copies of objects in staging buffers and gets dirty copies onto a tier without ever exceeding its
byte budget.

A store with a cache budget of 0 has no cache at all; puts and gets that bypass it (``cache=False``,
the training workloads) touch it only to drop a stale copy of the key. The cache knows nothing of
the store: it is given its memory (a [`StagingArea`][]), a writer (bytes -> a placement: the tier
chain) and its commit hook (``on_written``: the catalog's `written`, which journals each written
version if its record is still the key's current one). Each entry holds the record it caches, so
that check needs nothing of the cache. Write-back completions run on the cache's own completion
thread, so a journal ``fdatasync`` or a stale copy's delete never holds up a backend's I/O threads.

An entry's buffer goes back to the pool only when nothing uses it any more: no reader has it
pinned, no write-back is reading from it, and it is no longer the object's current copy. Making
room waits for write-back of dirty entries instead of growing. The cache's own lock guards its
entries alone.

A dirty copy whose write-back failed (a full tier: its capacity or ENOSPC; an I/O error) stays in
the cache, readable, and is only written again by `WriteBackCache.flush`. Until then the failure is
reported, naming the keys, by every flush, by every new dirty copy
(`WriteBackCache.check_written_back`) and by the store's close; a read that finds the room held by
such copies gets no entry (`WriteBackCache.load` returns None) and reads around the cache.
"""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .buffers import AlignedBuffer, round_up
from .errors import BackendIOError, CapacityError, StoreClosedError
from .limits import Priority

if TYPE_CHECKING:
    from .catalog import Record
    from .staging import StagingArea
    from .tier import Placement

PACK_BYTES = 4 << 20
"""Most bytes of small objects written back together as one pack object."""

Writer = Callable[[memoryview, Priority], "Future[Placement]"]
PackWriter = Callable[[memoryview, Sequence[tuple[int, int]], Priority], "Future[list[Placement]]"]
OnWritten = Callable[[Sequence[tuple[str, "Record"]], Sequence["Placement"]], list[bool]]
"""Given the (key, record) of versions written back and their new placements, commit those still
current and return which; raises if committing failed (it disposes of the placements itself)."""


@dataclass(eq=False)
class CacheEntry:
    """A cached copy of one version of ``key``: ``record`` is that version's catalog record."""

    key: str
    record: Record
    buffer: AlignedBuffer
    dirty: bool
    pins: int = 0
    """Readers copying out of the buffer right now."""
    writing: bool = False
    """A write-back is reading from the buffer."""
    attached: bool = True
    """Still the object's current cached copy (False once replaced, deleted or evicted)."""
    writeback_error: BaseException | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.record.nbytes

    def typed(self) -> torch.Tensor:
        """The cached bytes viewed as the object's tensor (shares the buffer)."""
        return self.buffer.view(self.nbytes).view(self.record.dtype).view(self.record.shape)

    def memoryview(self) -> memoryview:
        return self.buffer.memoryview(self.nbytes)

    @property
    def releasable(self) -> bool:
        return not (self.attached or self.pins or self.writing)


class LruIndex:
    """Attached cache entries by key, least recently used first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[CacheEntry]:
        return iter(list(self._entries.values()))

    def get(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def insert(self, entry: CacheEntry) -> None:
        self._entries[entry.key] = entry

    def touch(self, entry: CacheEntry) -> None:
        self._entries.move_to_end(entry.key)

    def detach(self, entry: CacheEntry) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        entry.attached = False

    def victim(self) -> CacheEntry | None:
        """Least recently used entry that may be written back or evicted now."""
        for entry in self._entries.values():
            if not entry.pins and not entry.writing and entry.writeback_error is None:
                return entry
        return None


class WriteBackCache:
    """Copies of objects in DRAM under a hard byte budget, written back to tiers lazily."""

    def __init__(
        self,
        memory: StagingArea,
        *,
        write: Writer,
        write_pack: PackWriter,
        on_written: OnWritten,
        pack_below: int,
    ) -> None:
        """``memory``: the buffers cached copies live in (its budget is the cache's; the cache
        closes it); ``write`` / ``write_pack``: put bytes on a tier (one object, or small objects
        packed into one); ``on_written``: the commit hook (see `OnWritten`); ``pack_below``: dirty
        objects smaller than this are written back in packs."""
        self.lock = threading.Condition()
        self.pack_below = pack_below
        """Dirty objects smaller than this are written back in packs (one backend object each)."""
        self._memory = memory
        self._index = LruIndex()
        self._write = write
        self._write_pack = write_pack
        self._on_written = on_written
        self._writebacks: set[CacheEntry] = set()
        self._failed: set[CacheEntry] = set()
        """Current dirty copies whose last write-back failed."""
        self._completions = ThreadPoolExecutor(1, thread_name_prefix="tierstore-commit")
        self._counters = {"hits": 0, "misses": 0, "evictions": 0, "writebacks": 0}
        self._peak_bytes = 0
        self._closed = False

    @property
    def capacity(self) -> int:
        return self._memory.capacity

    def fits(self, nbytes: int) -> bool:
        """Whether an object of ``nbytes`` can ever be cached (it is not larger than the budget)."""
        return self._memory.fits(nbytes)

    # -- lookups --------------------------------------------------------------------------------------
    def state(self, key: str) -> tuple[bool, bool]:
        """Whether ``key`` has a cached copy, and whether that copy is dirty (newer than any
        copy on a tier)."""
        with self.lock:
            entry = self._index.get(key)
            return entry is not None, entry is not None and entry.dirty

    def pin(self, key: str) -> CacheEntry | None:
        """The current copy of ``key``, pinned against release, or None (a miss)."""
        with self.lock:
            entry = self._index.get(key)
            if entry is None:
                self._counters["misses"] += 1
                return None
            entry.pins += 1
            self._index.touch(entry)
            self._counters["hits"] += 1
            return entry

    def touch(self, key: str) -> bool:
        """Mark ``key`` recently used; False if it is not cached."""
        with self.lock:
            entry = self._index.get(key)
            if entry is not None:
                self._index.touch(entry)
            return entry is not None

    def attach(self, entry: CacheEntry) -> None:
        """Make ``entry`` the current copy of its key (the previous copy is dropped)."""
        with self.lock:
            previous = self._index.get(entry.key)
            if previous is not None:
                self._detach(previous)
            self._index.insert(entry)

    # -- entries ----------------------------------------------------------------------------------
    def new_entry(self, key: str, record: Record, *, dirty: bool, pins: int = 0) -> CacheEntry | None:
        """An unattached entry with a buffer for ``record``'s bytes (making room as needed), or None
        where copies whose write-back failed hold the room (`no_room` says so)."""
        buffer = self._acquire(record.nbytes)
        return None if buffer is None else CacheEntry(key, record, buffer, dirty=dirty, pins=pins)

    def no_room(self, key: str, nbytes: int) -> CapacityError:
        """The error of a copy of ``key`` (``nbytes``) that cannot be cached because copies whose
        write-back failed hold the room; their failure is its ``__cause__``."""
        with self.lock:
            stuck = sum(failed.buffer.capacity for failed in self._failed)
            failures, cause = self._failures(repr)
        error = CapacityError(
            f"no cache room for {key!r} ({nbytes} bytes): {stuck} bytes are held because {failures}; "
            "free room on the tier and call flush(), or delete them"
        )
        error.__cause__ = cause
        return error

    def abandon(self, entry: CacheEntry) -> None:
        """Give back the buffer of an entry that was never attached (its fill or commit failed)."""
        with self.lock:
            self._memory.release(entry.buffer)
            self.lock.notify_all()

    def load(
        self, key: str, record: Record, read: Callable[[memoryview], None], *, pinned: bool
    ) -> CacheEntry | None:
        """Fill a new clean entry for ``record`` with ``read`` and attach it as ``key``'s copy;
        None, reading nothing, where copies whose write-back failed hold the room it needs (the
        caller reads around the cache)."""
        entry = self.new_entry(key, record, dirty=False, pins=int(pinned))
        if entry is None:
            return None
        try:
            read(entry.memoryview())
        except BaseException:
            self.abandon(entry)
            raise
        self.attach(entry)
        return entry

    def unpin(self, entry: CacheEntry) -> None:
        with self.lock:
            entry.pins -= 1
            self._release_if_unused(entry)
            self.lock.notify_all()

    # -- write-back -------------------------------------------------------------------------------
    def check_written_back(self, what: str) -> None:
        """Refuse a new dirty copy while copies whose write-back failed are only in memory: the
        store could not make it durable either.

        Args:
            what: the operation refused, for the message (``"put('k')"``).

        Raises:
            BackendIOError: see `write_back_error`.
        """
        if not self._failed:  # read without the lock: the common case costs one attribute read
            return
        error = self.write_back_error(
            f"{what} refused",
            "; free room on the tier and call flush(), or delete them (a put written to a tier "
            "before it resolves, write_through=True or cache=False, is still taken)",
        )
        if error is not None:
            raise error

    def write_back_error(
        self, before: str, after: str = "", describe: Callable[[str], str] = repr
    ) -> BackendIOError | None:
        """The error reporting the dirty copies whose write-back failed, or None if there are none.

        Args:
            before: the message's start (the operation).
            after: the message's end (what it means for those objects, what to do).
            describe: how the message shows each key.

        Returns:
            A [`BackendIOError`][] naming every such key, with the errno of the failure (ENOSPC for
            a tier at its capacity) and the failure itself as ``__cause__``.
        """
        with self.lock:
            if not self._failed:
                return None
            failures, cause = self._failures(describe)
        error = BackendIOError(_errno_of(cause), f"{before}: {failures}{after}")
        error.__cause__ = cause
        return error

    def _failures(self, describe: Callable[[str], str]) -> tuple[str, BaseException | None]:
        """Under the lock: the failed write-backs in words (every key, as ``describe`` shows it,
        and the first one's failure), and that failure."""
        failed = sorted(self._failed, key=lambda entry: entry.key)
        cause = failed[0].writeback_error if failed else None
        keys = ", ".join(describe(entry.key) for entry in failed)
        return (
            f"write-back failed for {len(failed)} object(s), which are only in memory: {keys} ({cause})",
            cause,
        )

    def flush(self) -> None:
        """Write every dirty entry back and wait.

        Entries smaller than ``pack_below`` go in packs: one backend object of up to `PACK_BYTES`
        per batch.

        Raises:
            BackendIOError: a write-back failed (see `write_back_error`); those entries stay dirty
                in the cache.
        """
        with self.lock:
            dirty = [entry for entry in self._index if entry.dirty and not entry.writing]
            for entry in dirty:
                self._begin_write_back(entry)
        pack_bytes = min(PACK_BYTES, self._memory.capacity // 4)
        batch: list[CacheEntry] = []
        batch_bytes = 0
        for entry in dirty:
            if not 0 < entry.nbytes < self.pack_below:
                self._write_back(entry)
                continue
            if batch and batch_bytes + entry.nbytes > pack_bytes:
                self._write_back_pack(batch)
                batch, batch_bytes = [], 0
            batch.append(entry)
            batch_bytes += entry.nbytes
        if batch:
            self._write_back_pack(batch)
        with self.lock:
            self.lock.wait_for(lambda: not self._writebacks)
        error = self.write_back_error("flush", "; they stay in the cache, and the next flush tries again")
        if error is not None:
            raise error

    def _acquire(self, nbytes: int) -> AlignedBuffer | None:
        """A buffer for ``nbytes``, writing back and evicting LRU entries to make room; None where
        copies whose write-back failed hold so much of the budget that it cannot fit."""
        needed = round_up(max(nbytes, 1))
        while True:
            with self.lock:
                if self._closed:
                    raise StoreClosedError("the TierStore is closed")
                buffer = self._memory.try_acquire(nbytes)
                if buffer is not None:
                    self._peak_bytes = max(self._peak_bytes, self._memory.allocated_bytes)
                    return buffer
                victim = self._index.victim()
                if victim is not None and not victim.dirty:
                    self._detach(victim)
                    self._counters["evictions"] += 1
                    continue
                in_flight = sum(entry.nbytes for entry in self._writebacks)
                if victim is None or in_flight >= needed:
                    stuck = sum(entry.buffer.capacity for entry in self._failed)
                    if self._memory.capacity - stuck < needed:
                        return None
                    self.lock.wait(timeout=1.0)  # for a pin, load or write-back to end
                    continue
                self._begin_write_back(victim)
            self._write_back(victim)

    def _begin_write_back(self, entry: CacheEntry) -> None:
        """Mark ``entry`` as being written back (under the lock, before writing it)."""
        entry.writing = True
        self._writebacks.add(entry)

    def _write_back(self, entry: CacheEntry) -> None:
        """Write a marked entry to a tier, outside the lock; completes asynchronously."""
        future = self._write(entry.memoryview(), Priority.BACKGROUND)
        future.add_done_callback(
            lambda done: self._completions.submit(
                self._finish, [entry], None if done.exception() else [done.result()], done.exception()
            )
        )

    def _write_back_pack(self, entries: list[CacheEntry]) -> None:
        """Write marked small entries as one pack object, copied into a staging buffer from the
        pool (each on its own if the pool has no room for it); their new versions commit
        together once the whole pack is written, so no reader sees part of one."""
        total = sum(entry.nbytes for entry in entries)
        with self.lock:
            staging = self._memory.try_acquire(total) if len(entries) > 1 else None
        if staging is None:
            for entry in entries:
                self._write_back(entry)
            return
        spans: list[tuple[int, int]] = []
        packed = staging.memoryview(total)
        offset = 0
        for entry in entries:
            packed[offset : offset + entry.nbytes] = (
                entry.memoryview()
            )  # a memcpy; a tensor slice costs ~10x more
            spans.append((offset, entry.nbytes))
            offset += entry.nbytes

        def done(written: Future[list[Placement]]) -> None:
            with self.lock:
                self._memory.release(staging)
            error = written.exception()
            self._finish(entries, None if error else written.result(), error)

        self._write_pack(packed, spans, Priority.BACKGROUND).add_done_callback(
            lambda written: self._completions.submit(done, written)
        )

    def _finish(
        self,
        entries: Sequence[CacheEntry],
        placements: Sequence[Placement] | None,
        error: BaseException | None,
    ) -> None:
        """On the completion thread: commit the new versions, then mark the entries clean."""
        clean = [False] * len(entries)
        if placements is not None:
            try:
                clean = self._on_written([(entry.key, entry.record) for entry in entries], placements)
            except BaseException as commit_error:
                error = commit_error
        with self.lock:
            for entry, now_clean in zip(entries, clean, strict=True):
                entry.writing = False
                self._writebacks.discard(entry)
                entry.writeback_error = error
                if error is None:
                    self._counters["writebacks"] += 1
                    self._failed.discard(entry)
                elif entry.attached:
                    self._failed.add(entry)
                if now_clean:
                    entry.dirty = False
                self._release_if_unused(entry)
            self.lock.notify_all()

    # -- release ----------------------------------------------------------------------------------
    def drop(self, key: str) -> None:
        """Forget ``key``'s cached copy (deleted, or replaced by a copy only on a tier)."""
        if key not in self._index:  # the common case of a bypassing put, without the lock
            return
        with self.lock:
            entry = self._index.get(key)
            if entry is not None:
                self._detach(entry)

    def _detach(self, entry: CacheEntry) -> None:
        self._index.detach(entry)
        self._failed.discard(entry)
        self._release_if_unused(entry)
        self.lock.notify_all()

    def _release_if_unused(self, entry: CacheEntry) -> None:
        if entry.releasable:
            self._memory.release(entry.buffer)

    def stats(self) -> dict[str, Any]:
        """Counters and byte figures."""
        with self.lock:
            return {
                **self._counters,
                "cache_budget_bytes": self._memory.capacity,
                "cache_bytes": self._memory.allocated_bytes,
                "peak_cache_bytes": self._peak_bytes,
            }

    def close(self) -> None:
        """Wait for write-backs in flight, then release every buffer."""
        with self.lock:
            self._closed = True
            self.lock.wait_for(lambda: not self._writebacks)
            for entry in self._index:
                self._index.detach(entry)
                self._memory.release(entry.buffer)
            self._failed.clear()
        self._completions.shutdown(wait=True)
        self._memory.close()


def _errno_of(cause: BaseException | None) -> int:
    """The errno a failed write-back reports: its cause's, ENOSPC for a tier at its capacity
    ([`CapacityError`][], which has none), else EIO."""
    if isinstance(cause, OSError) and cause.errno:
        return cause.errno
    return errno.ENOSPC if isinstance(cause, CapacityError) else errno.EIO
