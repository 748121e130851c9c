"""Copying a save's tensors into a bounded DRAM budget and writing them to the fast tier.

:class:`Staging` copies each item into buffers of the writer's :class:`~tierstore.StagingArea`
(page-aligned, so the nvme backend writes them with O_DIRECT as they are; pinned where CUDA
exists, so device copies are asynchronous DMA) and writes every filled buffer as one data object.
The pool is the budget: when it is full, staging waits for a write to end and reuses its buffer,
so a save never holds more than the budget however large the state. Items larger than one
object are cut into several; items smaller than ``pack_below`` share pack objects.

Two modes:

* ``write_at_once`` (``dcp.save``): each buffer is written as soon as it is filled, so copying
  and writing overlap;
* otherwise (the stager of ``dcp.async_save``): buffers stay in DRAM until :meth:`Staging.write`
  knows which items the save's plan keeps (DCP gives replicated items to one rank only), and are
  written earlier only when the budget is full (spilled, oldest first), as a write-back cache
  would: staging then costs the copy alone while the state fits the budget.
"""

from __future__ import annotations

import io
import threading
from collections import deque
from collections.abc import Hashable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ..buffers import AlignedBuffer
from ..dtypes import dtype_name
from ..errors import BufferMismatchError, ConfigError
from ..staging import StagingArea
from ..store import TierStore
from ..tier import Placement
from .layout import Item, ObjectTable
from .stored import committed_placement, owner
from .tiers import CheckpointTier

PACK_BYTES = 4 << 20
"""Most bytes of small items in one pack object."""
MAX_OBJECT_BYTES = 256 << 20
"""Most bytes of one data object; the budget allows four in flight, and no fewer than this."""
MEMBER_ALIGNMENT = 64
"""Pack members start on this boundary, so every dtype can view its bytes in place."""
WAIT_SECONDS = 0.05
"""How often staging rechecks for room that the drain (which shares the pool) gave back."""


