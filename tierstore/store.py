"""TierStore: put and get torch tensors by key through a DRAM cache over persistent tiers.

Contract in brief (details on each method):

* ``put``/``get``/``prefetch`` return ``concurrent.futures.Future`` objects and never block on I/O;
  ``store[key] = t``, ``store[key]`` and ``del store[key]`` are the blocking forms.
* Operations on one key take effect in call order (a ``get`` sees the ``put`` issued before it);
  operations on different keys run in parallel.
* ``put`` borrows the caller's tensor until its future resolves: it is copied into a cache buffer
  (or, if larger than the whole cache, written straight to a tier from the tensor's memory).
* Metadata commits only after the data it points to is complete, so a failed put leaves the
  previous version (or no object) visible, never a torn one.
* Every extent written carries an xxHash3 checksum, verified on read (``verify``: ``always``,
  ``sampled`` = one read in 16, or ``off``); a mismatch raises :class:`ChecksumError` naming the
  key, the path and the backend object.
* The cache's buffers never exceed the byte budget: making room waits for write-back of dirty
  entries instead of growing.

Without ``manifest`` a store is scratch space: ``close`` deletes the objects it wrote. With a
``manifest`` directory (:mod:`tierstore.manifest`) it is persistent: each version that reaches a
tier is journaled (fsynced) before the previous one is deleted, reopening the same config finds
every committed object, a crash leaves each key at its old or its new version, and garbage from
interrupted writes is deleted at the next open. Objects still only in the write-back cache are not
durable until written back (``flush()``, eviction, ``close()``); ``policy="write-through"`` makes
every put durable when its future resolves.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import numbers
import os
import secrets
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self, TypeGuard

import torch

from ._futures import when_all
from ._serial import KeyedSerializer
from .backends import Backend
from .buffers import AlignedBuffer, BufferPool, round_up
from .cache import CacheEntry, LruIndex
from .config import ConfigSource, default_config, load_config
from .errors import (
    BackendIOError,
    BufferMismatchError,
    CapacityError,
    ChecksumError,
    ConfigError,
    InvalidKeyError,
    KeyNotFoundError,
    MissingDataError,
    OutOfRangeError,
    StoreClosedError,
)
from .limits import Priority
from .manifest import Manifest
from .memory import MemoryLedger
from .model import PathSpeed
from .tier import Placement, Tier, check_distinct_locations, digest

MAX_KEY_LENGTH = 1024
_log = logging.getLogger("tierstore")
Policy = Literal["write-back", "write-through"]
Verify = Literal["always", "sampled", "off"]
SAMPLE_EVERY = 16
PACK_BYTES = 4 << 20
"""Most bytes of small objects written back together as one pack object."""


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object (a snapshot; see :meth:`TierStore.info`)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    tier: str | None
    """Tier holding the committed persistent copy, or None if it lives only in the cache."""
    extents: list[dict[str, Any]]
    """Where that copy's bytes are: path name, object offset and length of each extent (for an
    object written back in a pack, the pack's extents)."""
    cached: bool
    dirty: bool
    """The cached copy is newer than any persistent copy."""


@dataclass
class _Record:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    entry: CacheEntry | None = None
    persisted: Placement | None = None
    journaled: Placement | None = None
    """Persistent stores: the version the manifest names while a newer one is only cached."""
    scratch: bool = False
    """Never journaled (see :meth:`TierStore.put`)."""


