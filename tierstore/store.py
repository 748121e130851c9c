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

A write-back that fails (a full tier: its capacity or ENOSPC; an I/O error) is never silent: the
object stays in the cache, readable, until a ``flush()`` writes it; meanwhile every ``flush()``,
every put that would leave another object only in the cache, and ``close()`` raise a
:class:`BackendIOError` with the failure's errno naming each such key. Reads never need cache room:
a miss the cache has no room for is read straight into the destination. ``close()`` releases
everything (the manifest's lock included) even where it cannot write back, and its error names
the objects lost.

With ``read_only=True`` a store reads a persistent store's manifest without locking it, even while
a writer (in this or another process) has it open: it sees the committed objects as of the open
(later writes are not seen), refuses every change with :class:`ReadOnlyStoreError`, and neither
collects garbage, compacts nor deletes anything, at the open or at ``close``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ._closeable import Closeable
from ._futures import when_all
from ._serial import KeyedSerializer
from .backends import Backend
from .bandwidth import PathSpeed
from .buffers import AlignedBuffer
from .cache import WriteBackCache
from .catalog import Catalog, Record
from .chain import TierChain
from .config import ConfigSource, Policy, StoreOptions, Verify, default_config, load_config
from .device import CallerStream, DeviceCopies, DeviceRuntime
from .errors import (
    BackendIOError,
    BufferMismatchError,
    CapacityError,
    ConfigError,
    InvalidKeyError,
    ManifestError,
    ReadOnlyStoreError,
    StoreClosedError,
)
from .limits import Priority
from .manifest import Manifest
from .memory import MemoryLedger
from .namespaces import Namespaces, check_key
from .staging import StagingArea
from .tier import Placement, Tier

_log = logging.getLogger("tierstore")


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object (a snapshot; see :meth:`TierStore.info`)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    tier: str | None
    """Tier holding the committed persistent copy, or None if it lives only in the cache."""
    name: str | None
    """The backend object holding that copy (a pack object for a packed one), or None."""
    extents: list[dict[str, Any]]
    """Where that copy's bytes are: path name, object offset and length of each extent (for an
    object written back in a pack, the pack's extents)."""
    cached: bool
    dirty: bool
    """The cached copy is newer than any persistent copy."""


class TierStore(Closeable):
    """A tiered tensor store (see the module docstring for the contract).

    Args:
        tiers: where objects live beyond DRAM, fastest first (a :class:`Tier`, or a bare
            :class:`Backend` made a tier of one path); each object goes to the first with room.
            The store owns them and closes them in :meth:`close`.
        cache_budget: bytes of the DRAM write-back cache; 0 for none (callers that stage their
            own DRAM, the training workloads, lose nothing by it). Every size in bytes here is
            an int or text such as ``"256MiB"``, as in a configuration document.
        policy: ``"write-back"`` (a put is durable once written back) or ``"write-through"``
            (once its future resolves).
        cache_reads: whether a read that misses the cache fills it (False: reads go straight to
            the destination).
        workers: threads running operations; operations on one key always run in call order.
        manifest: a directory for the journal that makes the store persistent; None for scratch
            space, whose objects :meth:`close` deletes.
        verify: checksum verification on reads: ``"always"``, ``"sampled"`` (one read in 16) or
            ``"off"``.
        memory_budget: bytes of host memory all the store's workloads may reserve together (the
            cache's budget included; see :attr:`memory`); None counts without a limit.
        pack_below: objects smaller than this are written back together in pack objects.
        cache_resident: keep the pages of buffers the cache frees for its next objects (a cache
            refilled over and over, as a checkpoint's staging is, then copies into memory already
            mapped, several times faster than into fresh pages); the RSS stays at the cache's
            high-water mark, never above ``cache_budget``, until the store closes.
        read_only: open the persistent store at ``manifest`` for reading only (a DCP load reads
            every rank's store, some still open in their writers): no lock is taken, so a writer
            may have it open; the store sees the objects committed when it opened, never later
            writes; put, delete and being the destination of :meth:`copy_to` raise
            :class:`ReadOnlyStoreError`, :meth:`flush` has nothing to write and returns at once,
            and neither the open nor :meth:`close` collects garbage, compacts the manifest or
            deletes an object. Reads (``cache_reads`` included) work as usual. An object the
            writer deletes or replaces after the open is gone for this store too
            (:class:`~tierstore.errors.MissingDataError` on reading it).

    Raises:
        ConfigError: an argument of the wrong type or out of range, named in the message;
            ``read_only`` without a ``manifest``.
        ManifestError, StoreLockedError: ``manifest`` is damaged, or open in another process (for
            writing); read-only: there is no persistent store at ``manifest`` (the directory is
            never created).

    A facade: the tier chain (:mod:`.chain`: placement, failover, verified reads, garbage), the
    commit protocol (:mod:`.catalog`) and, when ``cache_budget`` is above 0, the write-back cache
    layered over them (:mod:`.cache`) each own one job; the store checks arguments, orders
    operations per key and routes each one. A put or get that bypasses the cache goes straight to
    the chain and the catalog.
    """

    def __init__(
        self,
        tiers: Sequence[Tier | Backend],
        *,
        cache_budget: int | str = 256 << 20,
        policy: Policy = "write-back",
        cache_reads: bool = True,
        workers: int = 4,
        manifest: str | os.PathLike[str] | None = None,
        verify: Verify = "always",
        memory_budget: int | str | None = None,
        pack_below: int | str = 64 << 10,
        cache_resident: bool = False,
        read_only: bool = False,
    ) -> None:
        _check_tiers(tiers)
        _check_read_only(read_only, manifest)
        options = StoreOptions.from_arguments(
            cache_budget=cache_budget,
            policy=policy,
            cache_reads=cache_reads,
            workers=workers,
            manifest=manifest,
            verify=verify,
            memory_budget=memory_budget,
            pack_below=pack_below,
            cache_resident=cache_resident,
        ).arguments()  # as checked: a numpy integer becomes an int
        cache_budget, workers = options["cache_budget"], options["workers"]
        memory_budget = None if options["memory_budget"] is None else int(options["memory_budget"])
        pack_below = int(options["pack_below"])
        self.memory = MemoryLedger(memory_budget)
        """The DRAM ledger the store's workloads reserve their budgets from (see :mod:`.memory`)."""
        self.namespaces = Namespaces()
        """The key prefixes the store's workloads have claimed (see :mod:`.namespaces`)."""
        self.tiers = [
            tier if isinstance(tier, Tier) else Tier(f"tier{index}", tier) for index, tier in enumerate(tiers)
        ]
        self.verify = verify
        self.policy = policy
        self.cache_reads = cache_reads
        self.read_only = read_only
        """Opened read-only: every change raises :class:`ReadOnlyStoreError`."""
        self._closed = False
        opened = None if manifest is None else Manifest(manifest, read_only=read_only)
        try:
            # A persistent store's token is journaled first, so an interrupted write's object is
            # recognised as garbage; a scratch store's only keeps concurrent stores apart.
            token = secrets.token_hex(4) if opened is None else opened.token
            self._chain = TierChain(self.tiers, token=token, verify=verify)
            if opened is None:  # a crash must not leave a scratch store's objects behind
                self._chain.claim_scratch()
            self._catalog = Catalog(self._chain, opened)
        except BaseException:
            if opened is not None:
                opened.close()
            raise
        self.pack_below = pack_below
        """Dirty objects smaller than this are written back in packs (one backend object each)."""
        self._cache: WriteBackCache | None = None
        if cache_budget == 0:
            self.memory.reserve("cache", 0)  # the ledger still lists the cache's share: none
        else:
            self._cache = WriteBackCache(
                StagingArea(self.memory, "cache", cache_budget, resident=options["cache_resident"]),
                write=self._chain.write,
                write_pack=self._chain.write_pack,
                on_written=self._catalog.written,
                pack_below=pack_below,
            )
        self._serial = KeyedSerializer(workers, "tierstore")
        self._device = DeviceCopies(staging=self._device_staging)
        """Copies to and from devices (:mod:`.device`); nothing of it is made before the first."""

    @classmethod
    def from_config(cls, config: ConfigSource | None = None, *, read_only: bool = False) -> TierStore:
        """A store opened from a config document (see the configuration reference).

        Args:
            config: a :class:`StoreConfig`, a mapping, or the path of a ``.toml`` or ``.json``
                file; None for the embedded default (one nvme tier under ``./tierstore-data``).
            read_only: open the persistent store the config names for reading only (see the
                class docstring); the config must name a ``manifest``.

        Returns:
            The store, owning every tier's backend.

        Raises:
            ConfigError: the document is invalid (the message names the key), or a backend
                cannot be opened as configured.
        """
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
            return cls(tiers, **settings.arguments(), read_only=read_only)
        except BaseException:
            for opened in tiers:
                opened.close()
            raise

    @property
    def device_runtime(self) -> DeviceRuntime:
        """The device runtime the store's device copies and pinned memory go through (see
        :mod:`tierstore.device`): CUDA's, or a test's simulated device. A workload that copies
        between the store's memory and a device itself (an offloaded optimizer over GPU
        parameters) uses the same one."""
        return self._device.runtime

    def staging(
        self,
        owner: str,
        budget: int | str,
        *,
        pin: bool = False,
        resident: bool = False,
        pool_bytes: int | str | None = None,
    ) -> StagingArea:
        """DRAM for a workload to stage tensors through (see :class:`~tierstore.staging.StagingArea`).

        Args:
            owner: who holds the memory, as :meth:`stats` reports it.
            budget: bytes reserved from :attr:`memory` until the area is closed (an int, or
                text such as ``"64MiB"``).
            pin: page-lock the buffers for asynchronous copies to a device (only a workload that
                makes such copies pins: page-locking initialises CUDA).
            resident: keep freed pages for reuse instead of returning them to the kernel.
            pool_bytes: the most the area's buffers hold, if less than ``budget`` (the owner
                holds buffers of its own under the same budget).

        Returns:
            The staging area; close it to give the budget back.

        Raises:
            ConfigError: ``owner``, ``budget`` or ``pool_bytes`` of the wrong type or range.
            CapacityError: the budget does not fit beside the other workloads' reservations.
        """
        self._check_open()
        return StagingArea(
            self.memory,
            owner,
            budget,
            pin=pin,
            resident=resident,
            pool_bytes=pool_bytes,
            runtime=self._device.runtime,
        )

    # -- public API: asynchronous ----------------------------------------------------------------
    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        *,
        cache: bool = True,
        scratch: bool = False,
        write_through: bool | None = None,
    ) -> Future[None]:
        """Store ``tensor`` under ``key``; the tensor is borrowed until the future resolves (do
        not modify it before then).

        Args:
            key: the object's name (see :func:`~tierstore.namespaces.check_key` for the rules).
            tensor: any dtype, shape, strides or device; dense (strided) memory only. A CUDA
                tensor is read after the work queued on the calling thread's current stream when
                ``put`` is called, on a copy stream (:mod:`tierstore.device`), through the store's
                pinned pieces; work queued after the call may change it once the future resolves.
            cache: False for a caller that manages its own DRAM (the offloaded optimizer): the
                object goes straight to a tier from the tensor's memory, and any cached copy of
                the previous version is dropped.
            scratch: an object written once, read once and deleted (a spilled activation): it
                skips the cache and is never journaled, so a persistent store forgets it (and
                collects it) at the next open.
            write_through: for a cached put, whether it is written to a tier before its future
                resolves (and stays cached, clean); None for the store's ``policy``. A caller
                saving many objects it waits for (a checkpoint) gets the copies into the cache
                and the writes out of it overlapping, several puts at once.

        Returns:
            A future that resolves once the object is committed: durable on a tier for a
            write-through or bypassing put; otherwise in the store's custody, in the cache, and
            durable once written back (a write-back that fails keeps it in the cache and is
            reported by :meth:`flush` and :meth:`close`, naming the key).

        Raises:
            InvalidKeyError: a bad key.
            BufferMismatchError: not a tensor, or one without plain memory (nested, quantized,
                sparse, meta).
            StoreClosedError: the store is closed.
            ReadOnlyStoreError: the store is read-only.
            ConfigError: ``write_through`` is not a bool or None.
            BackendIOError: (through the future) no tier can take a write-through or bypassing
                put; or, for a write-back put, the write-back of objects put before failed and
                they are still only in the cache (the store could not make this one durable
                either): the error names them and carries the failure's errno (ENOSPC for a full
                tier); the put changes nothing.
            CapacityError: (through the future) no tier has room for a write-through or
                bypassing put (every tier at its configured capacity); or the cache room a
                write-back put needs is held by objects whose write-back failed (the message names
                them; a write-through put the cache has no room for goes straight to a tier).
        """
        self._check_open()
        self._check_writable(f"put({key!r})")
        check_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise BufferMismatchError(f"put({key!r}) needs a torch.Tensor, got {type(tensor).__name__}")
        _check_dense(f"put({key!r})", tensor)
        if write_through is None:
            write_through = self.policy == "write-through"
        elif not isinstance(write_through, bool):
            raise ConfigError(f"put({key!r}): write_through is True, False or None, not {write_through!r}")
        cached = cache and not scratch
        caller = self._device.caller_of(tensor)
        return self._serial.submit(
            key, self._put, key, tensor.detach(), cached, scratch, write_through, caller
        )

    def get(
        self,
        key: str,
        out: torch.Tensor | None = None,
        *,
        cache: bool = True,
        device: torch.device | str | None = None,
    ) -> Future[torch.Tensor]:
        """Read ``key``, after the operations already issued on it.

        A CUDA destination (``out``, or a new tensor on ``device``) is written on a copy stream
        (:mod:`tierstore.device`) after the work queued on the calling thread's current stream when
        ``get`` is called (kernels still reading ``out``), through the store's pinned pieces; that
        stream waits for the copies before the work queued once the future has resolved.

        Args:
            key: a committed key, or one whose put is pending.
            out: where to read to: the object's shape and dtype, any device and strides; None for
                a new tensor on ``device``.
            device: where the new tensor goes when there is no ``out``: ``"cpu"`` (None, the
                default) or a CUDA device (``"cuda"``: the current one).
            cache: False to read a miss straight into the destination without caching it (a copy
                already in the cache is still used). A miss the cache has no room for (objects
                whose write-back failed hold it) is read that way too.

        Returns:
            A future of ``out``, or of the new tensor.

        Raises:
            KeyNotFoundError: no such key.
            BufferMismatchError: ``out`` does not match the object, or its elements share memory.
            ConfigError: ``device`` is not the CPU or a CUDA device, or comes with ``out``.
            ChecksumError: (through the future) the bytes read are not the bytes written; it
                names the key, path and backend object.
            BackendIOError: (through the future) no copy can be read.
        """
        self._check_open()
        self._check_known(key)
        if out is not None:
            if not isinstance(out, torch.Tensor):
                raise BufferMismatchError(f"get({key!r}): out must be a torch.Tensor")
            _check_dense(f"get({key!r}): out", out)
            _check_distinct_elements(f"get({key!r}): out", out)
            record = self._catalog.get(key)
            if record is not None and not self._serial.pending(key):  # else a queued put decides
                _check_out(key, record, out)
        caller = self._caller(key, out, device)
        return self._serial.submit(key, self._get, key, out, cache, caller)

    def prefetch(self, keys: Iterable[str]) -> Future[None]:
        """Load ``keys`` into the DRAM cache in the background.

        Args:
            keys: committed keys (an iterable; a single ``str`` is refused).

        Returns:
            A future that resolves once every object is cached.

        Raises:
            InvalidKeyError: a bad key, before anything is loaded.
            KeyNotFoundError: an unknown key, before anything is loaded.
            CapacityError: (through the future) an object larger than the whole cache budget, or
                one the cache has no room for while objects whose write-back failed hold it.
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
        """Remove ``key`` after the operations already issued on it, freeing its cache and tier
        space.

        Raises:
            KeyNotFoundError: no such key.
            ReadOnlyStoreError: the store is read-only.
        """
        self._check_open()
        self._check_writable(f"delete({key!r})")
        self._check_known(key)
        self._serial.submit(key, self._delete, key).result()

    def flush(self) -> None:
        """Write every dirty cached object to its tier and wait.

        Objects smaller than ``pack_below`` go in packs: one backend object of up to
        :data:`~tierstore.cache.PACK_BYTES` per batch, each object's record pointing into it.
        Covers puts whose futures have resolved; wait for pending puts first to include them. A
        read-only store has nothing to write: it returns at once.

        Raises:
            BackendIOError: a write-back failed (a full tier, an I/O error): the message names
                every object still only in the cache, where they stay until a flush writes them;
                it carries the failure's errno (ENOSPC for a tier at its configured capacity),
                and the failure is its ``__cause__``.
        """
        self._check_open()
        if self.read_only:
            return
        if self._cache is not None:
            self._cache.flush()

    def copy_to(self, destination: TierStore, keys: Iterable[str] | None = None, *, prefix: str = "") -> None:
        """Put ``keys`` (default: every committed key) into ``destination`` under the same keys
        (after ``prefix``), each committed there as an object of its own (journaled, in a
        persistent destination).

        Where a version sits on a tier and ``destination``'s first tier has the paths its extents
        use, on backends that can copy without this process (:meth:`Backend.copy_from`: a hard
        link on one file system, a kernel copy across two), no byte passes through memory and
        the checksums are carried over: an optimizer's state checkpointed into a store in the
        checkpoint's folder, and back at resume, in the time of a few metadata operations.
        Otherwise the object is read and put, one at a time. Blocks until every key is
        committed. A read-only store can be the source, never the destination.

        Args:
            destination: another open store.
            keys: the keys to copy; None for every committed key.
            prefix: put before each key in ``destination`` (``"step-100/"``), so that copies from
                several sources, or several copies of one key, stay apart there.

        Raises:
            ConfigError: ``destination`` is not a TierStore, or is this store.
            ReadOnlyStoreError: ``destination`` is read-only (refused before anything is copied).
            InvalidKeyError: a bad key (all keys are checked before the first is copied).
            KeyNotFoundError: an unknown key (checked likewise, before anything is copied).
            BackendIOError: an I/O failure (the keys copied so far stay committed).
        """
        self._check_open()
        if not isinstance(destination, TierStore):
            raise ConfigError(f"copy_to: destination must be a TierStore, not {type(destination).__name__}")
        if destination is self:
            raise ConfigError("copy_to: destination is this store (its keys would replace themselves)")
        destination._check_open()
        destination._check_writable("copy_to: the destination")
        if isinstance(keys, str):  # a str is one key per character
            raise InvalidKeyError(f"copy_to takes an iterable of keys, not {keys!r}: use [key]")
        chosen = self.keys() if keys is None else list(keys)
        if not isinstance(prefix, str):
            raise InvalidKeyError(f"copy_to: prefix must be a str, not {type(prefix).__name__}")
        for key in chosen:  # every key checked before the first is copied
            self._check_known(key)
            check_key(prefix + key)
        for key in chosen:
            self._serial.submit(key, self._copy_to, key, destination, prefix + key).result()

    def _copy_to(self, key: str, destination: TierStore, copy_key: str) -> None:
        dirty = self._cache is not None and self._cache.state(key)[1]
        record = self._catalog.record(key)  # a copy clean above has its placement set already
        persisted = None if dirty else record.persisted
        placement = None if persisted is None else destination._chain.copy_in(persisted)
        if placement is None:
            destination.put(copy_key, self._get(key, None, False, None), cache=False).result()
            return
        copy = Record(record.shape, record.dtype, record.nbytes, persisted=placement)
        destination._serial.submit(copy_key, destination._commit_copy, copy_key, copy).result()

    def _commit_copy(self, key: str, record: Record) -> None:
        self._catalog.commit(key, record)
        if self._cache is not None:
            self._cache.drop(key)

    def contains(self, key: str) -> bool:
        """Whether ``key`` is committed (its put's future has resolved)."""
        self._check_open()
        return key in self._catalog

    def keys(self) -> list[str]:
        """Committed keys, in insertion order."""
        self._check_open()
        return self._catalog.keys()

    def info(self, key: str) -> ObjectInfo:
        """What the store knows about ``key`` now (a snapshot).

        Raises:
            KeyNotFoundError: ``key`` has no committed object.
        """
        self._check_open()
        cached, dirty = (False, False) if self._cache is None else self._cache.state(key)
        record = self._catalog.record(key)
        persisted = record.persisted
        return ObjectInfo(
            key=key,
            shape=record.shape,
            dtype=record.dtype,
            nbytes=record.nbytes,
            tier=persisted.tier.name if persisted else None,
            name=persisted.name if persisted else None,
            extents=persisted.describe() if persisted else [],
            cached=cached,
            dirty=dirty,
        )

    def stats(self) -> dict[str, Any]:
        """Counters and byte figures, still readable after :meth:`close` for a final report.

        Returns:
            ``hits``, ``misses``, ``evictions``, ``writebacks``, ``cache_budget_bytes``,
            ``cache_bytes``, ``peak_cache_bytes`` (zeros for a store without a cache),
            ``memory`` (the ledger's budget and each owner's reservation) and ``tiers`` (per
            tier and path: bytes and requests moved, bandwidth estimates).
        """
        return {
            **(_NO_CACHE_STATS if self._cache is None else self._cache.stats()),
            "memory": {"budget_bytes": self.memory.capacity, "reserved_bytes": self.memory.held()},
            "tiers": self._chain.stats(),
        }

    def bandwidths(self) -> dict[str, list[PathSpeed]]:
        """Each tier's paths with their current bandwidth estimates (measured online, else as
        configured or probed), for workloads that plan their own I/O; paths without any estimate
        yet are left out."""
        return self._chain.bandwidths()

    def log_stats(self, level: int = logging.INFO) -> dict[str, Any]:
        """Send :meth:`stats` to the ``tierstore`` logger (one JSON line) and return it."""
        stats = self.stats()
        _log.log(level, "tierstore stats %s", json.dumps(stats, default=str))
        return stats

    def close(self) -> None:
        """Finish issued operations and release all memory. A scratch store deletes its tier
        objects; a persistent one writes back dirty objects and compacts its manifest instead; a
        read-only one only closes its tiers (it deletes and writes nothing).

        Everything is released even where the write-back fails: the threads, the memory budget,
        the tiers' files and the manifest's lock (the store can be opened again at once).

        Raises:
            BackendIOError: a persistent store could not write back every dirty object (a full
                tier); the message names each object that was only in memory and is lost, and
                what the next open finds under its key (nothing, or the version before). It
                carries the errno of the failure (ENOSPC for a tier at its capacity), which is its
                ``__cause__``.
        """
        if self._closed:
            return
        lost: BackendIOError | None = None
        with contextlib.ExitStack() as release:  # each step runs even where one before it failed
            release.callback(self._chain.close)
            release.callback(self._catalog.close)
            if self._cache is not None:
                release.callback(self._cache.close)
            release.callback(self._device.close)
            release.callback(self._serial.shutdown)
            release.callback(setattr, self, "_closed", True)
            if self._catalog.manifest is not None:
                self._serial.drain()
                try:
                    self.flush()
                except BackendIOError:
                    lost = self._lost_at_close()
        if lost is not None:
            raise lost

    def _lost_at_close(self) -> BackendIOError:
        """The error of a close whose flush failed: every object only in memory, and what the next
        open finds under its key."""

        def fate(key: str) -> str:
            record = self._catalog.get(key)
            kept = record is not None and record.journaled is not None
            return f"{key!r} ({'its previous version' if kept else 'no such key'} at the next open)"

        assert self._cache is not None
        error = self._cache.write_back_error("close: objects lost", describe=fate)
        assert error is not None
        return error

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
        return len(self._catalog)

    # -- operations (run on the serializer, one key at a time) -----------------------------------
    def _put(
        self,
        key: str,
        tensor: torch.Tensor,
        cached: bool,
        scratch: bool,
        write_through: bool,
        caller: CallerStream | None,
    ) -> None:
        record = Record(
            tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size(), scratch=scratch
        )
        cache = self._cache if cached else None
        entry = None
        if cache is not None and cache.fits(record.nbytes):
            if not write_through:  # a copy the store may be unable to write back, like those before it
                cache.check_written_back(f"put({key!r})")
            entry = cache.new_entry(key, record, dirty=True)
            if entry is None and not write_through:
                raise cache.no_room(key, record.nbytes)
        if entry is None:  # straight to a tier (also a write-through put the cache has no room for)
            record.persisted = self._write_straight(tensor, caller)
            self._catalog.commit(key, record)
            if self._cache is not None:  # a copy of the version just replaced
                self._cache.drop(key)
            return
        assert cache is not None
        try:
            if caller is None:
                entry.typed().copy_(tensor)
            else:
                self._device.download(tensor, entry.memoryview(), caller)
            if write_through:
                record.persisted = self._chain.write(entry.memoryview(), Priority.CRITICAL).result()
                entry.dirty = False
            self._catalog.commit(key, record)
        except BaseException:
            cache.abandon(entry)
            raise
        cache.attach(entry)

    def _get(
        self, key: str, out: torch.Tensor | None, cached: bool, caller: CallerStream | None
    ) -> torch.Tensor:
        cache = self._cache
        # The cache first: a copy evicted after this lookup was clean, so the record read next
        # already names its placement on a tier.
        entry = None if cache is None else cache.pin(key)
        try:
            record = self._catalog.record(key)
            if out is not None:
                _check_out(key, record, out)
            if (
                entry is None
                and cached
                and self.cache_reads
                and cache is not None
                and cache.fits(record.nbytes)
            ):
                entry = cache.load(key, record, lambda into: self._read(key, record, into), pinned=True)
            if entry is None:  # not cached, not to be cached, or no cache room: straight to the destination
                return self._read_direct(key, record, out, caller)
            if caller is not None:
                on_device = self._device.empty(record.shape, record.dtype, caller) if out is None else out
                self._device.upload(entry.memoryview(), on_device, caller)
                return on_device
            destination = torch.empty(record.shape, dtype=record.dtype) if out is None else out
            destination.copy_(entry.typed())
            return destination
        finally:
            if entry is not None:
                assert cache is not None
                cache.unpin(entry)

    def _prefetch(self, key: str) -> None:
        cache = self._cache
        if cache is not None and cache.touch(key):
            return
        record = self._catalog.record(key)
        if cache is None or not cache.fits(record.nbytes):
            budget = 0 if cache is None else cache.capacity
            raise CapacityError(
                f"prefetch({key!r}): {record.nbytes} bytes exceed the cache budget of {budget} bytes"
            )
        if cache.load(key, record, lambda into: self._read(key, record, into), pinned=False) is None:
            raise cache.no_room(key, record.nbytes)

    def _delete(self, key: str) -> None:
        self._catalog.remove(key)
        if self._cache is not None:
            self._cache.drop(key)

    def _read(
        self, key: str, record: Record, out: memoryview, priority: Priority = Priority.CRITICAL
    ) -> None:
        assert record.persisted is not None
        if record.damaged is not None:
            raise ManifestError(errno.EIO, f"key {key!r}: the manifest's entry is damaged: {record.damaged}")
        self._chain.read(key, record.persisted, out, priority)

    def _read_direct(
        self, key: str, record: Record, out: torch.Tensor | None, caller: CallerStream | None
    ) -> torch.Tensor:
        if caller is not None:  # through host memory reserved for the read
            on_device = self._device.empty(record.shape, record.dtype, caller) if out is None else out
            with self._host_memory(record.nbytes) as host:
                self._read(key, record, host)
                self._device.upload(host, on_device, caller)
            return on_device
        direct = (
            out is not None
            and out.device.type == "cpu"
            and out.is_contiguous()
            and not (out.is_conj() or out.is_neg())  # a lazy view's memory is not its values
        )
        destination = out if direct else torch.empty(record.shape, dtype=record.dtype)
        assert destination is not None
        self._read(key, record, _bytes_of(destination))
        if out is not None and not direct:
            out.copy_(destination)
            return out
        return destination

    # -- device copies ----------------------------------------------------------------------------
    def _caller(
        self, key: str, out: torch.Tensor | None, device: torch.device | str | None
    ) -> CallerStream | None:
        """The caller's stream at a ``get`` that fills device memory (``out``, or a new tensor on
        ``device``), marked now, on the caller's thread; None for host memory."""
        if device is None:
            return None if out is None else self._device.caller_of(out)
        if out is not None:
            raise ConfigError(f"get({key!r}): pass out or device, not both (out is where it goes)")
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError):
            target = None
        if target is None or target.type not in ("cpu", "cuda"):
            raise ConfigError(f"get({key!r}): device must be 'cpu' or a CUDA device, not {device!r}")
        return None if target.type == "cpu" else self._device.caller(target)

    def _device_staging(self, nbytes: int, runtime: DeviceRuntime) -> StagingArea:
        """The pinned pieces that device copies are staged through, reserved from :attr:`memory`
        at the first device copy (see :class:`~tierstore.device.DeviceCopies`)."""
        return StagingArea(self.memory, "device copies", nbytes, pin=True, runtime=runtime)

    def _write_straight(self, tensor: torch.Tensor, caller: CallerStream | None) -> Placement:
        """Write ``tensor`` to a tier past the cache: from its own memory, or a device tensor's
        bytes from host memory reserved for the write."""
        if caller is None:
            return self._chain.write(_bytes_of(_materialized(tensor)), Priority.CRITICAL).result()
        with self._host_memory(tensor.numel() * tensor.element_size()) as host:
            self._device.download(tensor, host, caller)
            return self._chain.write(host, Priority.CRITICAL).result()

    @contextlib.contextmanager
    def _host_memory(self, nbytes: int) -> Iterator[memoryview]:
        """Host memory for a device tensor's bytes on their way to or from a tier past the cache,
        reserved from :attr:`memory` (as ``device copies``) while it is used: never more than the
        store's memory budget, however large the object."""
        reservation = self.memory.reserve("device copies", nbytes)
        try:
            yield AlignedBuffer(nbytes).memoryview(nbytes)
        finally:
            self.memory.release(reservation)

    # -- checks -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the TierStore is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            manifest = self._catalog.manifest
            assert manifest is not None
            raise ReadOnlyStoreError(f"{what}: the store of manifest {manifest.directory} is open read-only")

    def _check_known(self, key: str) -> None:
        check_key(key)
        if key not in self._catalog and not self._serial.pending(key):
            raise self._catalog.missing(key)


