"""The device path of the offloaded optimizers: state of parameters on a GPU, streamed between the
store and the device a sub-group at a time and updated there.

An optimizer whose parameters are on a device (a GPU) stages its state through a [`DeviceStager`][]
instead of a plain `SubGroupStager`. The state lives in three places, each bounded by its own
budget:

* on the device: the sub-groups that fit ``gpu_budget`` (bytes of device memory) stay there between
  steps; they are read from the store once, at the first step that updates them, and cross the bus
  again only when the store must hold the whole state (a state dict, a snapshot, a checkpoint,
  `close`);
* in pinned host memory: the read-ahead ring and the sub-groups ``dram_budget`` keeps between steps
  (chosen by the I/O model, as on the CPU path), page-locked so that copies to and from the device
  run on its copy engines, asynchronously;
* in the store: everything else, read into the ring ahead of its update and written back after it.

One pass (a step's update) visits the sub-groups kept on the device first (no copy: their kernels
run while the first streamed sub-group crosses the bus), then the others in the pass order the
stager got. For each streamed sub-group ``k``, all on the device layer (`tierstore.device`):

1. its state is read from the store into a ring buffer (or found kept in a pool buffer), as on the
   CPU path (`acquire`);
2. it is copied to a device *slot* on the upload copy stream, after the slot's previous download has
   ended; the caller's (compute) stream waits for the copy before the sub-group's kernels;
3. its kernels (the optimizer's update, with the gradients where they are, the new weights written
   into the parameters) run on the caller's stream;
4. the updated state is copied back into the same host buffer on the download copy stream, after
   the kernels;
5. once that copy has ended, the host buffer goes back to the stager: kept in DRAM or written back
   to the store (`release`).

The host queues ``k``'s kernels, then ``k``'s download, then ``k+1``'s upload, and waits only for
what it needs next: so while the device updates sub-group ``k``, ``k+1`` is on its way up and
``k-1`` on its way down, on two copy streams (one per direction: PCIe moves both at once).

Lifetimes (what holds what, until when):

* a **slot** (device memory for the largest sub-group's state, [`DEVICE_SLOTS`][] of them) is
  allocated on the caller's stream at the pass's first use of it, after which the caller's stream
  records an event that its first upload waits for (the allocator may hand out memory that kernels
  queued earlier still read); it is reused for the sub-group after next, whose upload waits for the
  download that emptied it (an event on the download stream); the pass lets go of the slots at its
  end, once every copy has ended;
* a **host buffer** is held from the sub-group's acquire until its download has ended (the upload
  reads it, the download writes it: each transfer also holds it until the copy ends); at most
  [`DEVICE_SLOTS`][] are held at once, so the ring has that many buffers beyond ``prefetch_depth``,
  which stay for the reads ahead and the write-backs;
* a sub-group **kept on the device** is allocated on the caller's stream at its first pass and
  filled by one upload; its host buffer is given back, unwritten, once that upload has ended; it
  lives until the store's copy is rewritten (`write`, `drop_resident`) or the stager closes.

Device memory beyond ``gpu_budget`` is so bounded by the slots
([`DeviceStager.slot_device_bytes`][]) and what the optimizer's kernels use beside them (its
gradient buffer, a few scalars): see [`tierstore.optimizer.StagedOptimizer.device_staging_bytes`][].
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from ..buffers import AlignedBuffer, round_up
from ..device import CallerStream, DeviceCopies, DeviceRuntime, Transfer
from ..store import TierStore
from .options import CachePolicy
from .subgroup_stager import FP32, SubGroupStager

DEVICE_SLOTS = 3
"""Device slots of the streamed sub-groups: one on its way up (``k+1``), one being updated (``k``),
one on its way down (``k-1``)."""

DEVICE_BLOCK = 512
"""Bytes: what CUDA's caching allocator rounds every allocation up to (the unit of
``torch.cuda.max_memory_allocated``)."""


def device_bytes(nbytes: int) -> int:
    """Device memory an allocation of ``nbytes`` takes (whole allocator blocks)."""
    return round_up(max(nbytes, 1), DEVICE_BLOCK)


class DeviceStager(SubGroupStager):
    """A `SubGroupStager` whose sub-groups are updated on a device (see the module docstring):
    pinned buffers, sub-groups kept in device memory within ``gpu_budget``, and [`run_pass`][], the
    pipeline that streams the others through device slots.

    What the store holds is kept right as on the CPU path: [`read`][] and [`flush`][] copy a
    sub-group kept on the device down first; [`write`][] and [`drop_resident`][] (a state dict or
    checkpoint rewrote the store) forget the device's copy, to be read again at the next pass.

    Args:
        store: as for `SubGroupStager`; its device runtime pins the buffers.
        namespace: as for `SubGroupStager`.
        device: the device the parameters (and so the update) are on.
        runtime: the device runtime (the store's: CUDA's, or a test's simulated device).
        gpu_budget: bytes of device memory for sub-groups kept there between passes (whole
            allocator blocks each); 0 to keep none.
        slot_elements: fp32 values of the largest sub-group (the size of each ring buffer and
            device slot).
        dram_budget: bytes of pinned host memory the stager holds: the ring (``prefetch_depth`` +
            [`DEVICE_SLOTS`][] buffers) and room for sub-groups kept there; None for the ring only.
        prefetch_depth: sub-groups read ahead of the ones the pipeline holds.
        cache_policy: which sub-groups stay in host memory between passes (``"model"``,
            ``"static"`` or ``"none"``).
        owner: who holds the namespace and the host memory, as the store reports them.

    Raises:
        ConfigError: as for `SubGroupStager`.
        CapacityError: ``dram_budget`` is below the ring, or does not fit the store's ledger.
        PinnedMemoryError: the ring could not be page-locked.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
    """

    PINNED = True
    RING_EXTRA = DEVICE_SLOTS

    def __init__(
        self,
        store: TierStore,
        namespace: str,
        *,
        device: torch.device,
        runtime: DeviceRuntime,
        gpu_budget: int,
        slot_elements: int,
        dram_budget: int | str | None,
        prefetch_depth: int,
        cache_policy: CachePolicy,
        owner: str,
    ) -> None:
        self.device = device
        self.runtime = runtime
        self.gpu_budget = gpu_budget
        self.on_device: dict[Hashable, torch.Tensor] = {}
        """Sub-groups whose state lives in device memory between passes (their store copy is
        stale)."""
        self._up = DeviceCopies(runtime)
        """Uploads: host buffer -> device, on their own copy stream."""
        self._down = DeviceCopies(runtime)
        """Downloads: device -> host buffer, on another (the bus moves both directions at once)."""
        self._device_keep: set[Hashable] = set()
        self._order: list[Hashable] = []
        """The pass's order on the device: the sub-groups kept there first."""
        with runtime.using(device):  # pinned for copies to this device
            super().__init__(
                store,
                namespace,
                slot_elements=slot_elements,
                dram_budget=dram_budget,
                prefetch_depth=prefetch_depth,
                cache_policy=cache_policy,
                reserved_bytes=0,  # the gradients stay on the device
                owner=owner,
            )

    @property
    def slot_device_bytes(self) -> int:
        """Device memory of the slots a pass streams sub-groups through, at most."""
        return DEVICE_SLOTS * device_bytes(self.slot_bytes)

    @property
    def device_kept_bytes(self) -> int:
        """Device memory the sub-groups kept there hold now (at most ``gpu_budget``)."""
        return sum(device_bytes(FP32 * state.numel()) for state in self.on_device.values())

    # -- a pass -------------------------------------------------------------------------------------
    def begin_pass(self, order: Sequence[Hashable], sizes: Mapping[Hashable, int]) -> None:
        """Start a pass over ``order``: choose the sub-groups kept on the device (the first that fit
        ``gpu_budget``, in the order ``sizes`` lists them, which stays the same from pass to pass),
        and read ahead the others, in ``order``. See `begin_pass`."""
        self._device_keep = self._plan_device({**self._sizes, **sizes})
        for name in [name for name in self.on_device if name not in self._device_keep]:
            self._write_out(name)  # sizes changed since it was chosen
            del self.on_device[name]
        listed = set(order)
        kept = [name for name in sizes if name in self._device_keep and name in listed]
        self._order = kept + [name for name in order if name not in self._device_keep]
        with self.runtime.using(self.device):  # a pool buffer read into is pinned for this device
            super().begin_pass([name for name in self._order if name not in self.on_device], sizes)

    def run_pass(self, update: Callable[[Hashable, torch.Tensor], object]) -> None:
        """Update every sub-group of the pass begun ([`begin_pass`][]) on the device, streaming
        those not kept there (see the module docstring); returns once every copy has ended and every
        host buffer is back with the stager. The kernels of the last sub-groups may still be running
        on the caller's stream, ordered before its later work.

        Args:
            update: called as ``update(name, state)`` on the caller's current stream
                ([`launch`][tierstore.device.DeviceRuntime.launch]), with the sub-group's fp32 state
                in device memory; it queues the kernels that update it in place and write the new
                weights into the parameters.
        """
        with self.runtime.using(self.device):
            compute = self.runtime.current_stream(self.device)
            pipeline = _Pipeline(self, compute, self._order)
            try:
                streamed = [name for name in self._order if name not in self.on_device]
                if streamed:  # up while the kernels of the sub-groups kept on the device run
                    pipeline.upload(streamed[0])
                for position, name in enumerate(self._order):
                    state = self.on_device.get(name)
                    if state is None:
                        state = pipeline.uploaded(name)
                    self.runtime.launch(compute, functools.partial(update, name, state), f"update {name}")
                    pipeline.updated(name)
                    following = self._order[position + 1] if position + 1 < len(self._order) else None
                    if following is not None and following not in self.on_device:
                        pipeline.upload(following)
                    pipeline.settle(block=False)
                pipeline.settle(block=True)
                self._up.reap()  # every upload ended before the downloads after it: let go of the slots
            except BaseException:
                pipeline.abandon()
                raise

    def empty(self, numel: int) -> torch.Tensor:
        """fp32 device memory of the calling thread's current stream, for kernels queued there.

        Args:
            numel: elements.

        Returns:
            An uninitialised 1-D tensor on the device.
        """
        with self.runtime.using(self.device):
            stream = self.runtime.current_stream(self.device)
            return self.runtime.empty((numel,), torch.float32, self.device, stream)

    def launch(self, work: Callable[[], object], name: str) -> None:
        """Queue ``work``'s kernels on the calling thread's current stream (see
        [`launch`][tierstore.device.DeviceRuntime.launch])."""
        with self.runtime.using(self.device):
            self.runtime.launch(self.runtime.current_stream(self.device), work, name)

    def synchronize(self) -> None:
        """Wait on this thread until the work queued on its current stream so far has run."""
        with self.runtime.using(self.device):
            self.runtime.synchronize(self.runtime.record(self.runtime.current_stream(self.device)))

    # -- outside a pass: the store holds what the device holds -------------------------------------
    def read(self, name: Hashable) -> torch.Tensor:
        """The sub-group's current state in host memory: copied down from the device if kept there,
        else as `read`."""
        state = self.on_device.get(name)
        if state is None:
            return super().read(name)
        host = torch.empty(state.shape, dtype=torch.float32)
        self._download_now(host, state)
        return host

    def flush(self) -> None:
        """Write every kept sub-group to the store, those kept on the device too (they stay there),
        and wait for every write."""
        super().flush()
        for name in self.on_device:
            self._write_out(name)

    def drop_resident(self) -> None:
        """Forget the copies kept in host memory and on the device (after the store was rewritten
        behind them)."""
        super().drop_resident()
        self._forget_device()

    def write(self, name: Hashable, elements: int, fill: Callable[[torch.Tensor], object]) -> None:
        """As `write`; a copy kept on the device is stale then and forgotten."""
        self.on_device.pop(name, None)
        with self.runtime.using(self.device):
            super().write(name, elements, fill)

    def grow(self, slot_elements: int, reserved_bytes: int) -> None:
        """As `grow`, the new ring pinned for the device."""
        with self.runtime.using(self.device):
            super().grow(slot_elements, reserved_bytes)

    def abandon(self) -> None:
        """As `abandon`, after every copy in flight has ended; the device's copies are let go of."""
        self._forget_device()
        super().abandon()

    # -- internals ------------------------------------------------------------------------------
    def _new_ring(self, slot_bytes: int) -> list[torch.Tensor]:
        """The ring, page-locked for copies to the device (on the device current: the
        constructor's)."""
        return [
            AlignedBuffer(slot_bytes, pin=True, runtime=self.runtime).view(slot_bytes).view(torch.float32)
            for _ in range(self.ring_size)
        ]

    def _plan_device(self, sizes: Mapping[Hashable, int]) -> set[Hashable]:
        """The sub-groups kept on the device: each, in order, that fits beside those taken."""
        room, keep = self.gpu_budget, set()
        for name, elements in sizes.items():
            nbytes = device_bytes(FP32 * elements)
            if nbytes <= room:
                keep.add(name)
                room -= nbytes
        return keep

    def _download_now(self, host: torch.Tensor, state: torch.Tensor) -> None:
        """Copy ``state`` (device) into ``host`` after the work queued on the caller's stream, and
        wait for it."""
        with self.runtime.using(self.device):
            self._down.wait(self._down.copy(host, state, self._down.caller(self.device)))

    def _write_out(self, name: Hashable) -> None:
        """Write a sub-group kept on the device to the store, through a free host buffer (outside a
        pass), and wait for it."""
        state = self.on_device[name]
        buffer = self._take_blocking(name)
        try:
            host = buffer[: state.numel()]
            self._download_now(host, state)
            self.store.put(self.key(name), host, cache=False).result()
        finally:
            self._give_back(buffer)

    def _forget_device(self) -> None:
        """Wait for every copy in flight, then let go of the device's copies."""
        self._up.close()
        self._down.close()
        self.on_device.clear()


class _Pipeline:
    """One pass's copies (see [`DeviceStager`][]): the device memory it streams through, the
    sub-groups uploaded and not yet updated, and the copies whose end the host still has to act on,
    oldest first.

    Its device memory is allocated at once, before the pass's first kernel, on the caller's stream,
    which then records the event every first upload into it waits for (the allocator may have handed
    out memory that kernels queued before still read): the slots, as many as the streamed sub-groups
    need up to [`DEVICE_SLOTS`][], and the memory of each sub-group to keep on the device that is
    not there yet.

    Args:
        stager: the stager whose pass it is.
        compute: the caller's current stream, where the updates run.
        order: the pass's sub-groups, in order.
    """

    def __init__(self, stager: DeviceStager, compute: object, order: list[Hashable]) -> None:
        self.stager = stager
        self.compute = compute
        streamed = [name for name in order if name not in stager.on_device]
        runtime, device = stager.runtime, stager.device

        def allocate(numel: int) -> torch.Tensor:
            return runtime.empty((numel,), torch.float32, device, compute)

        self.to_keep = {
            name: allocate(stager._sizes[name]) for name in streamed if name in stager._device_keep
        }
        """Memory of the sub-groups to keep on the device, until their upload."""
        slots = [
            allocate(stager.slot_bytes // FP32)
            for _ in range(min(DEVICE_SLOTS, len(streamed) - len(self.to_keep)))
        ]
        self.allocated: object | None = runtime.record(compute) if streamed else None
        """Recorded on the caller's stream after the allocations: the first upload into each waits
        for it."""
        self.free_slots: deque[tuple[torch.Tensor, object | None]] = deque(
            (slot, self.allocated) for slot in slots
        )
        """Slots for uploads, oldest free first, each with the event its upload waits for: the
        allocation's, then the end of the download that emptied it."""
        self.uploaded_to: dict[
            Hashable, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Transfer]
        ] = {}
        """Sub-groups uploaded and not yet updated: their state on the device, their slot (None:
        memory of their own, kept on the device), their host buffer and the upload."""
        self.pending: deque[tuple[Hashable, Transfer, bool]] = deque()
        """Copies the host acts on once they end, in order: (sub-group, transfer, whether it is the
        upload of a sub-group now kept on the device, whose host buffer goes back unwritten)."""

    def upload(self, name: Hashable) -> None:
        """Queue ``name``'s upload (if not queued yet): its state from the store into a host buffer,
        holding at most [`DEVICE_SLOTS`][] of them (waiting for the oldest copies to end first),
        then to a free slot, or to its own memory for a sub-group to keep on the device."""
        if name in self.uploaded_to:
            return
        stager = self.stager
        while len(stager.held) >= DEVICE_SLOTS and self.pending:
            self.settle(block=True, count=1)
        host = stager.acquire(name)
        kept = self.to_keep.pop(name, None)
        if kept is not None:
            target, slot, ready = kept, None, self.allocated
        else:
            slot, ready = self.free_slots.popleft()
            target = slot[: host.numel()]
        assert ready is not None  # recorded at the allocation
        transfer = stager._up.copy(target, host, CallerStream(stager.device, self.compute, ready))
        self.uploaded_to[name] = (target, slot, host, transfer)
        if slot is None:
            self.pending.append((name, transfer, True))

    def uploaded(self, name: Hashable) -> torch.Tensor:
        """``name``'s state on the device, its upload queued (now if not yet), and the caller's
        stream made to wait for the upload: call it right before queueing ``name``'s kernels, so
        that the kernels queued before them do not wait too."""
        self.upload(name)
        target, _, _, transfer = self.uploaded_to[name]
        self.stager.runtime.wait(self.compute, transfer.end)
        return target

    def updated(self, name: Hashable) -> None:
        """``name``'s kernels are queued: a streamed sub-group's download follows them, and its slot
        is free for an upload that waits for the download's end; one to keep stays on the device."""
        placed = self.uploaded_to.pop(name, None)
        if placed is None:
            return  # kept on the device from an earlier pass
        state, slot, host, _ = placed
        stager = self.stager
        if slot is None:
            stager.on_device[name] = state
            return
        transfer = stager._down.copy(host, state, stager._down.caller(stager.device))
        self.free_slots.append((slot, transfer.end))
        self.pending.append((name, transfer, False))

    def settle(self, *, block: bool, count: int | None = None) -> None:
        """Act on ended copies, oldest first: a download's sub-group goes back to the stager (kept
        or written back), an upload to the device gives its host buffer back unwritten.

        Args:
            block: wait for the oldest copies to end (else act only on those that have).
            count: at most this many (default all).
        """
        stager = self.stager
        done = 0
        while self.pending and (count is None or done < count):
            name, transfer, to_device = self.pending[0]
            copies = stager._up if to_device else stager._down
            if not block and not stager.runtime.query(transfer.end):
                return
            copies.wait(transfer)
            self.pending.popleft()
            if to_device:
                stager.discard(name)
            else:
                stager.release(name)
            done += 1

    def abandon(self) -> None:
        """After a failure: wait for every copy, and give every held host buffer back unwritten."""
        stager = self.stager
        stager._up.close()
        stager._down.close()
        for name in stager.held:
            stager.discard(name)
