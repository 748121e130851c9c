"""Staging sub-group state between a TierStore and a fixed pool of DRAM buffers.

Both offloaded optimizers ([`OffloadedAdamW`][] and the DeepSpeed integration's swapper) move the
same thing: one fp32 object per sub-group, read before its update and written after it. The stager
owns the buffers and the policies that make that fast:

* a read-ahead ring of ``prefetch_depth`` buffers, filled in pass order while the current
  sub-group is updated;
* write-back in the background, a buffer returning to the pool once its write is done;
* the sub-groups kept in DRAM at the end of a pass (MLP-Offload's cache-friendly order,
  `pass_order`: the next, reversed pass starts with them), chosen by the I/O model, the static
  last-K rule, or none; a kept sub-group skips its write now and its read next pass.

The DRAM it holds is bounded up front and reserved from the store's ledger as one [`StagingArea`][]
(``"optimizer <namespace>"``): ``prefetch_depth`` ring buffers the size of the largest sub-group and
the caller's own gradient buffer (the working set), and the area's pool over the rest of the budget
(page-rounded, as every buffer is), which holds kept sub-groups at their own size (so sub-groups of
uneven size, APOLLO's whole parameters say, are kept by bytes, not by count) and lends the ring
extra buffers while it has room. The buffers are not pinned: an optimizer over CPU parameters
updates its state on the CPU, and no device copy reads them
([`DeviceStager`][tierstore.optimizer.device.DeviceStager], the stager of an optimizer over GPU
parameters, pins them). The optimizer's state layout is its own: the stager sees only a named fp32
object per sub-group.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import ClassVar

import torch

from .._checks import check_arguments
from ..buffers import AlignedBuffer, aligned_tensor, round_up
from ..errors import CapacityError, ConfigError, InvalidKeyError
from ..pass_plan import keep_from_end, last_that_fit
from ..store import TierStore
from .options import CachePolicy, StagingOptions

FP32 = 4


def pass_order(count: int, pass_number: int, *, alternate: bool = True) -> list[int]:
    """The order in which pass ``pass_number`` (counted from 1) visits sub-groups ``0..count-1``:
    forward, and with ``alternate`` every even-numbered pass in reverse (MLP-Offload's
    cache-friendly order: each pass starts with the sub-groups the previous one ended with, which
    the stager kept in DRAM)."""
    order = list(range(count))
    if alternate and pass_number % 2 == 0:
        order.reverse()
    return order


class SubGroupStager:
    """Reads, holds and writes back fp32 sub-group states of at most ``slot_elements`` each.

    A pass is ``begin_pass(order)``, then ``acquire``/``release`` per sub-group in that order, then
    ``end_pass()``. ``begin_pass`` may come early (reads start as soon as staging buffers are free:
    an update's first sub-groups can arrive while backward runs), and ``end_pass`` leaves the last
    write-backs running (they finish while the next forward runs; their buffers come back when
    needed, and `flush`, `wait_writes` and `close` wait for them). ``acquire`` and ``release`` also
    work outside a pass (one blocking read, one write-back), which is what initialisation and
    checkpoint restore need.

    The sub-groups are the store objects ``"<namespace>/<name>"``: the stager claims ``namespace``
    on the store for ``owner`` ([`TierStore.namespaces`][]), so a second stager, optimizer or other
    workload writing the same keys is refused with [`NamespaceInUseError`][] instead of overwriting
    them. The claim and the staging area (``dram_budget`` bytes of the store's ledger) last until
    `close` (or `abandon`, or garbage collection).

    Args:
        store: the store holding the sub-group objects, and whose ledger the DRAM is reserved from.
        namespace: the prefix of the sub-groups' store keys, claimed on the store.
        slot_elements: fp32 values of the largest sub-group (the size of each ring buffer).
        dram_budget: bytes of DRAM the stager holds (an int, or text such as ``"64MiB"``): the
            working set (``prefetch_depth`` ring buffers and ``reserved_bytes``) and room for
            kept sub-groups; None for the working set only (nothing kept).
        prefetch_depth: sub-groups read ahead of the one being updated (the ring's buffers).
        cache_policy: which sub-groups stay in DRAM between passes: ``"model"`` (the I/O
            model's choice), ``"static"`` (the last that fit) or ``"none"``.
        reserved_bytes: bytes of the budget the caller holds for buffers of its own (an
            optimizer's fp32 gradient buffer).
        owner: who holds the namespace and the DRAM, as the store reports them.

    Raises:
        ConfigError: ``dram_budget``, ``prefetch_depth`` or ``cache_policy`` of the wrong type or
            out of range, or a namespace that is not a valid key; the message names it.
        CapacityError: ``dram_budget`` is below the working set, or does not fit beside the
            store's other reservations.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
        StoreClosedError: the store is closed.
    """

    def __init__(
        self,
        store: TierStore,
        namespace: str,
        *,
        slot_elements: int,
        dram_budget: int | str | None,
        prefetch_depth: int = 2,
        cache_policy: CachePolicy = "model",
        reserved_bytes: int = 0,
        owner: str = "SubGroupStager",
    ) -> None:
        options = check_arguments(
            StagingOptions,
            {"dram_budget": dram_budget, "prefetch_depth": prefetch_depth, "cache_policy": cache_policy},
        )
        given = None if options.dram_budget is None else int(options.dram_budget)
        self.store = store
        self.prefetch_depth = prefetch_depth
        self.cache_policy = cache_policy
        self.slot_bytes = FP32 * max(slot_elements, 1)
        self.working_bytes = self.ring_size * self.slot_bytes + reserved_bytes
        """DRAM a pass needs whatever it keeps: the ring and the caller's own (gradient) buffer."""
        self.reserved_bytes = reserved_bytes
        working = self.working_bytes
        self._budget_follows = given is None
        """No budget given: it is the working set, and follows it when `grow` enlarges it."""
        budget = working if given is None else given
        if budget < working:
            raise CapacityError(
                f"dram_budget of {budget} bytes is below the working set of {working} bytes "
                f"({self.ring_size} sub-group buffers of {self.slot_bytes}"
                + (f" + {reserved_bytes} for gradients)" if reserved_bytes else ")")
            )
        try:
            self.claim = store.namespaces.claim(namespace, owner)
        except InvalidKeyError as error:
            raise ConfigError(f"namespace: {error} (it prefixes the store keys)") from None
        self._unclaim = weakref.finalize(self, store.namespaces.release, self.claim)
        self.namespace = self.claim.namespace
        try:
            self.area = store.staging(
                f"optimizer {self.namespace}", budget, pin=self.PINNED, pool_bytes=round_up(budget - working)
            )
        except BaseException:
            self._unclaim()
            raise
        try:
            self.buffers = self._new_ring(self.slot_bytes)
            """The read-ahead ring: each buffer holds the largest sub-group."""
        except BaseException:  # a pinned ring that could not be page-locked
            self.abandon()
            raise
        self._pooled: dict[int, AlignedBuffer] = {}
        """Pool buffers handed out, by the address of their fp32 view."""
        self._free: list[torch.Tensor] = list(self.buffers)
        self._sizes: dict[Hashable, int] = {}
        self.resident: dict[Hashable, torch.Tensor] = {}
        """Sub-groups kept in DRAM between passes (their store copy is stale)."""
        self._held: dict[Hashable, torch.Tensor] = {}
        self._outgrown: dict[Hashable, list[torch.Tensor]] = {}
        """Buffers a held sub-group was resized out of, given back at its release."""
        self._reads: dict[Hashable, tuple[torch.Tensor, Future[torch.Tensor]]] = {}
        self._writes: deque[tuple[Future[None], torch.Tensor]] = deque()
        self._upcoming: deque[Hashable] = deque()
        self._keep: set[Hashable] = set()
        self._pass: list[Hashable] | None = None
        """The order of the pass begun and not yet ended."""

    PINNED: ClassVar[bool] = False
    """Whether the buffers (ring and pool) are page-locked for copies to a device."""

    RING_EXTRA: ClassVar[int] = 0
    """Ring buffers beyond ``prefetch_depth``, one for each sub-group a pass holds at once (acquired
    and not yet released) that the reads ahead and write-backs must not wait for: none here, where
    the one sub-group being updated shares the ring with them."""

    @property
    def ring_size(self) -> int:
        """Buffers of the read-ahead ring."""
        return self.prefetch_depth + self.RING_EXTRA

    @property
    def dram_budget(self) -> int:
        """Bytes of DRAM the stager holds at most: the working set and the room to keep sub-groups."""
        return self.area.budget

    @property
    def held(self) -> list[Hashable]:
        """The sub-groups acquired and not yet released (or discarded)."""
        return list(self._held)

    @property
    def kept_bytes(self) -> int:
        """DRAM the pool holds now (kept sub-groups and buffers lent to the ring)."""
        return self.area.pool.allocated_bytes

    # -- a pass ---------------------------------------------------------------------------------
    def begin_pass(self, order: Sequence[Hashable], sizes: Mapping[Hashable, int]) -> None:
        """Start a pass over ``order`` (sub-group -> elements in ``sizes``): plan what stays in DRAM
        at its end and start reading ahead. Beginning the pass already begun, in the same order,
        changes nothing (a pass begun early, then by the update itself)."""
        if self._pass is not None:
            if self._pass == list(order):
                return
            self.end_pass()
        self._pass = list(order)
        self._sizes.update(sizes)
        self._keep = self._plan_keep(list(order))
        self._upcoming = deque(name for name in order if name not in self.resident)
        self._read_ahead()

    def acquire(self, name: Hashable, elements: int | None = None) -> torch.Tensor:
        """The sub-group's state in DRAM (``elements`` fp32 values), once its read is done."""
        if elements is not None:
            self._sizes[name] = elements
        self._reclaim(block=False)
        self._read_ahead()
        if name in self.resident:
            buffer = self.resident.pop(name)
        elif name in self._reads:
            buffer, future = self._reads.pop(name)
            future.result()
        else:
            if name in self._upcoming:
                self._upcoming.remove(name)
            buffer = self._take_blocking(name)
            try:
                self._read(name, buffer).result()
            except BaseException:
                self._give_back(buffer)
                raise
        self._held[name] = buffer
        return buffer[: self._sizes[name]]

    def resize(self, name: Hashable, elements: int) -> torch.Tensor:
        """An acquired sub-group's state grown or shrunk to ``elements`` (its layout changed, e.g. an
        optimizer created its moments during the first step); its values so far are kept."""
        if FP32 * elements > self.slot_bytes:
            raise CapacityError(f"{name}: {elements} fp32 values do not fit a {self.slot_bytes}-byte buffer")
        buffer = self._held[name]
        if buffer.numel() < elements:  # a pool buffer of the old size: move to a larger one
            before, self._sizes[name] = self._sizes[name], elements
            larger = self._take_blocking(name)
            larger[:before].copy_(buffer[:before])
            self._outgrown.setdefault(name, []).append(buffer)  # callers may still view it
            self._held[name] = buffer = larger
        self._sizes[name] = elements
        return buffer[:elements]

    def release(self, name: Hashable) -> None:
        """Done with the sub-group: keep it in DRAM if the plan says so, else write it back."""
        buffer = self._held.pop(name)
        for outgrown in self._outgrown.pop(name, []):
            self._give_back(outgrown)
        kept = self._to_pool(name, buffer) if name in self._keep else None
        if kept is None:
            self._write(name, buffer)
        else:
            self.resident[name] = kept
        self._read_ahead()

    def discard(self, name: Hashable) -> None:
        """Done with an acquired sub-group without writing it back (its state went elsewhere, or
        the pass failed): its buffer is free again and the store keeps what it had."""
        buffer = self._held.pop(name)
        for outgrown in self._outgrown.pop(name, []):
            self._give_back(outgrown)
        self._give_back(buffer)
        self._read_ahead()

    def end_pass(self) -> None:
        """End the pass: drop reads started for sub-groups that were never acquired; the last
        write-backs go on (see the class docstring)."""
        self._pass = None
        self._upcoming.clear()
        self._keep = set()
        for buffer, future in self._reads.values():
            future.exception()
            self._give_back(buffer)
        self._reads.clear()
        self._reclaim(block=False)

    # -- outside a pass ---------------------------------------------------------------------------
    def write(self, name: Hashable, elements: int, fill: Callable[[torch.Tensor], object]) -> None:
        """Write a sub-group's state laid out by ``fill`` into a free buffer (in the background)."""
        self._sizes[name] = elements
        stale = self.resident.pop(name, None)
        if stale is not None:
            self._give_back(stale)
        buffer = self._take_blocking(name)
        fill(buffer[:elements])
        self._write(name, buffer)

    def read(self, name: Hashable) -> torch.Tensor:
        """The sub-group's current state: the DRAM copy if kept, else read from the store."""
        if name in self.resident:
            return self.resident[name][: self._sizes[name]]
        return self.store.get(self.key(name)).result()

    def flush(self) -> None:
        """Write the kept sub-groups to the store too (they stay in DRAM) and wait for every
        write-back: the store then holds the whole state."""
        futures = [
            self.store.put(self.key(name), buffer[: self._sizes[name]], cache=False)
            for name, buffer in self.resident.items()
        ]
        for future in futures:
            future.result()
        self.wait_writes()

    def restored(self, name: Hashable, elements: int) -> None:
        """The store's object for ``name`` was replaced from outside (a checkpoint's state copied
        back into the store, after `drop_resident`): it holds ``elements`` values now."""
        self._sizes[name] = elements

    def drop_resident(self) -> None:
        """Forget the DRAM copies (after the store was rewritten behind them)."""
        for buffer in self.resident.values():
            self._give_back(buffer)
        self.resident.clear()

    def wait_writes(self) -> None:
        while self._writes:
            self._reclaim(block=True)

    def lend_ring(self) -> list[torch.Tensor]:
        """The read-ahead ring's buffers, idle, for a caller that streams the whole state through
        the optimizer's own DRAM (a checkpoint): any pass is ended, the kept sub-groups written back
        and forgotten, and every write waited for, so the store holds the whole state. The caller
        may use the buffers until the next `begin_pass` or `acquire`; the pool's buffers are all
        free meanwhile.

        Returns:
            The ring's `ring_size` buffers of the largest sub-group's size each.
        """
        self.end_pass()
        self.flush()
        self.drop_resident()
        return list(self.buffers)

    def key(self, name: Hashable) -> str:
        return self.claim.key(str(name))

    def grow(self, slot_elements: int, reserved_bytes: int) -> None:
        """Make the ring hold sub-groups of ``slot_elements`` fp32 values and the caller's own
        buffer ``reserved_bytes`` (sub-groups were added), outside a pass. The kept sub-groups are
        written back and the pool rebuilt over what the budget leaves. A ``dram_budget`` given at
        construction that no longer holds the working set is a [`CapacityError`][], and then nothing
        changes; so is a grown budget that the store's ledger cannot hold, and then only the kept
        sub-groups have been written back."""
        slot_bytes = max(self.slot_bytes, FP32 * slot_elements)
        reserved_bytes = max(self.reserved_bytes, reserved_bytes)
        working = self.ring_size * slot_bytes + reserved_bytes
        if working == self.working_bytes:
            return
        budget = working if self._budget_follows else self.dram_budget
        if budget < working:
            raise CapacityError(
                f"dram_budget of {budget} bytes is below the working set of {working} bytes the added "
                f"sub-groups need ({self.ring_size} sub-group buffers of {slot_bytes} + "
                f"{reserved_bytes} for gradients)"
            )
        self.end_pass()
        self.flush()
        self.drop_resident()
        self.area.resize(budget, pool_bytes=round_up(budget - working))
        self.slot_bytes, self.reserved_bytes, self.working_bytes = slot_bytes, reserved_bytes, working
        self.buffers = self._new_ring(slot_bytes)
        self._free = list(self.buffers)

    # -- the end --------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._unclaim.alive

    def close(self) -> None:
        """Write the kept sub-groups back (the store then holds the whole state), wait for the
        writes in flight, and `abandon`. Idempotent."""
        if self.closed:
            return
        try:
            self.end_pass()
            self.flush()
            self.drop_resident()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Give back the namespace and the staging area now, writing nothing (`close` writes the
        kept sub-groups first)."""
        self._unclaim()
        self.area.close()

    # -- internals ------------------------------------------------------------------------------
    def _new_ring(self, slot_bytes: int) -> list[torch.Tensor]:
        """The read-ahead ring's `ring_size` buffers of ``slot_bytes`` each."""
        return [aligned_tensor(slot_bytes // FP32) for _ in range(self.ring_size)]

    def _read(self, name: Hashable, buffer: torch.Tensor) -> Future[torch.Tensor]:
        return self.store.get(self.key(name), out=buffer[: self._sizes[name]], cache=False)

    def _write(self, name: Hashable, buffer: torch.Tensor) -> None:
        state = buffer[: self._sizes[name]]
        self._writes.append((self.store.put(self.key(name), state, cache=False), buffer))

    def _read_ahead(self) -> None:
        self._reclaim(block=False)
        while self._upcoming and len(self._reads) < self.prefetch_depth:
            name = self._upcoming[0]
            if name in self.resident or name in self._held or name in self._reads:
                self._upcoming.popleft()
                continue
            buffer = self._take(name)
            if buffer is None:
                return
            self._upcoming.popleft()
            self._reads[name] = (buffer, self._read(name, buffer))

    def _reclaim(self, block: bool) -> None:
        """Return the buffers of finished writes (``block``: wait for at least one)."""
        while self._writes and (block or self._writes[0][0].done()):
            future, buffer = self._writes.popleft()
            try:
                future.result()
            finally:
                self._give_back(buffer)
            block = False

    def _take(self, name: Hashable) -> torch.Tensor | None:
        """A buffer for the sub-group, or None while all are in use. One the plan keeps comes from
        the pool if it can (it then stays where it was read); others take the ring first."""
        if name not in self._keep and self._free:
            return self._free.pop()
        pooled = self._from_pool(FP32 * self._sizes[name])
        if pooled is None and self._free:
            return self._free.pop()
        return pooled

    def _take_blocking(self, name: Hashable) -> torch.Tensor:
        while (buffer := self._take(name)) is None:
            if not self._writes:
                raise CapacityError(
                    f"all {len(self.buffers)} staging buffers are in use: a pass acquired more sub-groups "
                    "than the DRAM budget holds"
                )
            self._reclaim(block=True)
        return buffer

    def _to_pool(self, name: Hashable, buffer: torch.Tensor) -> torch.Tensor | None:
        """The sub-group in a pool buffer (copied out of the ring if need be, waiting for writes to
        free room: cheaper than a write now and a read next pass), or None if the pool is full."""
        if buffer.data_ptr() in self._pooled:
            return buffer
        nbytes = FP32 * self._sizes[name]
        while (pooled := self._from_pool(nbytes)) is None and self._writes:
            self._reclaim(block=True)
        if pooled is not None:
            pooled.copy_(buffer[: self._sizes[name]])
            self._give_back(buffer)
        return pooled

    def _from_pool(self, nbytes: int) -> torch.Tensor | None:
        if not self.area.fits(nbytes):
            return None
        block = self.area.try_acquire(nbytes)
        if block is None:
            return None
        tensor = block.view(nbytes).view(torch.float32)
        self._pooled[tensor.data_ptr()] = block
        return tensor

    def _give_back(self, buffer: torch.Tensor) -> None:
        block = self._pooled.pop(buffer.data_ptr(), None)
        if block is None:
            self._free.append(buffer)
        else:
            self.area.release(block)

    def _plan_keep(self, order: list[Hashable]) -> set[Hashable]:
        """What stays in the pool at the end of the pass: the I/O model's choice (`keep_from_end`)
        or MLP-Offload's last K that fit. Sizes are whole pages, as the pool carves them, so a
        planned set always fits the pool once the previous pass's kept set is gone."""
        room = self.area.capacity
        if self.cache_policy == "none" or room == 0:
            return set()
        sizes = [round_up(FP32 * self._sizes[name]) for name in order]
        choose = last_that_fit if self.cache_policy == "static" else keep_from_end
        return {order[i] for i in choose(sizes, room, range(len(order)))}
