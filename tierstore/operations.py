"""The store's operations on one key, each run on the store's serializer after the operations
issued on that key before it (put, get, prefetch, delete and the commit of a copy), the parts they
run on, and the checks of what a store is opened with and of the tensors it takes.

[`TierStore`][] checks the arguments, orders the operations per key and routes each one to its
`StoreOperations`, which opens, reports on and closes the parts: the tier chain (`chain`: where the
bytes go, verified reads), the commit protocol (`catalog`), for a store with a cache the write-back
cache (`cache`), and the device copies (`device`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .backends import Backend
from .buffers import AlignedBuffer
from .cache import WriteBackCache
from .catalog import Catalog, Record
from .chain import TierChain
from .config import Verify
from .device import CallerStream, DeviceCopies, DeviceRuntime
from .errors import BackendIOError, BufferMismatchError, CapacityError, ConfigError, ManifestError
from .limits import Priority
from .manifest import Manifest
from .memory import MemoryLedger
from .staging import StagingArea
from .tier import Placement, Tier


@dataclass(frozen=True)
class ObjectInfo:
    """What the store knows about one object (a snapshot; see [`TierStore.info`][])."""

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


class StoreOperations:
    """The parts of one store, opened together, and the operations that run on them (see the
    module docstring); the store owns it, checks the arguments of its calls and orders them.

    Args:
        tiers: the store's tiers, fastest first (owned by the store).
        memory: the store's ledger: the cache's budget, the pinned pieces device copies are staged
            through and the host memory a device tensor's bytes pass through on their way past
            the cache are reserved from it.
        manifest: the directory of a persistent store's journal; None for scratch space.
        read_only: open ``manifest`` for reading only.
        verify: checksum verification on reads: ``"always"``, ``"sampled"`` or ``"off"``.
        cache_budget: bytes of the write-back cache; 0 for none.
        cache_resident: keep the pages of buffers the cache frees for its next objects.
        pack_below: dirty objects smaller than this are written back in packs.

    Raises:
        ManifestError, StoreLockedError: ``manifest`` is damaged, or open in another process.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        memory: MemoryLedger,
        manifest: str | os.PathLike[str] | None,
        read_only: bool,
        verify: Verify,
        cache_budget: int,
        cache_resident: bool,
        pack_below: int,
    ) -> None:
        self.memory = memory
        opened = None if manifest is None else Manifest(manifest, read_only=read_only)
        try:
            # A persistent store's token is journaled first, so an interrupted write's object is
            # recognised as garbage; a scratch store's only keeps concurrent stores apart.
            token = secrets.token_hex(4) if opened is None else opened.token
            self.chain = TierChain(tiers, token=token, verify=verify)
            """Where every version's bytes go past the cache (`chain`)."""
            if opened is None:  # a crash must not leave a scratch store's objects behind
                self.chain.claim_scratch()
            self.catalog = Catalog(self.chain, opened)
            """The current version of each key, committed through the manifest (`catalog`)."""
        except BaseException:
            if opened is not None:
                opened.close()
            raise
        self.cache: WriteBackCache | None = None
        """The write-back cache (`cache`); None for a store without one."""
        if cache_budget == 0:
            memory.reserve("cache", 0)  # the ledger still lists the cache's share: none
        else:
            self.cache = WriteBackCache(
                StagingArea(memory, "cache", cache_budget, resident=cache_resident),
                write=self.chain.write,
                write_pack=self.chain.write_pack,
                on_written=self.catalog.written,
                pack_below=pack_below,
            )
        self.device = DeviceCopies(staging=self._device_staging)
        """Copies to and from devices (`device`); nothing of it is made before the first."""

    def put(
        self,
        key: str,
        tensor: torch.Tensor,
        cached: bool,
        scratch: bool,
        write_through: bool,
        caller: CallerStream | None,
    ) -> None:
        """Commit ``tensor`` as ``key``'s new version: into the cache when ``cached`` and it has
        room (written to a tier at once if ``write_through``), else straight to a tier; a device
        tensor's bytes are copied on ``caller``'s stream."""
        record = Record(
            tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size(), scratch=scratch
        )
        cache = self.cache if cached else None
        entry = None
        if cache is not None and cache.fits(record.nbytes):
            if not write_through:  # a copy the store may be unable to write back, like those before it
                cache.check_written_back(f"put({key!r})")
            entry = cache.new_entry(key, record, dirty=True)
            if entry is None and not write_through:
                raise cache.no_room(key, record.nbytes)
        if entry is None:  # straight to a tier (also a write-through put the cache has no room for)
            record.persisted = self._write_straight(tensor, caller)
            self.commit(key, record)
            return
        assert cache is not None
        try:
            if caller is None:
                entry.typed().copy_(tensor)
            else:
                self.device.download(tensor, entry.memoryview(), caller)
            if write_through:
                record.persisted = self.chain.write(entry.memoryview(), Priority.CRITICAL).result()
                entry.dirty = False
            self.catalog.commit(key, record)
        except BaseException:
            cache.abandon(entry)
            raise
        cache.attach(entry)

    def get(
        self, key: str, out: torch.Tensor | None, cached: bool, caller: CallerStream | None
    ) -> torch.Tensor:
        """``key``'s current version in ``out`` (or a new tensor, on ``caller``'s device for a
        device read), from the cache, else from a tier (filling the cache when ``cached`` and it
        has room)."""
        cache = self.cache
        # The cache first: a copy evicted after this lookup was clean, so the record read next
        # already names its placement on a tier.
        entry = None if cache is None else cache.pin(key)
        try:
            record = self.catalog.record(key)
            if out is not None:
                check_out(key, record, out)
            if entry is None and cached and cache is not None and cache.fits(record.nbytes):
                entry = cache.load(key, record, lambda into: self._read(key, record, into), pinned=True)
            if entry is None:  # not cached, not to be cached, or no cache room: straight to the destination
                return self._read_direct(key, record, out, caller)
            if caller is not None:
                on_device = self.device.empty(record.shape, record.dtype, caller) if out is None else out
                self.device.upload(entry.memoryview(), on_device, caller)
                return on_device
            destination = torch.empty(record.shape, dtype=record.dtype) if out is None else out
            destination.copy_(entry.typed())
            return destination
        finally:
            if entry is not None:
                assert cache is not None
                cache.unpin(entry)

    def prefetch(self, key: str) -> None:
        """Load ``key``'s current version into the cache ([`CapacityError`][] where it cannot hold
        it)."""
        cache = self.cache
        if cache is not None and cache.touch(key):
            return
        record = self.catalog.record(key)
        if cache is None or not cache.fits(record.nbytes):
            budget = 0 if cache is None else cache.capacity
            raise CapacityError(
                f"prefetch({key!r}): {record.nbytes} bytes exceed the cache budget of {budget} bytes"
            )
        if cache.load(key, record, lambda into: self._read(key, record, into), pinned=False) is None:
            raise cache.no_room(key, record.nbytes)

    def delete(self, key: str) -> None:
        """Remove ``key`` and any cached copy of it."""
        self.catalog.remove(key)
        if self.cache is not None:
            self.cache.drop(key)

    def copy_in(self, key: str, destination: StoreOperations) -> Record | None:
        """A record for ``key``'s current version copied onto ``destination``'s first tier without
        its bytes passing through this process (`copy_in`), to be committed there with `commit`;
        None where that cannot be done (the version is only in the cache, or the backends cannot
        copy that way), copying nothing."""
        dirty = self.cache is not None and self.cache.state(key)[1]
        record = self.catalog.record(key)  # a copy clean above has its placement set already
        persisted = None if dirty else record.persisted
        placement = None if persisted is None else destination.chain.copy_in(persisted)
        if placement is None:
            return None
        return Record(record.shape, record.dtype, record.nbytes, persisted=placement)

    def commit(self, key: str, record: Record) -> None:
        """Commit a version already on a tier as ``key``'s, dropping any cached copy of the
        version it replaces."""
        self.catalog.commit(key, record)
        if self.cache is not None:
            self.cache.drop(key)

    def caller(
        self, key: str, out: torch.Tensor | None, device: torch.device | str | None
    ) -> CallerStream | None:
        """The caller's stream at a ``get`` that fills device memory (``out``, or a new tensor on
        ``device``), marked now, on the caller's thread; None for host memory."""
        if device is None:
            return None if out is None else self.device.caller_of(out)
        if out is not None:
            raise ConfigError(f"get({key!r}): pass out or device, not both (out is where it goes)")
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError):
            target = None
        if target is None or target.type not in ("cpu", "cuda"):
            raise ConfigError(f"get({key!r}): device must be 'cpu' or a CUDA device, not {device!r}")
        return None if target.type == "cpu" else self.device.caller(target)

    def info(self, key: str) -> ObjectInfo:
        """What the store knows about ``key`` now ([`KeyNotFoundError`][] if nothing)."""
        cached, dirty = (False, False) if self.cache is None else self.cache.state(key)
        record = self.catalog.record(key)
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
        """The store's counters and byte figures (see [`TierStore.stats`][])."""
        return {
            **(_NO_CACHE_STATS if self.cache is None else self.cache.stats()),
            "memory": {"budget_bytes": self.memory.capacity, "reserved_bytes": self.memory.held()},
            "tiers": self.chain.stats(),
        }

    def close(self) -> None:
        """Close the parts, each even where one before it failed: the tiers' objects of a scratch
        store deleted, a persistent store's manifest compacted and its lock released."""
        with contextlib.ExitStack() as release:
            release.callback(self.chain.close)
            release.callback(self.catalog.close)
            if self.cache is not None:
                release.callback(self.cache.close)
            release.callback(self.device.close)

    def lost_at_close(self) -> BackendIOError:
        """The error of a close whose flush failed: every object only in memory, and what the next
        open finds under its key."""

        def fate(key: str) -> str:
            record = self.catalog.get(key)
            kept = record is not None and record.journaled is not None
            return f"{key!r} ({'its previous version' if kept else 'no such key'} at the next open)"

        assert self.cache is not None
        error = self.cache.write_back_error("close: objects lost", describe=fate)
        assert error is not None
        return error

    def _device_staging(self, nbytes: int, runtime: DeviceRuntime) -> StagingArea:
        """The pinned pieces that device copies are staged through, reserved from the ledger at the
        first device copy (see [`DeviceCopies`][])."""
        return StagingArea(self.memory, "device copies", nbytes, pin=True, runtime=runtime)

    def _read(self, key: str, record: Record, out: memoryview) -> None:
        assert record.persisted is not None
        if record.damaged is not None:
            raise ManifestError(errno.EIO, f"key {key!r}: the manifest's entry is damaged: {record.damaged}")
        self.chain.read(key, record.persisted, out, Priority.CRITICAL)

    def _read_direct(
        self, key: str, record: Record, out: torch.Tensor | None, caller: CallerStream | None
    ) -> torch.Tensor:
        if caller is not None:  # through host memory reserved for the read
            on_device = self.device.empty(record.shape, record.dtype, caller) if out is None else out
            with self._host_memory(record.nbytes) as host:
                self._read(key, record, host)
                self.device.upload(host, on_device, caller)
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

    def _write_straight(self, tensor: torch.Tensor, caller: CallerStream | None) -> Placement:
        """Write ``tensor`` to a tier past the cache: from its own memory, or a device tensor's
        bytes from host memory reserved for the write."""
        if caller is None:
            return self.chain.write(_bytes_of(_materialized(tensor)), Priority.CRITICAL).result()
        with self._host_memory(tensor.numel() * tensor.element_size()) as host:
            self.device.download(tensor, host, caller)
            return self.chain.write(host, Priority.CRITICAL).result()

    @contextlib.contextmanager
    def _host_memory(self, nbytes: int) -> Iterator[memoryview]:
        """Host memory for a device tensor's bytes on their way to or from a tier past the cache,
        reserved from the store's ledger (as ``device copies``) while it is used: never more than
        the store's memory budget, however large the object."""
        reservation = self.memory.reserve("device copies", nbytes)
        try:
            yield AlignedBuffer(nbytes).memoryview(nbytes)
        finally:
            self.memory.release(reservation)


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