def object_bytes(budget: int) -> int:
    """The size of the data objects a budget allows: a quarter of it, in whole pages, so several
    writes overlap the copy of the next, and at most :data:`MAX_OBJECT_BYTES`."""
    size = min(MAX_OBJECT_BYTES, budget // 4 // 4096 * 4096)
    if size < 4096:
        raise ConfigError(
            f"cache.budget: checkpoints stage through at least 16 KiB of DRAM, not {budget} bytes"
        )
    return size


@dataclass(eq=False)
class _Object:
    """A data object being staged: a pool buffer holding part of a large item, or small items."""

    buffer: AlignedBuffer | None
    capacity: int
    nbytes: int = 0
    written: Future[Placement] | None = None
    placement: Placement | None = None
    error: BaseException | None = None


@dataclass
class _Entry:
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    nbytes: int
    pieces: list[tuple[_Object, int, int]] = field(default_factory=list)


class Staging:
    """The items of one save on their way to the fast tier (see the module docstring)."""

    def __init__(
        self, tier: CheckpointTier, pool: StagingArea, *, pack_below: int, write_at_once: bool
    ) -> None:
        self.tier = tier
        self.pool = pool
        self.object_bytes = object_bytes(pool.capacity)
        self.pack_bytes = min(PACK_BYTES, self.object_bytes)
        self.pack_below = min(pack_below, self.pack_bytes)
        self.write_at_once = write_at_once
        self.staged_by = threading.current_thread()
        self.claimed_by: threading.Thread | None = None
        """The thread of the save that took these items over (``dcp.async_save``'s executor)."""
        self._entries: dict[Hashable, _Entry] = {}
        self._objects: list[_Object] = []
        self._filled: deque[_Object] = deque()
        """Objects filled and not yet being written, oldest first."""
        self._in_flight = 0
        self._pack: _Object | None = None
        self._done = threading.Condition()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def nbytes(self, key: Hashable) -> int:
        return self._entries[key].nbytes

    # -- copying in -------------------------------------------------------------------------------
    def add(self, key: Hashable, data: torch.Tensor | io.BytesIO) -> None:
        """Copy a tensor (any device, layout or strides), a store object's stand-in
        (:mod:`.stored`) or serialized bytes in; the caller may change ``data`` once this returns."""
        if isinstance(data, torch.Tensor) and (found := owner(data)) is not None:
            self._add_stored(key, data, *found)
            return
        if isinstance(data, io.BytesIO):
            tensor = torch.from_numpy(np.frombuffer(data.getbuffer(), np.uint8))
            entry = _Entry(None, None, tensor.numel())
        else:
            tensor = data.detach()
            entry = _Entry(tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())
        self._entries[key] = entry
        if entry.nbytes == 0:
            return
        if entry.nbytes < self.pack_below:
            target, at = self._pack_room(entry.nbytes)
            _copy(target, at, tensor)
            target.nbytes = at + entry.nbytes
            entry.pieces.append((target, at, entry.nbytes))
            return
        step = self.object_bytes // tensor.element_size()
        if tensor.numel() <= step:  # one object: copied as it lies, whatever its strides
            parts = [tensor]
        else:
            flat = (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1)
            parts = [flat[first : first + step] for first in range(0, flat.numel(), step)]
        for part in parts:
            nbytes = part.numel() * part.element_size()
            target = self._new_object(nbytes)
            _copy(target, 0, part)
            target.nbytes = nbytes
            entry.pieces.append((target, 0, nbytes))
            self._filled_up(target)

    def _add_stored(self, key: Hashable, stand_in: torch.Tensor, store: TierStore, name: str) -> None:
        """A store object, copied from the store's tier without this process's memory where the
        backends allow, else read and copied in like any tensor (see :mod:`.stored`)."""
        shape, dtype = tuple(stand_in.shape), stand_in.dtype
        placement = committed_placement(store, name, shape, dtype)
        linked = None if placement is None else self.tier.link(placement)
        if linked is None:
            self.add(key, store.get(name, cache=False).result())
            return
        entry = _Entry(dtype, shape, stand_in.numel() * stand_in.element_size())
        for _, copied in linked:
            written: Future[Placement] = Future()
            written.set_result(copied)
            target = _Object(None, 0, copied.nbytes, written=written, placement=copied)
            self._objects.append(target)
            entry.pieces.append((target, 0, copied.nbytes))
        self._entries[key] = entry

    def _pack_room(self, nbytes: int) -> tuple[_Object, int]:
        pack = self._pack
        at = 0 if pack is None else -(-pack.nbytes // MEMBER_ALIGNMENT) * MEMBER_ALIGNMENT
        if pack is None or at + nbytes > pack.capacity:
            self._seal_pack()
            pack, at = self._new_object(self.pack_bytes), 0
            self._pack = pack
        return pack, at

    def _seal_pack(self) -> None:
        if self._pack is not None:
            self._filled_up(self._pack)
            self._pack = None

    def _new_object(self, capacity: int) -> _Object:
        target = _Object(self._acquire(capacity), capacity)
        self._objects.append(target)
        return target

    def _filled_up(self, target: _Object) -> None:
        if self.write_at_once:
            self._start(target)
        else:
            with self._done:
                self._filled.append(target)

    def _acquire(self, nbytes: int) -> AlignedBuffer:
        """A pool buffer; while the budget is full, spill filled objects and wait for writes."""
        while True:
            with self._done:
                idle = self._in_flight == 0
            buffer = self.pool.try_acquire(nbytes, fresh_pages=idle)
            if buffer is not None:
                return buffer
            with self._done:
                spill = self._filled.popleft() if self._filled else None
                if spill is None:
                    self._done.wait(WAIT_SECONDS)
            if spill is not None:
                self._start(spill)

    # -- writing ----------------------------------------------------------------------------------
    def _start(self, target: _Object) -> None:
        assert target.buffer is not None
        with self._done:
            self._in_flight += 1
        target.written = self.tier.write(target.buffer.memoryview(target.nbytes))
        target.written.add_done_callback(lambda done: self._finished(target, done))

    def _finished(self, target: _Object, done: Future[Placement]) -> None:
        with self._done:
            target.error = done.exception()
            if target.error is None:
                target.placement = done.result()
            assert target.buffer is not None
            self.pool.release(target.buffer)
            target.buffer = None
            self._in_flight -= 1
            self._done.notify_all()

    def write(self, keys: Iterable[Hashable]) -> dict[Hashable, tuple[Item, ObjectTable]]:
        """Write (or finish writing) the objects holding ``keys``' items and describe each item;
        everything else staged is dropped. On failure nothing written stays behind."""
        self._seal_pack()
        wanted = {key: self._entries[key] for key in keys}
        needed = {id(target) for entry in wanted.values() for target, _, _ in entry.pieces}
        unneeded = [target for target in self._objects if id(target) not in needed]
        self._objects = [target for target in self._objects if id(target) in needed]
        self._drop(unneeded)
        with self._done:
            pending = [target for target in self._filled if id(target) in needed]
            self._filled.clear()
        for target in pending:
            self._start(target)
        with self._done:
            self._done.wait_for(lambda: self._in_flight == 0)
        failed = next((target.error for target in self._objects if target.error is not None), None)
        if failed is not None:
            self.abandon()
            raise failed
        results: dict[Hashable, tuple[Item, ObjectTable]] = {}
        for key, entry in wanted.items():
            pieces, objects = [], {}
            for target, at, nbytes in entry.pieces:
                assert target.placement is not None
                placement = target.placement
                pieces.append((placement.name, at, nbytes))
                objects[placement.name] = {"nbytes": placement.nbytes, "extents": placement.describe()}
            item: Item = {
                "dtype": None if entry.dtype is None else dtype_name(entry.dtype),
                "shape": None if entry.shape is None else list(entry.shape),
                "nbytes": entry.nbytes,
                "pieces": pieces,
            }
            results[key] = (item, objects)
        self._objects.clear()
        return results

    def abandon(self) -> None:
        """Drop everything staged or written (a save that failed or was superseded)."""
        with self._done:
            self._filled.clear()
        self._pack = None
        self._drop(self._objects)
        self._objects = []

    def _drop(self, targets: Iterable[_Object]) -> None:
        """Give back the buffers of objects never written, and delete the written ones (once
        their writes end)."""
        for target in targets:
            if target.written is None:
                if target.buffer is not None:
                    self.pool.release(target.buffer)
                    target.buffer = None
                continue
            target.written.add_done_callback(self._forget_written)

    def _forget_written(self, written: Future[Placement]) -> None:
        if written.exception() is None:
            self.tier.forget([written.result()])


def _copy(target: _Object, at: int, tensor: torch.Tensor) -> None:
    """Copy ``tensor``'s values into ``target``'s buffer at byte ``at``."""
    assert target.buffer is not None
    nbytes = tensor.numel() * tensor.element_size()
    destination = target.buffer.view(at + nbytes)[at:]
    if tensor.dtype != torch.uint8:
        destination = destination.view(tensor.dtype)
    try:
        destination.view(tensor.shape).copy_(tensor)
    except RuntimeError as error:  # e.g. a tensor subclass whose values cannot be copied out
        raise BufferMismatchError(
            f"cannot stage a {type(tensor).__name__} of {tensor.dtype}: {error}"
        ) from error
