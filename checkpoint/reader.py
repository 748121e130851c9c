"""The DCP storage reader: ``dcp.load`` from the nearest tier that holds the checkpoint."""

from __future__ import annotations

import dataclasses
import errno
import io
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from ..config import ConfigSource, load_config
from ..dtypes import dtype_from_name
from ..errors import (
    BackendIOError,
    BufferMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    MissingDataError,
)
from ..store import TierStore
from .format import SCHEME, Committed, Item, checkpoint_name, is_checkpoint_id
from .stored import owner
from .tiers import CheckpointTier, TierSet, open_tiers


@dataclass
class _Read:
    """One item being read: into the destination tensor itself, or into a copy to narrow."""

    item: ReadItem
    target: torch.Tensor | None
    """The planner's tensor (None for a serialized object)."""
    buffer: torch.Tensor
    reads: list[Future[torch.Tensor]]
    direct: bool
    holder: tuple[TierStore, str] | None
    """The store object a stand-in stands for (`stored`), put back into its store."""


class TieredStorageReader(TierSet, StorageReader):
    """Reads DCP checkpoints written by [`TieredStorageWriter`][] from the first tier of the config
    that holds them. Resharding (a checkpoint of N ranks loaded on M) is DCP's and works as with its
    own readers.

    Every byte read is checked against its checksum: damage raises [`ChecksumError`][] naming the
    checkpoint, the tier and the item (inside DCP's ``CheckpointException``, which collects each
    rank's error).

    Args:
        config: a store config (dict, ``.toml``/``.json`` path or [`StoreConfig`][]) with the same
            ``tiers`` as the writer's, in the same order; ``cache.budget`` bounds the memory a load
            reads ahead into.
        checkpoint_id: ``tierstore://<name>`` or ``<name>`` (or the one ``dcp.load`` is given);
            None for the newest committed checkpoint.

    Raises:
        ConfigError: the config is invalid, or a backend cannot be opened as configured.
        CheckpointNotFoundError: no tier holds ``checkpoint_id`` (raised at once).
        InvalidKeyError: ``checkpoint_id`` is not a valid checkpoint name.
    """

    def __init__(self, config: ConfigSource, checkpoint_id: str | None = None) -> None:
        settings = load_config(config)
        super().__init__(open_tiers(settings, writable=False))
        self._budget = int(settings.cache.budget)
        self._source: tuple[CheckpointTier, Committed] | None = None
        self._storage: dict[MetadataIndex, Item] = {}
        self._stores: dict[str, TierStore] = {}
        """The chosen checkpoint's data stores opened so far (read-only), by name."""
        if checkpoint_id is not None:
            try:
                self.reset(checkpoint_id)
            except BaseException:
                self.close()
                raise

    # -- DCP's StorageReader ----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | Any | None = None) -> None:
        """Choose the checkpoint to load, from the nearest tier holding it (DCP calls this).

        Args:
            checkpoint_id: ``tierstore://<name>`` or ``<name>``; None for the newest.

        Raises:
            CheckpointNotFoundError: no tier holds it.
            InvalidKeyError: ``checkpoint_id`` is not a valid checkpoint name.
            StoreClosedError: the reader is closed.
        """
        self._check_open()
        self._close_stores()
        self._source = self._find(None if not checkpoint_id else checkpoint_name(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._check_open()
        if self._source is None:
            self._source = self._find(None)
        metadata = self._source[1].metadata
        meta = metadata.storage_meta or StorageMeta(checkpoint_id=self.checkpoint_id)
        return dataclasses.replace(metadata, storage_meta=dataclasses.replace(meta, load_id=uuid.uuid4().hex))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        """Read this rank's items, many at once: straight into the destination tensor where it is
        the whole saved chunk, else into a copy that is narrowed into it (resharding), holding at
        most ``cache.budget`` bytes of such copies."""
        assert self._source is not None
        window: deque[_Read] = deque()
        held = 0
        for item in plan.items:
            read = self._start(item, planner)
            window.append(read)
            held += 0 if read.direct else read.buffer.numel()
            while held > self._budget and len(window) > 1:
                done = window.popleft()
                held -= 0 if done.direct else done.buffer.numel()
                self._finish(done, planner)
        while window:
            self._finish(window.popleft(), planner)
        finished: TorchFuture[None] = TorchFuture()
        finished.set_result(None)
        return finished

    @property
    def checkpoint_id(self) -> str | None:
        """The id of the checkpoint chosen, ``tierstore://<name>`` (None before one is)."""
        return None if self._source is None else f"{SCHEME}{self._source[1].name}"

    @property
    def tier(self) -> str | None:
        """The tier the chosen checkpoint is read from."""
        return None if self._source is None else self._source[0].name

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
        """Whether ``checkpoint_id`` is one of these: ``tierstore://<name>`` or a plain name."""
        return is_checkpoint_id(checkpoint_id)

    # -- internals --------------------------------------------------------------------------------
    def _start(self, item: ReadItem, planner: LoadPlanner) -> _Read:
        tier, record = self._source or (None, None)
        assert tier is not None and record is not None
        stored = self._storage[item.storage_index]
        target: torch.Tensor | None = None
        direct = False
        holder: tuple[TierStore, str] | None = None
        if item.type == LoadItemType.BYTE_IO:
            buffer = torch.empty(stored["nbytes"], dtype=torch.uint8)
        else:
            assert stored["dtype"] is not None and stored["shape"] is not None
            dtype = dtype_from_name(stored["dtype"], f"checkpoint {record.name!r}: {item.storage_index.fqn}")
            shape = tuple(stored["shape"])
            target = planner.resolve_tensor(item).detach()
            holder = owner(target)
            if holder is not None and (any(item.storage_offsets) or tuple(item.lengths) != shape):
                raise BufferMismatchError(
                    f"{item.storage_index.fqn}: a store object loads whole, not resharded (saved as {shape})"
                )
            direct = holder is None and (
                not any(item.storage_offsets)
                and tuple(item.lengths) == shape
                and tuple(target.shape) == shape
                and target.dtype == dtype
                and target.device.type in ("cpu", "cuda")  # the store copies in order with the stream
                and target.is_contiguous()
                and not (target.is_conj() or target.is_neg())
            )
            buffer = target if direct else torch.empty(shape, dtype=dtype)
        with self._named(item):
            store = self._store(stored["store"])
            if len(stored["keys"]) == 1:  # the item whole, in its shape
                reads = [store.get(stored["keys"][0], out=buffer, cache=False)]
            else:  # cut into keys of consecutive elements
                flat = buffer.reshape(-1) if buffer.dim() else buffer.reshape(1)
                reads, at = [], 0
                for key in stored["keys"]:
                    length = store.info(key).shape[0]
                    reads.append(store.get(key, out=flat[at : at + length], cache=False))
                    at += length
        return _Read(item, target, buffer, reads, direct, holder)

    def _store(self, name: str) -> TierStore:
        """A data store of the chosen checkpoint, opened read-only on first use."""
        assert self._source is not None
        if name not in self._stores:
            self._stores[name] = self._source[0].open_store(name, read_only=True)
        return self._stores[name]

    def _close_stores(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()

    def close(self) -> None:
        self._close_stores()
        super().close()

    def _finish(self, read: _Read, planner: LoadPlanner) -> None:
        with self._named(read.item):
            for future in read.reads:
                future.result()
        if read.target is None:
            planner.load_bytes(read.item, io.BytesIO(_bytes(read.buffer)))
            return
        if read.holder is not None:
            store, key = read.holder
            store.put(key, read.buffer).result()
        elif not read.direct:
            read.target.copy_(
                narrow_tensor_by_index(read.buffer, read.item.storage_offsets, read.item.lengths)
            )
        planner.commit_tensor(read.item, read.target)

    def _find(self, name: str | None) -> tuple[CheckpointTier, Committed]:
        """The newest save of ``name`` (None: of any name), from the first tier holding it; with a
        name, only that checkpoint's records are read."""
        candidates = [(tier, record) for tier in self._tiers for record in tier.committed(name).values()]
        if not candidates:
            listing = "; ".join(
                f"{tier.name}: {', '.join(tier.committed()) or 'none'}" for tier in self._tiers
            )
            wanted = "any checkpoint" if name is None else f"a checkpoint {SCHEME}{name}"
            raise CheckpointNotFoundError(f"no tier holds {wanted} (committed: {listing})")
        newest = max(candidates, key=lambda found: found[1].committed_at)[1]
        return next(found for found in candidates if found[1].save_id == newest.save_id)

    @contextmanager
    def _named(self, item: ReadItem) -> Iterator[None]:
        """Errors of a read name the checkpoint, the tier and the item."""
        assert self._source is not None
        tier, record = self._source
        where = f"checkpoint {SCHEME}{record.name} on tier {tier.name!r}, key {item.storage_index.fqn!r}"
        try:
            yield
        except ChecksumError as error:
            raise ChecksumError(f"{where}: {error}") from None
        except MissingDataError as error:
            raise MissingDataError(errno.ENOENT, f"{where}: {error.strerror}") from None
        except BackendIOError as error:
            raise BackendIOError(error.errno or errno.EIO, f"{where}: {error.strerror or error}") from None


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data
