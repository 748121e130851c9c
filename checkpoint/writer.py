"""The DCP storage writer: ``dcp.save`` and ``dcp.async_save`` to the fast tier, then the drain."""

from __future__ import annotations

import copy
import math
import threading
import uuid
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ..config import ConfigSource, load_config
from ..errors import BufferMismatchError, ConfigError, InvalidKeyError
from .drain import Drainer
from .format import SCHEME, checkpoint_name, is_checkpoint_id
from .save_items import WAIT_SECONDS, SaveItems, object_bytes
from .stored import StoredTensor
from .tiers import CheckpointTier, TierSet, open_tiers

FAST_TIER_KEEP = 2
"""Checkpoints the fast tier keeps by default when there is a tier to drain to."""


class TieredStorageWriter(TierSet, StorageWriter, AsyncStager):
    """Writes DCP checkpoints to the first tier of a tierstore config and drains them to the others
    (see `tierstore.checkpoint`).

    Every rank writes its items to the first tier (striped over its paths), into a persistent
    store of its own that the writer holds open while it lives, and ``dcp.save`` returns once the
    checkpoint is committed there; the coordinating rank then copies it to each following tier in
    the background, and it is durable once the last tier holds it. A checkpoint leaves a tier
    before the last only once the last tier holds it; its data leaves a rank's store when that
    rank's writer next saves or closes.

    Opening the writer collects what interrupted saves, drains and deletions of processes that died
    left on the tiers; where every earlier writer closed, it reads no checkpoint, however many the
    tiers hold. Like DCP's own writers, one writer serves one save at a time: an ``async_save``
    waits in its staging until the previous save has written its data. Use the thread checkpointer
    of ``dcp.async_save`` (the default): the process one cannot carry this writer to its child
    process. [`close`][] (or the ``with`` block) waits for the drain.

    Args:
        config: a store config (dict, ``.toml``/``.json`` path or [`StoreConfig`][]) whose ``tiers``
            are where checkpoints go, fastest first. ``cache.budget`` is the DRAM a save stages
            through (``dcp.async_save`` copies the state into it instead of a second full copy),
            ``cache.pack_below`` the size under which items share pack objects, and
            ``memory_budget`` (if set) bounds that cache with whatever else the writer's store
            reserves. A tier's ``capacity`` bounds each store on it: one writer's data, or one
            drained checkpoint's. The other fields of a store config do not apply to checkpoints.
        keep: how many checkpoints each tier keeps, by tier name (a value of None: all). Tiers
            left out keep the default: the first tier the newest 2 when there are tiers after it,
            every other tier all.

    Raises:
        ConfigError: the config is invalid or a backend cannot be opened as configured,
            ``keep`` names a tier the config lacks or holds a bad count, or ``cache.budget`` is
            too small to stage through; the message names it.
    """

    _synchronize_after_execute = False  # staging is done when stage() returns

    def __init__(self, config: ConfigSource, *, keep: Mapping[str, int | None] | None = None) -> None:
        settings = load_config(config)
        super().__init__(open_tiers(settings, writable=True))
        try:
            self._keep = _retention(keep, self._tiers)
            budget = int(settings.cache.budget)
            self._key_bytes = object_bytes(budget)  # a budget too small is refused now, not mid-save
            for tier in self._tiers:
                tier.collect()
            fast = self._tiers[0]
            self._store_name = fast.new_store_name()
            self._store = fast.open_store(
                self._store_name,
                cache_budget=budget,
                cache_resident=True,
                pack_below=int(settings.cache.pack_below),
                memory_budget=None if settings.memory_budget is None else int(settings.memory_budget),
                workers=2 * fast.write_slots(),
            )
            """This writer's data store on the fast tier: every save's items, staged through its
            cache (the config's ``cache.budget``). Twice as many workers as the tier has write
            slots: a put holds its worker while it copies into the cache and then writes, so
            while half copy, the other half keep every slot writing."""
        except BaseException:
            super().close()
            raise
        self._name: str | None = None
        self._save_id = uuid.uuid4().hex
        self._staged: SaveItems | None = None
        self._in_flight: set[str] = set()
        """Key prefixes of saves not yet over: their keys stay, whatever the records say."""
        self._drainer: Drainer | None = None
        self._lock = threading.Condition()

    # -- DCP's StorageWriter ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | Any | None = None) -> None:
        """Start a save (DCP calls this).

        Args:
            checkpoint_id: ``tierstore://<name>`` or ``<name>``; None for the last one given.

        Raises:
            InvalidKeyError: ``checkpoint_id`` is not a valid checkpoint name.
            StoreClosedError: the writer is closed.
        """
        self._check_open()
        staged = self._claim_staged()
        if checkpoint_id:
            self._name = checkpoint_name(checkpoint_id)
        self._save_id = uuid.uuid4().hex if staged is None else staged.save_id
        with self._lock:  # the saves before this one are over: committed, or failed
            self._in_flight = {
                prefix for prefix in self._in_flight if staged is not None and prefix == staged.prefix
            }

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP tells each rank its role; the coordinating rank commits, drains and applies
        retention."""
        self._check_open()
        self._claim_staged()
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "use_collectives=False: a tierstore checkpoint is committed once for all ranks by the "
                "coordinator; save with collectives"
            )
        if is_coordinator and self._drainer is None:
            self._drainer = self._start_drainer()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._name is None:
            raise InvalidKeyError("no checkpoint id: pass checkpoint_id='tierstore://<name>' to the save")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Make this rank's items durable in the writer's data store: the ones ``stage`` put,
        or else each item resolved and put now (copied through the cache while earlier ones are
        written back). Keys of earlier saves that no checkpoint uses any more go first."""
        self._tiers[0].release_unreferenced(self._store_name, self._store, self._saves_in_flight)
        staging = self._take_staged()
        keys: list[Hashable] = []
        try:
            if staging is None:
                staging = self._new_save(self._save_id, copy=False)
                for item in plan.items:
                    staging.add(item.index, planner.resolve_data(item))
                    keys.append(item.index)
            else:
                keys = [self._staged_key(staging, item, planner) for item in plan.items]
        except BaseException:
            if staging is not None:
                staging.abandon()
            raise
        written = staging.write(keys)
        results = [
            WriteResult(index=item.index, size_in_bytes=written[key]["nbytes"], storage_data=written[key])
            for item, key in zip(plan.items, keys, strict=True)
        ]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the checkpoint on the fast tier (its record written last), then queue its drain."""
        assert self._name is not None
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        self._tiers[0].commit(self._name, self._save_id, metadata)
        if self._drainer is None:
            self._drainer = self._start_drainer()
        self._drainer.submit(self._name)

    def storage_meta(self) -> StorageMeta | None:
        self._claim_staged()
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id)

    @property
    def checkpoint_id(self) -> str | None:
        """The id of the checkpoint being saved, ``tierstore://<name>``."""
        return None if self._name is None else f"{SCHEME}{self._name}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
        """Whether ``checkpoint_id`` is one of these: ``tierstore://<name>`` or a plain name."""
        return is_checkpoint_id(checkpoint_id)

    # -- DCP's AsyncStager ------------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """For ``dcp.async_save``: copy every tensor (and DTensor's local shard) into the DRAM
        budget, spilling to the fast tier while it is full. Training may go on when this returns.

        Args:
            state_dict: the state to save.

        Returns:
            The state dict for the background save, whose tensors are only looked at for their
            shapes (their data is the staged copy) and whose other values are copies.

        Raises:
            BufferMismatchError: a tensor subclass other than a DTensor, a ``Parameter`` or a
                [`StoredTensor`][] (save it with ``dcp.save``).
            StoreClosedError: the writer is closed.
        """
        self._check_open()
        with self._lock:
            while self._staged is not None:  # the previous save has not taken its items yet
                previous = self._staged
                if previous.claimed_by is not None and not previous.claimed_by.is_alive():
                    previous.abandon()  # its save ended without writing: it failed
                    self._staged = None
                    break
                self._lock.wait(WAIT_SECONDS)
        flat, mappings = flatten_state_dict(state_dict)
        staging = self._new_save(uuid.uuid4().hex, copy=True)
        planned: dict[str, Any] = {}
        try:
            with torch.no_grad():
                for fqn, value in flat.items():
                    if isinstance(value, DTensor):
                        staging.add(fqn, value.to_local())
                    elif type(value) in (torch.Tensor, torch.nn.Parameter, StoredTensor):
                        staging.add(fqn, value)
                    elif isinstance(value, torch.Tensor):
                        raise BufferMismatchError(
                            f"{fqn}: async staging takes tensors and DTensors, not {type(value).__name__}; "
                            "save it with dcp.save"
                        )
                    planned[fqn] = value if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            staging.wait()
        except BaseException:
            staging.abandon()
            raise
        with self._lock:
            self._staged = staging
        return unflatten_state_dict(planned, mappings)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: [`stage`][] returns once the state is copied."""

    # -- the drain --------------------------------------------------------------------------------
    def drain(self, *, wait: bool = True) -> None:
        """Drain every committed checkpoint some later tier lacks (after an interrupted drain).

        Args:
            wait: block until the drain is done; False returns at once, the drain going on in
                the background.

        Raises:
            BackendIOError: with ``wait``, a copy failed (a [`ChecksumError`][] for damaged data);
                the drain's own error.
            CapacityError: with ``wait``, the memory budget cannot hold an object the drain
                copies through memory.
            StoreClosedError: the writer is closed.
        """
        self._check_open()
        if self._drainer is None:
            self._drainer = self._start_drainer()
        else:
            for name in self._drainer.pending():
                self._drainer.submit(name)
        if wait:
            self._drainer.wait(None, None)

    def wait_durable(self, checkpoint_id: str | None = None, timeout: float | None = None) -> bool:
        """Wait until a checkpoint is durable: on the last tier.

        Args:
            checkpoint_id: ``tierstore://<name>`` or ``<name>``; None for every checkpoint queued
                for draining.
            timeout: seconds to wait at most; None for no limit.

        Returns:
            True once it is on the last tier (at once where nothing was drained), False if
            ``timeout`` seconds passed first.

        Raises:
            BackendIOError: its drain failed (a [`ChecksumError`][] for damaged data); the drain's
                own error.
            CapacityError: its drain could not get the memory to copy an object through.
            InvalidKeyError: ``checkpoint_id`` is not a valid checkpoint name.
        """
        if self._drainer is None:
            return True
        name = None if checkpoint_id is None else checkpoint_name(checkpoint_id)
        return self._drainer.wait(name, timeout)

    def close(self) -> None:
        """Wait for the drain, delete the keys of the writer's data store that no checkpoint uses,
        then close the tiers and free the budget."""
        if self._closed:
            return
        if self._drainer is not None:
            self._drainer.close()
        with self._lock:
            if self._staged is not None:
                self._staged.abandon()
                self._staged = None
        try:
            self._tiers[0].close_writer_store(self._store_name, self._store)
        finally:
            super().close()

    # -- internals --------------------------------------------------------------------------------
    def _start_drainer(self) -> Drainer:
        drainer = Drainer(self._tiers, self._keep, (self._store_name, self._store))
        for name in drainer.pending():
            drainer.submit(name)
        return drainer

    def _new_save(self, save_id: str, *, copy: bool) -> SaveItems:
        staging = SaveItems(self._store, self._store_name, save_id, self._key_bytes, copy=copy)
        with self._lock:
            self._in_flight.add(staging.prefix)
        return staging

    def _saves_in_flight(self) -> set[str]:
        with self._lock:
            return set(self._in_flight)

    def _claim_staged(self) -> SaveItems | None:
        """A save running on another thread than the staging (``dcp.async_save``'s executor)
        takes the staged items over; returns them."""
        with self._lock:
            staged = self._staged
            current = threading.current_thread()
            if staged is not None and staged.claimed_by is None and staged.staged_by is not current:
                staged.claimed_by = current
            return staged if staged is not None and staged.claimed_by is current else None

    def _take_staged(self) -> SaveItems | None:
        with self._lock:
            staged = self._staged
            if staged is None or staged.claimed_by is not threading.current_thread():
                return None
            self._staged = None
            self._lock.notify_all()
            return staged

    @staticmethod
    def _staged_key(staging: SaveItems, item: WriteItem, planner: SavePlanner) -> Hashable:
        """The staged entry of a planned item: a tensor's by its name (copied by ``stage``), a
        serialized object's resolved now (``stage`` copied the object itself)."""
        if item.type == WriteItemType.BYTE_IO:
            staging.add(item.index, planner.resolve_data(item))
            return item.index
        fqn = item.index.fqn
        assert item.tensor_data is not None
        nbytes = math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize
        if fqn not in staging or staging.nbytes(fqn) != nbytes:
            raise BufferMismatchError(
                f"{fqn}: the save plans {nbytes} bytes that stage() did not copy (a planner that names "
                "items differently from DCP's default, or several local shards of one tensor): save "
                "it with dcp.save"
            )
        return fqn


def _retention(keep: Mapping[str, int | None] | None, tiers: list[CheckpointTier]) -> list[int | None]:
    """Each tier's ``keep``, checked: a count >= 1 or None, for tiers the config has."""
    given = dict(keep or {})
    names = [tier.name for tier in tiers]
    for name in given:
        if name not in names:
            raise ConfigError(f"keep.{name}: the config has no tier {name!r} (tiers: {', '.join(names)})")
    counts: list[int | None] = []
    for index, tier in enumerate(tiers):
        count = given.get(tier.name, FAST_TIER_KEEP if index == 0 and len(tiers) > 1 else None)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ConfigError(
                f"keep.{tier.name}: a number of checkpoints >= 1, or None for all; not {count!r}"
            )
        counts.append(count)
    return counts
