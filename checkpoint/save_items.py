"""A save's items on their way into the writer's data store on the fast tier.

Each item is ``put`` into the store ([`TierStore`][]) under ``<save id>/<n>``: the store copies it
into its DRAM write-back cache (the config's ``cache.budget``: page-aligned, so the nvme backend
writes it with O_DIRECT as it is; kept resident, so a save does not page-fault its way through fresh
memory) and writes it back when the cache needs room or at the save's ``flush``, checksummed and
journaled. A CUDA tensor is copied by the store's device layer (`tierstore.device`): on a copy
stream, after the work queued on the caller's stream when it was put, through a few pinned pieces
into the cache; the save's wait (`SaveItems.wait`) returns once those copies have ended. The cache
is the budget: while it is full, a put waits for a write-back, so a save never holds more than the
budget however large the state. An item larger than `object_bytes` is cut into several keys, so that
every key fits the cache; items smaller than ``cache.pack_below`` share pack objects when written
back.

``dcp.save`` puts every item as DCP resolves it: the small ones stay in the cache, to be packed
at the flush, the others are written through (to the tier as soon as they are copied, several
puts at once, from the cache's huge-page buffers, whose 4 MiB requests reach the disk whole). The
stager of
``dcp.async_save`` puts every tensor before DCP plans the save, so training waits only for the
copies while the state fits the budget; the items the plan gives to other ranks (DCP saves a
replicated item once) are deleted again before the flush.

A tensor that already lives in a store (`stored`) is copied from that store with
[`TierStore.copy_to`][]: tier to tier without this process's memory where the backends allow.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
from collections.abc import Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ..dtypes import dtype_name
from ..errors import BufferMismatchError, ConfigError, KeyNotFoundError
from ..store import TierStore
from .format import Item
from .stored import owner

MAX_OBJECT_BYTES = 256 << 20
"""Most bytes of one key; the budget holds four, and no fewer than this."""
WAIT_SECONDS = 0.05
"""How often a waiting stager rechecks whether the previous save has taken its items."""
STORED = "stored/"
"""The key infix of tensors copied from another store, under their key there."""


def object_bytes(budget: int) -> int:
    """The most bytes of one key a budget allows: a quarter of it, in whole pages, so several
    write-backs overlap the copy of the next, and at most `MAX_OBJECT_BYTES`."""
    size = min(MAX_OBJECT_BYTES, budget // 4 // 4096 * 4096)
    if size < 4096:
        raise ConfigError(
            f"cache.budget: checkpoints stage through at least 16 KiB of DRAM, not {budget} bytes"
        )
    return size


@dataclass
class _Entry:
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    nbytes: int
    keys: list[str] = field(default_factory=list)


class SaveItems:
    """The items of one save (see the module docstring).

    Args:
        store: the writer's data store on the fast tier.
        store_name: its name (``d-...``), which the items' descriptions carry.
        save_id: the save's id: its keys' prefix.
        key_bytes: the most bytes of one key (`object_bytes` of the store's cache budget).
        copy: whether the caller may change the tensors once `wait` returns (the stager of
            ``dcp.async_save``): every item stays in the store's cache until `write`. Otherwise (a
            ``dcp.save``, whose caller waits for `write`) the items the store does not pack are
            written through as they are put.
    """

    def __init__(
        self, store: TierStore, store_name: str, save_id: str, key_bytes: int, *, copy: bool
    ) -> None:
        self.store = store
        self.copy = copy
        self.store_name = store_name
        self.save_id = save_id
        self.prefix = f"{save_id}/"
        self.key_bytes = key_bytes
        self.staged_by = threading.current_thread()
        self.claimed_by: threading.Thread | None = None
        """The thread of the save that took these items over (``dcp.async_save``'s executor)."""
        self._entries: dict[Hashable, _Entry] = {}
        self._puts: list[Future[None]] = []
        self._serials = itertools.count()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def nbytes(self, key: Hashable) -> int:
        return self._entries[key].nbytes

    def add(self, key: Hashable, data: torch.Tensor | io.BytesIO) -> None:
        """Put a tensor (any device, layout or strides), a store object's stand-in (`stored`) or
        serialized bytes into the store; the caller may change ``data`` once `wait` returns."""
        if isinstance(data, torch.Tensor) and (found := owner(data)) is not None:
            self._add_stored(key, data, *found)
            return
        if isinstance(data, io.BytesIO):
            tensor = torch.from_numpy(np.frombuffer(data.getbuffer(), np.uint8).copy())
            entry = _Entry(None, None, tensor.numel())
        else:
            tensor = data.detach()
            entry = _Entry(tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())
        self._entries[key] = entry
        if entry.nbytes == 0:
            return
        step = self.key_bytes // tensor.element_size()
        if tensor.numel() <= step:  # one key: put as it lies, whatever its strides
            parts = [tensor]
        else:
            flat = (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1)
            parts = [flat[first : first + step] for first in range(0, flat.numel(), step)]
        for part in parts:
            name = f"{self.prefix}{next(self._serials)}"
            # A save writes what the store packs at the flush and the rest as soon as it is in
            # the cache, several puts at once; a stager leaves everything in the cache.
            write_through = not self.copy and entry.nbytes >= self.store.pack_below
            try:
                self._puts.append(self.store.put(name, part, write_through=write_through))
            except BufferMismatchError as error:
                raise BufferMismatchError(f"{key}: {error}") from error
            entry.keys.append(name)

    def _add_stored(self, key: Hashable, stand_in: torch.Tensor, store: TierStore, name: str) -> None:
        """A store object, copied from its store's tier (see `stored`)."""
        info = store.info(name)
        shape, dtype = tuple(stand_in.shape), stand_in.dtype
        if info.shape != shape or info.dtype != dtype:
            raise BufferMismatchError(
                f"store key {name!r} is {info.dtype} {info.shape} now, its stand-in {dtype} {shape}"
            )
        if info.dirty or info.tier is None:
            store.flush()  # written back first, so that the copy can take its tier's object
        store.copy_to(self.store, [name], prefix=self.prefix + STORED)
        self._entries[key] = _Entry(dtype, shape, info.nbytes, [self.prefix + STORED + name])

    def wait(self) -> None:
        """Wait until every put has copied its tensor (raising the first failure)."""
        for put in self._puts:
            put.result()

    def write(self, keys: Iterable[Hashable]) -> dict[Hashable, Item]:
        """Make the items of ``keys`` durable in the store and describe each; every other item
        is deleted. On failure, nothing of the save stays behind."""
        try:
            wanted = {key: self._entries[key] for key in keys}
            self.wait()
            for key, entry in self._entries.items():
                if key not in wanted:
                    for name in entry.keys:
                        self.store.delete(name)
            self.store.flush()
        except BaseException:
            self.abandon()
            raise
        return {
            key: {
                "dtype": None if entry.dtype is None else dtype_name(entry.dtype),
                "shape": None if entry.shape is None else list(entry.shape),
                "nbytes": entry.nbytes,
                "store": self.store_name,
                "keys": entry.keys,
            }
            for key, entry in wanted.items()
        }

    def abandon(self) -> None:
        """Delete everything put so far (a save that failed or was superseded)."""
        for put in self._puts:
            put.exception()  # wait; a failed put left nothing to delete
        for entry in self._entries.values():
            for name in entry.keys:
                with contextlib.suppress(KeyNotFoundError):
                    self.store.delete(name)
        self._entries.clear()
        self._puts.clear()
