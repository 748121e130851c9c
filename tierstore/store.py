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
  ``sampled`` = one read in 16, or ``off``); a mismatch raises [`ChecksumError`][] naming the key,
  the path and the backend object.
* The cache's buffers never exceed the byte budget: making room waits for write-back of dirty
  entries instead of growing.

Without ``manifest`` a store is scratch space: ``close`` deletes the objects it wrote. With a
``manifest`` directory (`tierstore.manifest`) it is persistent: each version that reaches a tier is
journaled (fsynced) before the previous one is deleted, reopening the same config finds every
committed object, a crash leaves each key at its old or its new version, and garbage from
interrupted writes is deleted at the next open. Objects still only in the write-back cache are not
durable until written back (``flush()``, eviction, ``close()``); ``policy="write-through"`` makes
every put durable when its future resolves.

A write-back that fails (a full tier: its capacity or ENOSPC; an I/O error) is never silent: the
object stays in the cache, readable, until a ``flush()`` writes it; meanwhile every ``flush()``,
every put that would leave another object only in the cache, and ``close()`` raise a
[`BackendIOError`][] with the failure's errno naming each such key. Reads never need cache room: a
miss the cache has no room for is read straight into the destination. ``close()`` releases
everything (the manifest's lock included) even where it cannot write back, and its error names the
objects lost.

With ``read_only=True`` a store reads a persistent store's manifest without locking it, even while a
writer (in this or another process) has it open: it sees the committed objects as of the open (later
writes are not seen), refuses every change with [`ReadOnlyStoreError`][], and neither collects
garbage, compacts nor deletes anything, at the open or at ``close``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ._closeable import Closeable, ClosedOnError
from ._futures import when_all
from ._serial import KeyedSerializer
from .backends import Backend
from .bandwidth import PathSpeed
from .config import ConfigSource, Policy, StoreOptions, Verify, default_config, load_config
from .device import DeviceRuntime
from .errors import (
    BackendIOError,
    BufferMismatchError,
    ConfigError,
    InvalidKeyError,
    ReadOnlyStoreError,
    StoreClosedError,
)
from .memory import MemoryLedger
from .namespaces import Namespaces, check_key
from .operations import ObjectInfo as ObjectInfo  # the type of info(), importable here
from .operations import (
    StoreOperations,
    check_dense,
    check_distinct_elements,
    check_out,
    check_read_only,
    check_tiers,
)
from .staging import StagingArea
from .tier import Tier

_log = logging.getLogger("tierstore")


class TierStore(Closeable):
    """A tiered tensor store (see the module docstring for the contract).

    Args:
        tiers: where objects live beyond DRAM, fastest first (a [`Tier`][], or a bare [`Backend`][]
            made a tier of one path); each object goes to the first with room. The store owns them
            and closes them in [`close`][].
        cache_budget: bytes of the DRAM write-back cache; 0 for none (callers that stage their
            own DRAM, the training workloads, lose nothing by it). Every size in bytes here is
            an int or text such as ``"256MiB"``, as in a configuration document.
        policy: ``"write-back"`` (a put is durable once written back) or ``"write-through"``
            (once its future resolves).
        cache_reads: whether a read that misses the cache fills it (False: reads go straight to
            the destination).
        workers: threads running operations; operations on one key always run in call order.
        manifest: a directory for the journal that makes the store persistent; None for scratch
            space, whose objects [`close`][] deletes.
        verify: checksum verification on reads: ``"always"``, ``"sampled"`` (one read in 16) or
            ``"off"``.
        memory_budget: bytes of host memory all the store's workloads may reserve together (the
            cache's budget included; see [`memory`][]); None counts without a limit.
        pack_below: objects smaller than this are written back together in pack objects.
        cache_resident: keep the pages of buffers the cache frees for its next objects (a cache
            refilled over and over, as a checkpoint's staging is, then copies into memory already
            mapped, several times faster than into fresh pages); the RSS stays at the cache's
            high-water mark, never above ``cache_budget``, until the store closes.
        read_only: open the persistent store at ``manifest`` for reading only (a DCP load reads
            every rank's store, some still open in their writers): no lock is taken, so a writer may
            have it open; the store sees the objects committed when it opened, never later writes;
            put, delete and being the destination of [`copy_to`][] raise [`ReadOnlyStoreError`][],
            [`flush`][] has nothing to write and returns at once, and neither the open nor
            [`close`][] collects garbage, compacts the manifest or deletes an object. Reads
            (``cache_reads`` included) work as usual. An object the writer deletes or replaces after
            the open is gone for this store too ([`MissingDataError`][] on reading it).

    Raises:
        ConfigError: an argument of the wrong type or out of range, named in the message;
            ``read_only`` without a ``manifest``.
        ManifestError, StoreLockedError: ``manifest`` is damaged, or open in another process (for
            writing); read-only: there is no persistent store at ``manifest`` (the directory is
            never created).

    A facade: the tier chain (`chain`: placement, failover, verified reads, garbage), the commit
    protocol (`catalog`) and, when ``cache_budget`` is above 0, the write-back cache layered over
    them (`cache`) each own one job; the store checks arguments, orders operations per key and
    routes each one to the operations that run on them (`operations`). A put or get that bypasses
    the cache goes straight to the chain and the catalog.
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
        check_tiers(tiers)
        check_read_only(read_only, manifest)
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
        cache_budget, workers = int(options["cache_budget"]), options["workers"]
        memory_budget = None if options["memory_budget"] is None else int(options["memory_budget"])
        pack_below = int(options["pack_below"])
        self.memory = MemoryLedger(memory_budget)
        """The DRAM ledger the store's workloads reserve their budgets from (see `memory`)."""
        self.namespaces = Namespaces()
        """The key prefixes the store's workloads have claimed (see `namespaces`)."""
        self.tiers = [
            tier if isinstance(tier, Tier) else Tier(f"tier{index}", tier) for index, tier in enumerate(tiers)
        ]
        self.verify = verify
        self.policy = policy
        self.cache_reads = cache_reads
        self.read_only = read_only
        """Opened read-only: every change raises [`ReadOnlyStoreError`][]."""
        self._closed = False
        self._operations = StoreOperations(
            self.tiers,
            memory=self.memory,
            manifest=manifest,
            read_only=read_only,
            verify=verify,
            cache_budget=cache_budget,
            cache_resident=options["cache_resident"],
            pack_below=pack_below,
        )
        self.pack_below = pack_below
        """Dirty objects smaller than this are written back in packs (one backend object each)."""
        self._serial = KeyedSerializer(workers, "tierstore")

    @classmethod
    def from_config(cls, config: ConfigSource | None = None, *, read_only: bool = False) -> TierStore:
        """A store opened from a config document (see the configuration reference).

        Args:
            config: a [`StoreConfig`][], a mapping, or the path of a ``.toml`` or ``.json`` file;
                None for the embedded default (one nvme tier under ``./tierstore-data``).
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
        with ClosedOnError(tiers):
            for index, tier in enumerate(settings.tiers):
                tiers.append(Tier.from_config(tier, where=f"tiers.{index}"))
            return cls(tiers, **settings.arguments(), read_only=read_only)

    @property
    def device_runtime(self) -> DeviceRuntime:
        """The device runtime the store's device copies and pinned memory go through (see
        `tierstore.device`): CUDA's, or a test's simulated device. A workload that copies between
        the store's memory and a device itself (an offloaded optimizer over GPU parameters) uses the
        same one."""
        return self._operations.device.runtime

    def staging(
        self,
        owner: str,
        budget: int | str,
        *,
        pin: bool = False,
        resident: bool = False,
        pool_bytes: int | str | None = None,
    ) -> StagingArea:
        """DRAM for a workload to stage tensors through (see [`StagingArea`][]).

        Args:
            owner: who holds the memory, as [`stats`][] reports it.
            budget: bytes reserved from [`memory`][] until the area is closed (an int, or text such
                as ``"64MiB"``).
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
            runtime=self._operations.device.runtime,
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
            key: the object's name (see `check_key` for the rules).
            tensor: any dtype, shape, strides or device; dense (strided) memory only. A CUDA tensor
                is read after the work queued on the calling thread's current stream when ``put`` is
                called, on a copy stream (`tierstore.device`), through the store's pinned pieces;
                work queued after the call may change it once the future resolves.
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
            durable once written back (a write-back that fails keeps it in the cache and is reported
            by [`flush`][] and [`close`][], naming the key).

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
        check_dense(f"put({key!r})", tensor)
        if write_through is None:
            write_through = self.policy == "write-through"
        elif not isinstance(write_through, bool):
            raise ConfigError(f"put({key!r}): write_through is True, False or None, not {write_through!r}")
        cached = cache and not scratch
        caller = self._operations.device.caller_of(tensor)
        return self._serial.submit(
            key, self._operations.put, key, tensor.detach(), cached, scratch, write_through, caller
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
        (`tierstore.device`) after the work queued on the calling thread's current stream when
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
            check_dense(f"get({key!r}): out", out)
            check_distinct_elements(f"get({key!r}): out", out)
            record = self._operations.catalog.get(key)
            if record is not None and not self._serial.pending(key):  # else a queued put decides
                check_out(key, record, out)
        caller = self._operations.caller(key, out, device)
        return self._serial.submit(key, self._operations.get, key, out, cache and self.cache_reads, caller)

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
        loads = [self._serial.submit(key, self._operations.prefetch, key) for key in keys]
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
        self._serial.submit(key, self._operations.delete, key).result()

    def flush(self) -> None:
        """Write every dirty cached object to its tier and wait.

        Objects smaller than ``pack_below`` go in packs: one backend object of up to `PACK_BYTES`
        per batch, each object's record pointing into it. Covers puts whose futures have resolved;
        wait for pending puts first to include them. A read-only store has nothing to write: it
        returns at once.

        Raises:
            BackendIOError: a write-back failed (a full tier, an I/O error): the message names
                every object still only in the cache, where they stay until a flush writes them;
                it carries the failure's errno (ENOSPC for a tier at its configured capacity),
                and the failure is its ``__cause__``.
        """
        self._check_open()
        if not self.read_only and self._operations.cache is not None:
            self._operations.cache.flush()

    def copy_to(self, destination: TierStore, keys: Iterable[str] | None = None, *, prefix: str = "") -> None:
        """Put ``keys`` (default: every committed key) into ``destination`` under the same keys
        (after ``prefix``), each committed there as an object of its own (journaled, in a
        persistent destination).

        Where a version sits on a tier and ``destination``'s first tier has the paths its extents
        use, on backends that can copy without this process ([`Backend.copy_from`][]: a hard link on
        one file system, a kernel copy across two), no byte passes through memory and the checksums
        are carried over: an optimizer's state checkpointed into a store in the checkpoint's folder,
        and back at resume, in the time of a few metadata operations. Otherwise the object is read
        and put, one at a time. Blocks until every key is committed. A read-only store can be the
        source, never the destination.

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
        copy = self._operations.copy_in(key, destination._operations)
        if copy is None:  # through memory
            destination.put(copy_key, self._operations.get(key, None, False, None), cache=False).result()
            return
        destination._serial.submit(copy_key, destination._operations.commit, copy_key, copy).result()

    def contains(self, key: str) -> bool:
        """Whether ``key`` is committed (its put's future has resolved)."""
        self._check_open()
        return key in self._operations.catalog

    def keys(self) -> list[str]:
        """Committed keys, in insertion order."""
        self._check_open()
        return self._operations.catalog.keys()

    def info(self, key: str) -> ObjectInfo:
        """What the store knows about ``key`` now (a snapshot).

        Raises:
            KeyNotFoundError: ``key`` has no committed object.
        """
        self._check_open()
        return self._operations.info(key)

    def stats(self) -> dict[str, Any]:
        """Counters and byte figures, still readable after [`close`][] for a final report.

        Returns:
            ``hits``, ``misses``, ``evictions``, ``writebacks``, ``cache_budget_bytes``,
            ``cache_bytes``, ``peak_cache_bytes`` (zeros for a store without a cache),
            ``memory`` (the ledger's budget and each owner's reservation) and ``tiers`` (per
            tier and path: bytes and requests moved, bandwidth estimates).
        """
        return self._operations.stats()

    def bandwidths(self) -> dict[str, list[PathSpeed]]:
        """Each tier's paths with their current bandwidth estimates (measured online, else as
        configured or probed), for workloads that plan their own I/O; paths without any estimate
        yet are left out."""
        return self._operations.chain.bandwidths()

    def log_stats(self, level: int = logging.INFO) -> dict[str, Any]:
        """Send [`stats`][] to the ``tierstore`` logger (one JSON line) and return it."""
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
            release.callback(self._operations.close)
            release.callback(self._serial.shutdown)
            release.callback(setattr, self, "_closed", True)
            if self._operations.catalog.manifest is not None:
                self._serial.drain()
                try:
                    self.flush()
                except BackendIOError:
                    lost = self._operations.lost_at_close()
        if lost is not None:
            raise lost

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
        return len(self._operations.catalog)

    # -- checks -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the TierStore is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            manifest = self._operations.catalog.manifest
            assert manifest is not None
            raise ReadOnlyStoreError(f"{what}: the store of manifest {manifest.directory} is open read-only")

    def _check_known(self, key: str) -> None:
        check_key(key)
        if key not in self._operations.catalog and not self._serial.pending(key):
            raise self._operations.catalog.missing(key)