class TierStore:
    """A tiered tensor store (see the module docstring for the contract).

    ``tiers`` are tried in order for each object leaving the cache: it goes to the first with room.
    The store takes ownership of the tiers' backends and closes them in :meth:`close`.
    """

    def __init__(
        self,
        tiers: Sequence[Tier | Backend],
        *,
        cache_budget: int = 256 << 20,
        policy: Policy = "write-back",
        cache_reads: bool = True,
        workers: int = 4,
        manifest: str | os.PathLike[str] | None = None,
        verify: Verify = "always",
        memory_budget: int | None = None,
        pack_below: int = 64 << 10,
    ) -> None:
        _check_arguments(tiers, cache_budget, policy, workers, verify)
        if memory_budget is not None and (not _is_integer(memory_budget) or memory_budget < cache_budget):
            raise ConfigError(
                f"memory_budget: must be a number of bytes >= the cache budget ({cache_budget}), "
                f"not {memory_budget!r}"
            )
        self.memory = MemoryLedger(memory_budget)
        """The DRAM ledger the store's workloads reserve their budgets from (see :mod:`.memory`)."""
        self.memory.reserve("cache", cache_budget)
        self.tiers = [
            tier if isinstance(tier, Tier) else Tier(f"tier{index}", tier) for index, tier in enumerate(tiers)
        ]
        check_distinct_locations(self.tiers)
        for tier in self.tiers:
            tier.checksums = verify != "off"
        self.verify = verify
        self.pack_below = pack_below
        """Dirty objects smaller than this are written back in packs (one backend object each)."""
        self._reads = itertools.count()
        self.policy = policy
        self.cache_reads = cache_reads
        self._pool = BufferPool(cache_budget)
        self._cache = LruIndex()
        self._records: dict[str, _Record] = {}
        self._cond = threading.Condition()  # guards _records, _cache, entries, counters
        self._serial = KeyedSerializer(workers, "tierstore")
        self._writebacks: set[CacheEntry] = set()
        self._stats = {"hits": 0, "misses": 0, "evictions": 0, "writebacks": 0}
        self._peak_cache_bytes = 0
        self._closed = False
        self._manifest = None if manifest is None else Manifest(manifest)
        if self._manifest is None:  # a crash must not leave a scratch store's objects behind
            for tier in self.tiers:
                tier.claim_scratch()
        # Tier objects of concurrent stores in one directory never clash; a persistent store's
        # prefix is journaled first, so an interrupted write's object is recognised as garbage.
        token = secrets.token_hex(4) if self._manifest is None else self._manifest.token
        self._token = token
        # Backend names are "{token}-{n:x}" (see _token_of). itertools.count is safe to advance
        # from several threads at once; a generator is not ("generator already executing").
        self._serials = itertools.count()
        if self._manifest is not None:
            try:
                self._reopen(self._manifest)
            except BaseException:
                self._manifest.close()
                raise

    @classmethod
    def from_config(cls, config: ConfigSource | None = None) -> TierStore:
        """Open every tier's backend from a config document (default: the embedded one)."""
        settings = load_config(default_config() if config is None else config)
        tiers: list[Tier] = []
        try:
            for index, tier in enumerate(settings.tiers):
                tiers.append(Tier.from_config(tier, where=f"tiers.{index}"))
        except BaseException:
            for opened in tiers:
                opened.close()
            raise
        try:
            return cls(
                tiers,
                cache_budget=settings.cache.budget,
                policy=settings.cache.policy,
                cache_reads=settings.cache.cache_reads,
                workers=settings.workers,
                manifest=settings.manifest,
                verify=settings.verify,
                memory_budget=settings.memory_budget,
                pack_below=settings.cache.pack_below,
            )
        except BaseException:
            for opened in tiers:
                opened.close()
            raise

    # -- public API: asynchronous ----------------------------------------------------------------
    def put(
        self, key: str, tensor: torch.Tensor, *, cache: bool = True, scratch: bool = False
    ) -> Future[None]:
        """Store ``tensor`` (any dtype, shape, layout or device) under ``key``.

        The tensor is borrowed until the future resolves; do not modify it before then.
        ``cache=False`` is a hint from a caller that manages its own DRAM (the offloaded
        optimizer): the object goes straight to a tier from the tensor's memory, and any cached
        copy of the previous version is dropped. ``scratch=True`` marks an object written once,
        read once and deleted (a spilled activation): it skips the cache like ``cache=False`` and
        is never journaled, so a persistent store forgets it (and collects it) at the next open.
        """
        self._check_open()
        _check_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise BufferMismatchError(f"put({key!r}) needs a torch.Tensor, got {type(tensor).__name__}")
        _check_dense(f"put({key!r})", tensor)
        return self._serial.submit(key, self._put, key, tensor.detach(), cache and not scratch, scratch)

    def get(self, key: str, out: torch.Tensor | None = None, *, cache: bool = True) -> Future[torch.Tensor]:
        """Read ``key``; into ``out`` (same shape and dtype, any device/strides) if given.

        The future's result is ``out``, or a new CPU tensor. ``cache=False``: a copy already in
        the cache is still used, but a miss reads straight into the destination without caching.
        """
        self._check_open()
        self._check_known(key)
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise BufferMismatchError(f"get({key!r}): out must be a torch.Tensor")
            _check_dense(f"get({key!r}): out", out)
            record = self._records.get(key)
            if record is not None and not self._serial.pending(key):  # else a queued put decides
                _check_out(key, record, out)
        return self._serial.submit(key, self._get, key, out, cache)

    def prefetch(self, keys: Iterable[str]) -> Future[None]:
        """Load ``keys`` into the DRAM cache in the background; resolves when all are cached.

        Objects larger than the whole cache budget raise :class:`CapacityError` through the future.
        """
        self._check_open()
        if isinstance(keys, str) or not isinstance(keys, Iterable):  # a str is one key per character
            raise InvalidKeyError(f"prefetch takes an iterable of keys, not {keys!r}: use [key]")
        keys = list(keys)
        for key in keys:
            self._check_known(key)
        loads = [self._serial.submit(key, self._prefetch, key) for key in keys]
        return when_all(loads, lambda: None)

    # -- public API: blocking ---------------------------------------------------------------------
    def delete(self, key: str) -> None:
        """Remove ``key`` after the operations already issued on it; frees its cache and tier space."""
        self._check_open()
        self._check_known(key)
        self._serial.submit(key, self._delete, key).result()

    def flush(self) -> None:
        """Write every dirty cached object to its tier; raises if any write-back failed.

        Objects smaller than ``pack_below`` go in packs: one backend object of up to
        :data:`PACK_BYTES` per batch, each object's record pointing into it.
        Covers puts whose futures have resolved; wait for pending puts first to include them.
        """
        self._check_open()
        with self._cond:
            dirty = [entry for entry in self._cache if entry.dirty and not entry.writing]
            for entry in dirty:
                entry.writeback_error = None
                self._begin_write_back(entry)
        pack_bytes = min(PACK_BYTES, self._pool.capacity // 4)
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
        with self._cond:
            self._cond.wait_for(lambda: not self._writebacks)
            failed = [entry for entry in self._cache if entry.writeback_error is not None]
        if failed:
            raise BackendIOError(
                f"flush: write-back failed for {len(failed)} object(s), e.g. {failed[0].key!r}: "
                f"{failed[0].writeback_error}"
            ) from failed[0].writeback_error

    def contains(self, key: str) -> bool:
        """Whether ``key`` is committed (its put's future has resolved)."""
        self._check_open()
        return key in self._records

    def keys(self) -> list[str]:
        """Committed keys, in insertion order."""
        self._check_open()
        with self._cond:
            return list(self._records)

    def info(self, key: str) -> ObjectInfo:
        self._check_open()
        with self._cond:
            record = self._record(key)
            entry = record.entry
            return ObjectInfo(
                key=key,
                shape=record.shape,
                dtype=record.dtype,
                nbytes=record.nbytes,
                tier=record.persisted.tier.name if record.persisted else None,
                extents=record.persisted.describe() if record.persisted else [],
                cached=entry is not None,
                dirty=entry is not None and entry.dirty,
            )

    def stats(self) -> dict[str, Any]:
        """Counters: cache hits/misses/evictions/write-backs, cache bytes, per-tier bytes moved.

        Still readable after :meth:`close`, for a final report."""
        with self._cond:
            return {
                **self._stats,
                "cache_budget_bytes": self._pool.capacity,
                "memory": {"budget_bytes": self.memory.capacity, "reserved_bytes": self.memory.held()},
                "cache_bytes": self._pool.allocated_bytes,
                "peak_cache_bytes": self._peak_cache_bytes,
                "tiers": {tier.name: tier.stats() for tier in self.tiers},
            }

    def bandwidths(self) -> dict[str, list[PathSpeed]]:
        """Each tier's paths with their current bandwidth estimates (measured online, else as
        configured or probed), for workloads that plan their own I/O; paths without any estimate
        yet are left out."""
        speeds: dict[str, list[PathSpeed]] = {}
        for tier in self.tiers:
            speeds[tier.name] = []
            for path in tier.paths:
                estimate = path.bandwidth()
                if estimate is not None:
                    speeds[tier.name].append(PathSpeed(path.name, estimate.read, estimate.write))
        return speeds

    def log_stats(self, level: int = logging.INFO) -> dict[str, Any]:
        """Send :meth:`stats` to the ``tierstore`` logger (one JSON line) and return it."""
        stats = self.stats()
        _log.log(level, "tierstore stats %s", json.dumps(stats, default=str))
        return stats

    def close(self) -> None:
        """Finish issued operations and release all memory. A scratch store deletes its tier
        objects; a persistent one writes back dirty objects and compacts its manifest instead."""
        if self._closed:
            return
        if self._manifest is not None:
            self._serial.drain()
            self.flush()
        self._closed = True
        self._serial.shutdown()
        with self._cond:
            self._cond.wait_for(lambda: not self._writebacks)
            placements = [r.persisted for r in self._records.values() if r.persisted]
            for entry in self._cache:
                self._cache.detach(entry)
                self._pool.release(entry.buffer)
            self._records.clear()
        if self._manifest is None:
            for placement in placements:
                placement.tier.discard(placement)
        else:
            self._manifest.compact({_token_of(p.name) for p in placements})
            self._manifest.close()
        self._pool.clear()
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __setitem__(self, key: str, tensor: torch.Tensor) -> None:
        self.put(key, tensor).result()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key).result()

    def __delitem__(self, key: str) -> None:
        self.delete(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        self._check_open()
        return len(self._records)

    # -- operations (run on the serializer, one key at a time) -----------------------------------
    def _put(self, key: str, tensor: torch.Tensor, cache: bool, scratch: bool) -> None:
        record = _Record(
            tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size(), scratch=scratch
        )
        if not cache or not self._pool.fits(record.nbytes):  # straight to a tier
            source = _materialized(tensor)
            record.persisted = self._write_to_tier(_bytes_of(source), Priority.CRITICAL)
            self._commit(key, record)
            return
        buffer = self._acquire(record.nbytes)
        entry = CacheEntry(key, buffer, record.nbytes, dirty=True)
        try:
            entry.typed(record.dtype, record.shape).copy_(tensor)
            if self.policy == "write-through":
                record.persisted = self._write_to_tier(buffer.memoryview(record.nbytes), Priority.CRITICAL)
                entry.dirty = False
        except BaseException:
            self._pool.release(buffer)
            raise
        record.entry = entry
        self._commit(key, record)

    def _get(self, key: str, out: torch.Tensor | None, cache: bool) -> torch.Tensor:
        with self._cond:
            record = self._record(key)
            if out is not None:
                _check_out(key, record, out)
            entry = record.entry
            if entry is not None:
                entry.pins += 1
                self._cache.touch(entry)
                self._stats["hits"] += 1
            else:
                self._stats["misses"] += 1
        if entry is None and cache and self.cache_reads and self._pool.fits(record.nbytes):
            entry = self._load(key, record, Priority.CRITICAL, pinned=True)
        if entry is None:  # not cached and not to be cached: read straight into the destination
            return self._read_direct(key, record, out)
        try:
            destination = torch.empty(record.shape, dtype=record.dtype) if out is None else out
            destination.copy_(entry.typed(record.dtype, record.shape))
            return destination
        finally:
            self._unpin(entry)

    def _prefetch(self, key: str) -> None:
        with self._cond:
            record = self._record(key)
            if record.entry is not None:
                self._cache.touch(record.entry)
                return
        if not self._pool.fits(record.nbytes):
            raise CapacityError(
                f"prefetch({key!r}): {record.nbytes} bytes exceed the cache budget of "
                f"{self._pool.capacity} bytes"
            )
        self._load(key, record, Priority.PREFETCH, pinned=False)

    def _delete(self, key: str) -> None:
        with self._cond:
            record = self._record(key)
            del self._records[key]
            if record.entry is not None:
                self._detach(record.entry)
        if self._manifest is not None and key in self._manifest.entries:
            self._manifest.remove(key)
        for placement in {record.persisted, record.journaled} - {None}:
            assert placement is not None
            placement.tier.discard(placement)

    # -- cache mechanics --------------------------------------------------------------------------
    def _load(self, key: str, record: _Record, priority: Priority, *, pinned: bool) -> CacheEntry:
        """Read a persisted object into a new clean cache entry and attach it."""
        placement = record.persisted
        assert placement is not None
        buffer = self._acquire(record.nbytes)
        try:
            self._read(key, placement, buffer.memoryview(record.nbytes), priority)
        except BaseException:
            self._pool.release(buffer)
            raise
        entry = CacheEntry(key, buffer, record.nbytes, dirty=False, pins=int(pinned))
        with self._cond:
            record.entry = entry
            self._cache.insert(entry)
        return entry

    def _acquire(self, nbytes: int) -> AlignedBuffer:
        """A cache buffer for ``nbytes``, writing back and evicting LRU entries to make room."""
        needed = round_up(max(nbytes, 1))
        while True:
            with self._cond:
                self._check_open()
                buffer = self._pool.try_acquire(nbytes)
                if buffer is not None:
                    self._peak_cache_bytes = max(self._peak_cache_bytes, self._pool.allocated_bytes)
                    return buffer
                victim = self._cache.victim()
                if victim is not None and not victim.dirty:
                    self._detach(victim)
                    self._stats["evictions"] += 1
                    continue
                in_flight = sum(entry.nbytes for entry in self._writebacks)
                if victim is None or in_flight >= needed:
                    self._wait_for_room(needed)
                    continue
                self._begin_write_back(victim)
            self._write_back(victim)

    def _wait_for_room(self, needed: int) -> None:
        """Wait for a pin, load or write-back to end; fail if failed write-backs hold the room."""
        stuck = sum(e.buffer.capacity for e in self._cache if e.writeback_error is not None)
        if self._pool.capacity - stuck < needed:
            cause = next(e.writeback_error for e in self._cache if e.writeback_error is not None)
            raise CapacityError(
                f"no cache room for {needed} bytes: {stuck} bytes are dirty objects whose "
                f"write-back failed ({cause}); fix the tier and call flush()"
            ) from cause
        self._cond.wait(timeout=1.0)

    def _begin_write_back(self, entry: CacheEntry) -> None:
        """Mark ``entry`` as being written back (under the lock, before :meth:`_write_back`)."""
        entry.writing = True
        self._writebacks.add(entry)

    def _write_back(self, entry: CacheEntry) -> None:
        """Write a marked cache entry to a tier, outside the lock; completes asynchronously."""
        try:
            future = self._start_write(entry.buffer.memoryview(entry.nbytes), Priority.BACKGROUND)
        except BaseException as error:
            self._finish_write_backs([entry], [None], error)
            return
        future.add_done_callback(
            lambda done: self._finish_write_backs(
                [entry], [None if done.exception() else done.result()], done.exception()
            )
        )

    def _write_back_pack(self, entries: list[CacheEntry]) -> None:
        """Write marked small cache entries as one pack object (copied into a staging buffer from
        the pool; each entry on its own if the pool has no room for it). The entries' records
        are journaled together once the whole pack is written, so no reader sees part of one."""
        total = sum(entry.nbytes for entry in entries)
        staging = self._pool.try_acquire(total) if len(entries) > 1 else None
        if staging is None:
            for entry in entries:
                self._write_back(entry)
            return
        members: list[tuple[int, int, str | None]] = []
        packed = staging.memoryview(total)
        offset = 0
        for entry in entries:
            data = entry.buffer.memoryview(entry.nbytes)
            packed[offset : offset + entry.nbytes] = data  # a memcpy; a tensor slice costs ~10x more
            members.append((offset, entry.nbytes, digest(data) if self.verify != "off" else None))
            offset += entry.nbytes

        def finish(done: Future[Placement]) -> None:
            self._pool.release(staging)
            error = done.exception()
            if error is not None:
                self._finish_write_backs(entries, [None] * len(entries), error)
                return
            pack = done.result()
            self._finish_write_backs(entries, list(pack.tier.unpack(pack, members)), None)

        try:
            future = self._start_write(packed, Priority.BACKGROUND)
        except BaseException as error:
            self._pool.release(staging)
            self._finish_write_backs(entries, [None] * len(entries), error)
            return
        future.add_done_callback(finish)

    def _finish_write_backs(
        self,
        entries: Sequence[CacheEntry],
        placements: Sequence[Placement | None],
        error: BaseException | None,
    ) -> None:
        """Journal the write-backs still current (together: one sync for a pack), then mark them
        clean; versions replaced or deleted meanwhile, and the ones they supersede, are garbage."""
        garbage: list[Placement] = []
        with self._cond:
            records = [self._records.get(entry.key) for entry in entries]
            current = [
                error is None and record is not None and record.entry is entry
                for entry, record in zip(entries, records, strict=True)
            ]
        committed = {
            entry.key: (record, placement)
            for entry, record, placement, now in zip(entries, records, placements, current, strict=True)
            if now and record is not None and placement is not None
        }
        garbage.extend(p for p, now in zip(placements, current, strict=True) if p is not None and not now)
        try:
            self._journal_many(committed)
        except BaseException as journal_error:
            error, current = journal_error, [False] * len(entries)
            garbage.extend(placement for _, placement in committed.values())
        with self._cond:
            for entry, record, placement, now in zip(entries, records, placements, current, strict=True):
                entry.writing = False
                self._writebacks.discard(entry)
                if error is not None:
                    entry.writeback_error = error
                else:
                    self._stats["writebacks"] += 1
                if now:
                    assert record is not None
                    garbage.extend(p for p in (record.persisted, record.journaled) if p is not None)
                    record.persisted, record.journaled = placement, None
                    entry.dirty = False
                self._release_if_unused(entry)
            self._cond.notify_all()
        for stale in garbage:
            stale.tier.discard(stale)

    def _start_write(self, data: memoryview, priority: Priority) -> Future[Placement]:
        """Write a new object version to the first tier with room; a tier that fails with an I/O
        error (e.g. ENOSPC) hands the object on to the next one."""
        result: Future[Placement] = Future()
        name = f"{self._token}-{next(self._serials):x}"

        def attempt(start: int, error: BaseException | None) -> None:
            for index in range(start, len(self.tiers)):
                tier = self.tiers[index]
                if not tier.reserve(data.nbytes):
                    continue
                try:
                    future = tier.write(name, data, priority)
                except BaseException as failure:
                    tier.release(data.nbytes)
                    result.set_exception(failure)
                    return

                def done(finished: Future[Placement], index: int = index) -> None:
                    failure = finished.exception()
                    if failure is None:
                        result.set_result(finished.result())
                    elif isinstance(failure, OSError):
                        attempt(index + 1, failure)
                    else:
                        result.set_exception(failure)

                future.add_done_callback(done)
                return
            result.set_exception(
                error or CapacityError(f"no tier has room for an object of {data.nbytes} bytes")
            )

        attempt(0, None)
        return result

    def _write_to_tier(self, data: memoryview, priority: Priority) -> Placement:
        return self._start_write(data, priority).result()

    def _read(self, key: str, placement: Placement, out: memoryview, priority: Priority) -> None:
        verify = self.verify == "always" or (
            self.verify == "sampled" and next(self._reads) % SAMPLE_EVERY == 0
        )
        try:
            placement.tier.read_into(placement, out, priority, verify=verify).result()
        except ChecksumError as error:
            raise ChecksumError(f"key {key!r}: {error}") from None
        except MissingDataError as error:
            raise MissingDataError(errno.ENOENT, f"key {key!r}: {error.strerror}") from None
        except OutOfRangeError as error:  # the file is shorter than the object it should hold
            raise BackendIOError(errno.EIO, f"key {key!r}: stored object is truncated ({error})") from None

    def _read_direct(self, key: str, record: _Record, out: torch.Tensor | None) -> torch.Tensor:
        assert record.persisted is not None
        direct = (
            out is not None
            and out.device.type == "cpu"
            and out.is_contiguous()
            and not (out.is_conj() or out.is_neg())  # a lazy view's memory is not its values
        )
        destination = out if direct else torch.empty(record.shape, dtype=record.dtype)
        assert destination is not None
        self._read(key, record.persisted, _bytes_of(destination), Priority.CRITICAL)
        if out is not None and not direct:
            out.copy_(destination)
            return out
        return destination

    def _commit(self, key: str, record: _Record) -> None:
        """Make ``record`` the current version of ``key``; drop the previous one (a persistent
        store keeps the journaled version until a newer one is journaled)."""
        if record.persisted is not None:
            self._journal(key, record, record.persisted)
        if record.scratch and self._manifest is not None and key in self._manifest.entries:
            self._manifest.remove(key)  # the journaled version it replaces is about to go
        entry = record.entry
        with self._cond:
            previous = self._records.get(key)
            self._records[key] = record
            if entry is not None:
                self._cache.insert(entry)
            if previous is not None and previous.entry is not None:
                self._detach(previous.entry)
        if previous is None:
            return
        keep = previous.journaled or previous.persisted
        if self._manifest is not None and record.persisted is None and keep is not None:
            record.journaled = keep
        garbage = {previous.persisted, previous.journaled} - {None, record.journaled}
        for placement in garbage:
            assert placement is not None
            placement.tier.discard(placement)

    def _journal(self, key: str, record: _Record, placement: Placement) -> None:
        if self._manifest is not None and not record.scratch:
            self._manifest.commit(key, _manifest_entry(record, placement))

    def _journal_many(self, versions: dict[str, tuple[_Record, Placement]]) -> None:
        journaled = {key: version for key, version in versions.items() if not version[0].scratch}
        if self._manifest is not None and journaled:
            self._manifest.commit_many({key: _manifest_entry(*version) for key, version in journaled.items()})

    def _reopen(self, manifest: Manifest) -> None:
        """Load the manifest's records; delete tier objects an interrupted write left behind."""
        tiers = {tier.name: tier for tier in self.tiers}
        for key, entry in manifest.entries.items():
            tier = tiers.get(entry["tier"])
            if tier is None:
                raise ConfigError(
                    f"manifest {manifest.directory}: key {key!r} lives on tier {entry['tier']!r}, which the "
                    f"config does not have (tiers: {', '.join(tiers)})"
                )
            dtype = getattr(torch, entry["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(
                    f"manifest {manifest.directory}: key {key!r} has unknown dtype {entry['dtype']!r}"
                )
            placement = tier.placement_from(
                entry["name"], int(entry["nbytes"]), entry["extents"], entry.get("pack")
            )
            if not tier.reserve(placement.nbytes):
                raise CapacityError(f"tier {tier.name!r} is too small for the objects its manifest lists")
            self._records[key] = _Record(
                tuple(entry["shape"]), dtype, int(entry["nbytes"]), persisted=placement
            )
        referenced = {entry["name"] for entry in manifest.entries.values()}
        for tier in self.tiers:
            for path in tier.paths:
                for name in path.backend.list():
                    if _token_of(name) in manifest.tokens and name not in referenced:
                        path.backend.delete(name)

    def _detach(self, entry: CacheEntry) -> None:
        record = self._records.get(entry.key)
        if record is not None and record.entry is entry:
            record.entry = None
        self._cache.detach(entry)
        self._release_if_unused(entry)
        self._cond.notify_all()

    def _unpin(self, entry: CacheEntry) -> None:
        with self._cond:
            entry.pins -= 1
            self._release_if_unused(entry)
            self._cond.notify_all()

    def _release_if_unused(self, entry: CacheEntry) -> None:
        if entry.releasable:
            self._pool.release(entry.buffer)

    # -- checks -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the TierStore is closed")

    def _check_known(self, key: str) -> None:
        _check_key(key)
        if key not in self._records and not self._serial.pending(key):
            raise KeyNotFoundError(f"no object with key {key!r}")

    def _record(self, key: str) -> _Record:
        record = self._records.get(key)
        if record is None:
            raise KeyNotFoundError(f"no object with key {key!r}")
        return record


def _manifest_entry(record: _Record, placement: Placement) -> dict[str, Any]:
    """A key's manifest entry; a packed object adds ``pack`` (its offset and checksum in the pack
    object ``name``, whose extents are ``extents``), so older entries keep their meaning."""
    entry = {
        "shape": list(record.shape),
        "dtype": str(record.dtype).removeprefix("torch."),
        "nbytes": record.nbytes,
        "tier": placement.tier.name,
        "name": placement.name,
        "extents": placement.describe(),
    }
    pack_member = placement.pack_member()
    if pack_member is not None:
        entry["pack"] = pack_member
    return entry


def _token_of(name: str) -> str:
    """The store session that generated a backend object name (``{token}-{n:x}``)."""
    return name.split("-", 1)[0]


def _check_arguments(
    tiers: object, cache_budget: object, policy: object, workers: object, verify: object
) -> None:
    """Refuse a bad constructor argument with a :class:`ConfigError` naming it (a bool is not a
    number here, although Python lets it pass for one)."""
    if isinstance(tiers, (str, Tier, Backend)) or not isinstance(tiers, Sequence) or not tiers:
        raise ConfigError(
            f"tiers: a TierStore needs a non-empty list of Tier or Backend objects (open 'dram://' for a "
            f"store in memory only: objects larger than the cache and evicted ones go there); got {tiers!r}"
        )
    for index, tier in enumerate(tiers):
        if not isinstance(tier, (Tier, Backend)):
            raise ConfigError(
                f"tiers.{index}: expected a Tier or a Backend, got {type(tier).__name__} "
                "(TierStore.from_config opens backends from URLs)"
            )
    if not _is_integer(cache_budget) or cache_budget < 0:
        raise ConfigError(f"cache_budget: must be a number of bytes >= 0, not {cache_budget!r}")
    if policy not in ("write-back", "write-through"):
        raise ConfigError(f"policy: must be 'write-back' or 'write-through', not {policy!r}")
    if not _is_integer(workers) or workers < 1:
        raise ConfigError(f"workers: must be an integer >= 1, not {workers!r}")
    if verify not in ("always", "sampled", "off"):
        raise ConfigError(f"verify: must be 'always', 'sampled' or 'off', not {verify!r}")


def _is_integer(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_dense(what: str, tensor: torch.Tensor) -> None:
    """Refuse tensors whose values are not plain strided memory, before anything is written."""
    reason = None
    if tensor.is_nested:
        reason = "nested tensors are not supported; store each component under its own key"
    elif tensor.is_quantized:
        reason = "quantized tensors are not supported; store t.int_repr() and the quantization parameters"
    elif tensor.layout != torch.strided:
        reason = f"only dense (strided) tensors are supported, not {tensor.layout}; store t.to_dense()"
    elif tensor.is_meta:
        reason = "meta tensors have no data"
    if reason is not None:
        raise BufferMismatchError(f"{what}: {reason}")


def _check_key(key: object) -> None:
    """Keys never become file names (backend names are generated), but they travel into manifests
    and snapshots, so anything path-like that could escape a root is refused anyway."""
    if (
        not isinstance(key, str)
        or not key
        or len(key) > MAX_KEY_LENGTH
        or any(ord(c) < 32 for c in key)
        or key.startswith("/")
        or ".." in key.split("/")
    ):
        raise InvalidKeyError(
            f"keys are non-empty strings of at most {MAX_KEY_LENGTH} characters, without control "
            f"characters, a leading '/' or a '..' segment; got {key!r}"
        )


def _check_out(key: str, record: _Record, out: torch.Tensor) -> None:
    if out.dtype != record.dtype or tuple(out.shape) != record.shape:
        raise BufferMismatchError(
            f"get({key!r}): out is {out.dtype} {tuple(out.shape)} but the object is "
            f"{record.dtype} {record.shape}"
        )


def _materialized(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor holding ``tensor``'s values: conjugate and negative views keep
    their memory unchanged behind a flag, so their bytes are not their values until resolved."""
    return tensor.cpu().resolve_conj().resolve_neg().contiguous()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data