def check_dense(what: str, tensor: torch.Tensor) -> None:
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


def check_distinct_elements(what: str, tensor: torch.Tensor) -> None:
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


def check_out(key: str, record: Record, out: torch.Tensor) -> None:
    """Refuse a ``get``'s ``out`` whose dtype or shape is not the object's."""
    if out.dtype != record.dtype or tuple(out.shape) != record.shape:
        raise BufferMismatchError(
            f"get({key!r}): out is {out.dtype} {tuple(out.shape)} but the object is "
            f"{record.dtype} {record.shape}"
        )


def check_tiers(tiers: object) -> None:
    """Refuse a ``tiers`` argument that is not a non-empty list of tiers or backends (the store's
    other arguments are options, checked by `StoreOptions`)."""
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


def check_read_only(read_only: object, manifest: object) -> None:
    """Refuse a ``read_only`` that is not a bool, or that asks for a read-only scratch store (beside
    `StoreOptions`: how a store is opened, not an option of the store a config document holds)."""
    if not isinstance(read_only, bool):
        raise ConfigError(f"read_only: must be True or False, not {read_only!r}")
    if read_only and manifest is None:
        raise ConfigError(
            "read_only: a read-only store opens a persistent store's manifest; pass manifest=DIR"
        )


def _materialized(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor holding ``tensor``'s values: conjugate and negative views keep
    their memory unchanged behind a flag, so their bytes are not their values until resolved."""
    return tensor.cpu().resolve_conj().resolve_neg().contiguous()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data