_NO_CACHE_STATS = {
    "hits": 0,
    "misses": 0,
    "evictions": 0,
    "writebacks": 0,
    "cache_budget_bytes": 0,
    "cache_bytes": 0,
    "peak_cache_bytes": 0,
}
"""A store without a cache reports the cache's counters as zeros, so the statistics keep one shape."""


def _check_tiers(tiers: object) -> None:
    """Refuse a ``tiers`` argument that is not a non-empty list of tiers or backends (the store's
    other arguments are options, checked by :class:`~tierstore.config.StoreOptions`)."""
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


def _check_read_only(read_only: object, manifest: object) -> None:
    """Refuse a ``read_only`` that is not a bool, or that asks for a read-only scratch store
    (beside :class:`~tierstore.config.StoreOptions`: how a store is opened, not an option of the
    store a config document holds)."""
    if not isinstance(read_only, bool):
        raise ConfigError(f"read_only: must be True or False, not {read_only!r}")
    if read_only and manifest is None:
        raise ConfigError(
            "read_only: a read-only store opens a persistent store's manifest; pass manifest=DIR"
        )


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


def _check_distinct_elements(what: str, tensor: torch.Tensor) -> None:
    """Refuse a destination whose elements share memory (``expand``: a stride of 0 along a
    dimension of more than one element), which cannot hold distinct values; torch's ``copy_``
    refuses it too, but only once the read is done."""
    shared = [
        dim
        for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True))
        if size > 1 and stride == 0
    ]
    if shared:
        raise BufferMismatchError(
            f"{what}: its elements share memory along dimension {shared[0]} (stride 0, as expand() "
            "makes): it cannot hold distinct values; pass a tensor of its own memory"
        )


def _check_out(key: str, record: Record, out: torch.Tensor) -> None:
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
