"""Spill the tensors autograd saves in forward to a TierStore, and stage them back for backward.

The mechanism is :func:`torch.autograd.graph.saved_tensors_hooks`: ``pack`` runs in forward for
every tensor an operation saves and returns a handle; ``unpack`` runs in backward and returns the
tensor. On top of it, SSDTrain's mechanics:

* parameters and views of them are never spilled (``nn.Linear`` saves ``weight.t()``, a view);
  tensors under ``min_bytes`` stay in memory;
* the spill unit is a *storage*: several saved views of one storage (``q``, ``k``, ``v`` of one
  projection) are written once (deduplication, by storage object, never by address, since
  addresses are reused within a step);
* writes are asynchronous: forward goes on at once and the offloader lets go of the memory when
  the write completes; forward waits only when the resident bytes would exceed ``budget``;
* backward reads back in its own order, as far ahead as ``budget`` allows (prefetch), and a tensor
  whose write has not finished is handed back without a read (forwarding);
* each spilled object lives exactly as long as autograd's handles to it: it is deleted once the
  graph frees them, after backward or when a failed step's graph is dropped.

TERAIO's lifetime-aware plan (``plan="lifetime"``): the first steps spill everything and profile
each saved tensor's size, save time and first use (two steps saving the same sequence: the first
one warms up); :func:`tierstore.model.plan_spill` then decides
which to keep in memory (the short-lived ones of the last layers) by replaying the step under this
very policy with the tier's measured bandwidths. The plan is reused while the sequence of saved
tensors stays the same and rebuilt from a fresh profile when it changes.

On CUDA, copies go device -> pinned host buffer -> tier on a side stream, ordered after the compute
stream with events, and back the same way; the compute stream never waits on the host.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import torch
from torch import nn

from ..buffers import AlignedBuffer, BufferPool
from ..config import parse_byte_size
from ..errors import ConfigError, StoreClosedError
from ..model import PathSpeed, SavedTensor, SpillPlan, plan_spill
from ..store import TierStore

Plan = Literal["lifetime", "all", "none"]
PLANS = ("lifetime", "all", "none")


@dataclass(eq=False)
class _Step:
    """One forward (one ``with`` block) and the backward that consumes it."""

    number: int
    started: float
    following: SpillPlan | None
    """The plan this step executes; None while it profiles (spilling everything)."""
    entries: list[_Entry] = field(default_factory=list)
    by_storage: dict[int, _Entry] = field(default_factory=dict)
    read_order: list[_Entry] = field(default_factory=list)
    cursor: int = 0
    stalls: float = 0.0
    """Seconds this step waited for writes and reads: taken out of its profiled timeline."""
    forward_done: bool = False
    last_use: float = 0.0

    def now(self) -> float:
        """Compute seconds since the step started (stalls excluded)."""
        return time.perf_counter() - self.started - self.stalls

    def profiled(self) -> bool:
        """Backward has used (or autograd has freed) every saved tensor."""
        return self.forward_done and all(e.used_at is not None or e.dead for e in self.entries)


@dataclass(eq=False)
class _Entry:
    """One saved storage of one step: resident, being written, spilled, or being read back."""

    step: _Step
    index: int
    key: str
    nbytes: int
    dtype: torch.dtype
    device: torch.device
    storage: weakref.ref[torch.UntypedStorage]
    version: int
    spill: bool
    data: torch.Tensor | None
    """uint8 tensor over the bytes while the offloader holds them in memory."""
    alias: torch.Tensor | None
    """A detached alias of the saved tensor while it is resident: shares its version counter."""
    saved_at: float
    used_at: float | None = None
    handles: int = 0
    unpacked: set[int] = field(default_factory=set)
    writing: bool = False
    claimed: bool = False
    """Backward asked for it before its write ended: it stays resident instead of being read."""
    written: bool = False
    reading: Future[torch.Tensor] | None = None
    staging: AlignedBuffer | None = None
    counted: bool = False
    """Its bytes are in the resident total."""
    dead: bool = False
    error: BaseException | None = None


class _Handle:
    """What autograd keeps for one saved tensor: how to rebuild it from its entry's bytes."""

    __slots__ = (
        "__weakref__",
        "alias",
        "dtype",
        "entry",
        "offset",
        "size",
        "stride",
        "tensor",
        "type_name",
        "version",
    )

    def __init__(self, tensor: torch.Tensor, entry: _Entry | None) -> None:
        self.entry = entry
        self.dtype = tensor.dtype
        self.size = tuple(tensor.shape)
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()
        self.version = tensor._version
        self.type_name = tensor.type()
        self.tensor = weakref.ref(tensor)
        """While the saved tensor lives, an in-place change to it must fail backward."""
        self.alias = tensor.detach() if entry is None else None
        """Tensors kept outside any entry (small ones, parameters) are held here."""

    def current_version(self, entry: _Entry | None) -> int:
        alias = self.alias if entry is None else entry.alias
        if alias is not None:
            return alias._version
        tensor = self.tensor()
        return self.version if tensor is None else tensor._version

    def check_version(self, entry: _Entry | None) -> None:
        """Raise as autograd does when a saved tensor was modified in place (with hooks active,
        autograd no longer checks by itself)."""
        current = self.current_version(entry)
        if current != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.type_name} {list(self.size)}] is at version {current}; "
                f"expected version {self.version} instead (detected by tierstore.activations)"
            )


class ActivationOffload:
    """Offload the activations saved during a forward pass to ``store`` (see the module docstring).

    ``budget``: bytes of saved tensors (of at least ``min_bytes``) the offloader may hold in memory
    at once: being written, kept by the plan, or read back ahead of backward. ``plan``:
    ``"lifetime"`` (profile, then keep what cannot be hidden), ``"all"`` (spill every eligible
    tensor) or ``"none"`` (keep everything: the hooks only count). Use it as a context manager
    around forward; backward may run after the block.
    """

    def __init__(
        self,
        store: TierStore,
        budget: int | str = "512MiB",
        min_bytes: int | str = "1MiB",
        plan: Plan = "lifetime",
        *,
        namespace: str = "activations",
    ) -> None:
        self.store = store
        self.budget = _size("budget", budget)
        self.min_bytes = _size("min_bytes", min_bytes)
        if plan not in PLANS:
            raise ConfigError(f"plan: must be one of {', '.join(map(repr, PLANS))}, not {plan!r}")
        self.plan_mode: Plan = plan
        self.namespace = namespace
        self._reservation = store.memory.reserve(f"activations {namespace}", self.budget)
        weakref.finalize(self, store.memory.release, self._reservation)
        self._serials = itertools.count()
        self._steps = itertools.count(1)
        self._cond = threading.Condition()
        self._resident = 0
        self._writes_in_flight = 0
        self._reads: set[Future[torch.Tensor]] = set()
        self._plan: SpillPlan | None = None
        self._plan_signature: list[tuple[int, torch.dtype]] = []
        self._profiled: _Step | None = None
        """The step the current plan was built from."""
        self._profiling: _Step | None = None
        """The latest step that ran without a plan, to build the next plan from."""
        self._previous_profile: _Step | None = None
        self._active: _Step | None = None
        self._live: list[_Step] = []
        """Steps some of whose saved tensors autograd may still hold."""
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tierstore-activations")
        self._staging = BufferPool(self.budget, pin=torch.cuda.is_available())
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._closed = False
        self._stats: dict[str, float] = {
            "steps": 0,
            "peak_resident_bytes": 0,
            "step_peak_resident_bytes": 0,
            "step_saved_bytes": 0,
            "spilled_bytes": 0,
            "spilled_tensors": 0,
            "read_bytes": 0,
            "read_stall_s": 0.0,
            "write_stall_s": 0.0,
            "kept_bytes": 0,
            "small_bytes": 0,
            "parameter_bytes": 0,
            "deduplicated_bytes": 0,
            "forwarded_bytes": 0,
            "deleted_objects": 0,
            "write_errors": 0,
            "plans_built": 0,
        }

    # -- the forward block ------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._closed:
            raise ConfigError("this ActivationOffload is closed")
        if self._active is not None:
            raise ConfigError("ActivationOffload blocks do not nest")
        self._maybe_replan()
        self._active = _Step(next(self._steps), time.perf_counter(), self._plan)
        with self._cond:
            self._stats["steps"] += 1
            self._stats["step_peak_resident_bytes"] = self._resident
            self._stats["step_saved_bytes"] = 0
            self._live = [s for s in self._live if not all(e.dead for e in s.entries)]
            self._live.append(self._active)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._hooks is not None and self._active is not None
        self._hooks.__exit__(kind, error, traceback)
        step, self._active, self._hooks = self._active, None, None
        with self._cond:
            if step.following is not None and len(step.entries) != len(self._plan_signature):
                step.following = None  # fewer saved tensors than planned: this step profiles
            if step.following is None and kind is None:
                self._profiling = step
            step.forward_done = True
            spilled = [e for e in step.entries if e.spill]
            if step.following is None:
                step.read_order = spilled[::-1]
            else:
                step.read_order = [step.entries[i] for i in step.following.use_order]
            if kind is None:
                self._issue_reads(step)

    # -- public -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since creation: bytes spilled, read back, kept, deduplicated, forwarded; the
        peak of resident saved bytes; seconds forward waited on writes and backward on reads. The
        ``step_`` ones cover the latest step: its peak, and the bytes of the storages it saved
        (what keeping everything in memory would hold at the end of its forward)."""
        with self._cond:
            stats: dict[str, Any] = dict(self._stats)
            stats["resident_bytes"] = self._resident
            stats["budget_bytes"] = self.budget
            stats["plan"] = self.plan_mode
            if self._plan is not None:
                stats["predicted_step_s"] = self._plan.predicted_seconds
                stats["planned_keep_bytes"] = sum(self._plan_signature[i][0] for i in self._plan.keep)
            return stats

    def plan_explain(self) -> str:
        """Which saved tensors are kept in memory and which are spilled, and why."""
        if self.plan_mode == "none":
            return "plan 'none': every saved tensor stays in memory; the hooks only count bytes"
        rule = (
            f"tensors under {self.min_bytes} bytes and parameters (or views of them) always stay in "
            "memory; one storage saved several times is spilled once"
        )
        if self.plan_mode == "all":
            return f"plan 'all': every other saved tensor is spilled and read back in reverse order; {rule}"
        if self._plan is None or self._profiled is None:
            return (
                f"plan 'lifetime': no plan yet, the first two steps profile while spilling everything; {rule}"
            )
        lines = [f"plan 'lifetime', built from step {self._profiled.number}; {rule}", self._plan.explain()]
        for entry in self._profiled.entries:
            used = entry.used_at if entry.used_at is not None else float("nan")
            decision = "spill" if entry.index in self._plan.spill else "keep (lifetime too short to hide I/O)"
            lines.append(
                f"  #{entry.index:<4} {entry.nbytes / 2**20:9.2f} MiB {entry.dtype!s:15} saved at "
                f"{entry.saved_at * 1e3:8.1f} ms, used at {used * 1e3:8.1f} ms: {decision}"
            )
        return "\n".join(lines)

    def synchronize(self) -> None:
        """Wait for every write, read and deletion this offloader has started."""
        with self._cond:
            self._cond.wait_for(lambda: self._writes_in_flight == 0)
            reads = list(self._reads)
        for future in reads:
            future.exception()
        self._background.submit(lambda: None).result()

    def reset(self) -> None:
        """Let go of every saved tensor of earlier steps now: objects deleted, memory freed.

        For after a step raised in backward: PyTorch keeps a failed backward's graph, and with it
        the saved tensors' handles, until that thread's next backward. A later use of a tensor
        let go of raises instead of returning stale data.
        """
        with self._cond:
            for step in self._live:
                for entry in step.entries:
                    if entry.dead:
                        continue
                    entry.dead = True
                    entry.error = RuntimeError("it was let go of by ActivationOffload.reset()")
                    self._drop_data(entry)
                    if not entry.writing:
                        self._delete(entry)
            self._live.clear()

    def close(self) -> None:
        """Finish background work and free the staging buffers (the store stays open)."""
        if self._closed:
            return
        self.reset()
        self.synchronize()
        self._background.shutdown(wait=True)
        self._staging.clear()
        self.store.memory.release(self._reservation)
        self._closed = True

    # -- hooks ------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> _Handle:
        step = self._active
        assert step is not None
        if not _spillable(tensor):
            if _is_parameter(tensor):
                self._add("parameter_bytes", tensor.untyped_storage().nbytes())
            return _Handle(tensor, None)
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if self.plan_mode == "none" or nbytes < self.min_bytes:
            self._add("kept_bytes" if self.plan_mode == "none" else "small_bytes", nbytes)
            return _Handle(tensor, None)
        with self._cond:
            entry = step.by_storage.get(storage._cdata)
            if entry is not None and entry.storage() is storage and entry.version == tensor._version:
                self._stats["deduplicated_bytes"] += nbytes
            else:
                entry = self._admit(step, tensor, storage)
            entry.handles += 1
        handle = _Handle(tensor, entry)
        weakref.finalize(handle, self._handle_gone, entry, id(handle)).atexit = False
        return handle

    def _unpack(self, handle: _Handle) -> torch.Tensor:
        entry = handle.entry
        if entry is None:
            handle.check_version(None)
            assert handle.alias is not None
            return handle.alias
        data = self._data_for(entry, handle)
        restored = torch.empty(0, dtype=handle.dtype, device=entry.device)
        restored.set_(data.untyped_storage(), handle.offset, handle.size, handle.stride)
        with self._cond:
            entry.unpacked.add(id(handle))
            if len(entry.unpacked) >= entry.handles:  # every handle served: let go of the bytes
                self._drop_data(entry)
            step = entry.step
            if entry.used_at is None:
                entry.used_at = step.last_use = step.now()
            self._issue_reads(step)
        return restored

    # -- forward: admitting and writing -----------------------------------------------------------
    def _admit(self, step: _Step, tensor: torch.Tensor, storage: torch.UntypedStorage) -> _Entry:
        """A new entry for ``storage`` (under the lock): kept or spilled as the plan says."""
        nbytes = storage.nbytes()
        if nbytes > self.budget:
            raise ConfigError(
                f"budget: {self.budget} bytes cannot hold one saved tensor of {nbytes} bytes "
                f"({tensor.type()} {list(tensor.shape)}); raise budget, or min_bytes above it"
            )
        index = len(step.entries)
        plan = step.following
        if plan is not None and (
            index >= len(self._plan_signature) or self._plan_signature[index] != (nbytes, tensor.dtype)
        ):
            step.following = plan = None  # the saved sequence changed: this step profiles
        spill = plan is None or index in plan.spill
        stalled = time.perf_counter()
        while self._resident + nbytes > self.budget and self._writes_in_flight:
            self._cond.wait()
        waited = time.perf_counter() - stalled
        self._stats["write_stall_s"] += waited
        step.stalls += waited
        entry = _Entry(
            step=step,
            index=index,
            key=f"{self.namespace}/{next(self._serials)}",
            nbytes=nbytes,
            dtype=tensor.dtype,
            device=tensor.device,
            storage=weakref.ref(storage),
            version=tensor._version,
            spill=spill,
            data=torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage),
            alias=tensor.detach(),
            saved_at=step.now(),
        )
        step.entries.append(entry)
        step.by_storage[storage._cdata] = entry
        self._stats["step_saved_bytes"] += nbytes
        entry.counted = True
        self._occupy(nbytes)
        if spill:
            self._start_write(entry)
        else:
            self._stats["kept_bytes"] += nbytes
        return entry

    def _start_write(self, entry: _Entry) -> None:
        assert entry.data is not None
        entry.writing = True
        self._writes_in_flight += 1
        self._stats["spilled_bytes"] += entry.nbytes
        self._stats["spilled_tensors"] += 1
        if entry.device.type == "cuda":
            buffer, copied = self._to_host(entry.data)
            self._background.submit(self._write_staged, entry, buffer, copied)
            return
        future = self.store.put(entry.key, entry.data, scratch=True)
        future.add_done_callback(lambda done: self._write_done(entry, done.exception()))

    def _write_staged(self, entry: _Entry, buffer: AlignedBuffer, copied: torch.cuda.Event) -> None:
        """Background: once the device-to-host copy is done, start writing the pinned buffer. The
        buffer goes back to the pool before the offloader's lock is taken: a pack may be waiting
        for it while holding that lock."""

        def written(error: BaseException | None) -> None:
            self._staging.release(buffer)
            self._write_done(entry, error)

        try:
            copied.synchronize()
            future = self.store.put(entry.key, buffer.view(entry.nbytes), scratch=True)
        except BaseException as error:
            written(error)
            return
        future.add_done_callback(lambda done: written(done.exception()))

    def _write_done(self, entry: _Entry, error: BaseException | None) -> None:
        with self._cond:
            entry.writing = False
            self._writes_in_flight -= 1
            if error is not None:  # the bytes stay in memory: backward still gets them
                entry.error = error
                self._stats["write_errors"] += 1
            else:
                entry.written = True
                if entry.dead:
                    self._delete(entry)
                elif not entry.claimed:
                    self._drop_data(entry)
            self._cond.notify_all()

    # -- backward: reading back -------------------------------------------------------------------
    def _issue_reads(self, step: _Step, force: bool = False) -> None:
        """Start reads in backward's order for as many spilled tensors as the budget holds (under
        the lock); one still being written stays resident instead. ``force``: the next read
        starts even over budget (nothing else can free room)."""
        while step.cursor < len(step.read_order):
            entry = step.read_order[step.cursor]
            if entry.dead or entry.used_at is not None or entry.reading is not None:
                pass
            elif entry.data is not None:
                entry.claimed = True
            elif entry.written and (force or self._resident + entry.nbytes <= self.budget):
                self._start_read(entry)
                force = False
            else:
                return
            step.cursor += 1

    def _start_read(self, entry: _Entry) -> None:
        self._stats["read_bytes"] += entry.nbytes
        entry.counted = True
        self._occupy(entry.nbytes)
        if entry.device.type == "cuda":
            entry.staging = buffer = self._pinned(entry.nbytes)
            destination = buffer.view(entry.nbytes)
        else:
            destination = torch.empty(entry.nbytes, dtype=torch.uint8)
        reading = entry.reading = self.store.get(entry.key, out=destination, cache=False)
        self._reads.add(reading)
        reading.add_done_callback(self._reads.discard)

    def _data_for(self, entry: _Entry, handle: _Handle) -> torch.Tensor:
        """The entry's bytes for ``handle``: forwarded, prefetched, or read now (a stall)."""
        with self._cond:
            handle.check_version(entry)
            if entry.error is not None:
                raise RuntimeError(
                    f"saved tensor {handle.type_name} {list(handle.size)} was not spilled: {entry.error}"
                ) from entry.error
            if entry.data is not None:
                if entry.spill:
                    self._stats["forwarded_bytes"] += entry.nbytes
                return entry.data
            stalled = time.perf_counter()
            while entry.reading is None:
                if self._writes_in_flight:
                    self._cond.wait()
                    self._issue_reads(entry.step)
                else:
                    self._issue_reads(entry.step, force=True)
                    if entry.reading is None:  # behind the cursor (used out of order): read now
                        self._start_read(entry)
            reading = entry.reading
        data = reading.result()
        waited = time.perf_counter() - stalled
        if entry.device.type == "cuda":
            assert entry.staging is not None
            data = self._to_device(entry.staging, entry.nbytes, entry.device)
            entry.staging = None
        with self._cond:
            self._stats["read_stall_s"] += waited
            entry.step.stalls += waited
            if not entry.dead:
                entry.data = data
        return data

    # -- lifetimes --------------------------------------------------------------------------------
    def _handle_gone(self, entry: _Entry, handle_id: int) -> None:
        """Autograd freed a handle; the last one takes the entry's memory and object with it."""
        with self._cond:
            entry.handles -= 1
            entry.unpacked.discard(handle_id)
            if entry.handles > 0:
                return
            entry.dead = True
            self._drop_data(entry)
            if entry.staging is not None and entry.reading is not None:
                staging, entry.staging = entry.staging, None
                entry.reading.add_done_callback(lambda _: self._staging.release(staging))
            if not entry.writing:
                self._delete(entry)

    def _delete(self, entry: _Entry) -> None:
        """Delete the entry's store object in the background (under the lock)."""
        if not entry.written:
            return
        entry.written = False
        self._stats["deleted_objects"] += 1
        reading, entry.reading = entry.reading, None

        def delete() -> None:
            if reading is not None:
                reading.exception()
            with contextlib.suppress(StoreClosedError):  # a closed store has let go of it already
                self.store.delete(entry.key)

        # Closed, or the interpreter is exiting: a scratch store deletes its objects when it
        # closes, and a persistent one collects scratch objects when it next opens.
        with contextlib.suppress(RuntimeError):
            if not self._closed:
                self._background.submit(delete)

    def _occupy(self, nbytes: int) -> None:
        self._resident += nbytes
        self._stats["peak_resident_bytes"] = max(self._stats["peak_resident_bytes"], self._resident)
        self._stats["step_peak_resident_bytes"] = max(self._stats["step_peak_resident_bytes"], self._resident)

    def _drop_data(self, entry: _Entry) -> None:
        entry.data = entry.alias = None
        if entry.counted:
            entry.counted = False
            self._resident -= entry.nbytes
            self._cond.notify_all()

    def _add(self, counter: str, nbytes: int) -> None:
        with self._cond:
            self._stats[counter] += nbytes

    # -- the plan ---------------------------------------------------------------------------------
    def _maybe_replan(self) -> None:
        """Build a plan from the last step that ran without one, once its backward is done and the
        step before it saved the same sequence: the first step of a sequence warms allocators and
        kernels up, and two alike show the sequence is stable enough to plan for."""
        with self._cond:
            profiled, previous = self._profiling, self._previous_profile
            if self.plan_mode != "lifetime" or profiled is None or not profiled.profiled():
                return
            self._profiling = None
            self._previous_profile = profiled
            if previous is None or _signature(previous) != _signature(profiled):
                return
        tensors = [
            SavedTensor(e.nbytes, e.saved_at, e.used_at if e.used_at is not None else profiled.last_use)
            for e in profiled.entries
        ]
        plan = plan_spill(self._path_speeds(), self.budget, tensors, profiled.last_use)
        with self._cond:
            self._plan = plan
            self._plan_signature = _signature(profiled)
            self._profiled = profiled
            self._stats["plans_built"] += 1

    def _path_speeds(self) -> list[PathSpeed]:
        """The first tier's paths as the store measures them."""
        speeds: list[PathSpeed] = next(iter(self.store.bandwidths().values()), [])
        if not speeds:
            raise ConfigError("the store's first tier has no bandwidth estimate to plan with yet")
        return speeds

    # -- CUDA -------------------------------------------------------------------------------------
    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _pinned(self, nbytes: int) -> AlignedBuffer:
        """A pinned staging buffer; the pool is as large as the budget, which bounds the bytes in
        flight, so a wait here is short: buffers return as background copies finish."""
        while True:
            buffer = self._staging.try_acquire(nbytes)
            if buffer is not None:
                return buffer
            time.sleep(0.001)

    def _to_host(self, data: torch.Tensor) -> tuple[AlignedBuffer, torch.cuda.Event]:
        """Start copying device bytes into a pinned buffer on the side stream, after the work the
        compute stream has queued so far; the event marks the copy's end."""
        buffer = self._pinned(data.numel())
        stream = self._side_stream(data.device)
        stream.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(stream):
            buffer.view(data.numel()).copy_(data, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(stream)
        return buffer, copied

    def _to_device(self, buffer: AlignedBuffer, nbytes: int, device: torch.device) -> torch.Tensor:
        """Copy a pinned buffer into a new device tensor on the side stream. The tensor belongs to
        the compute stream (allocated there), which waits for the copy with an event; the buffer
        returns to the pool in the background once the copy is done."""
        compute = torch.cuda.current_stream(device)
        restored = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = self._side_stream(device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            restored.copy_(buffer.view(nbytes), non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(stream)
        compute.wait_event(copied)

        def release() -> None:
            copied.synchronize()
            self._staging.release(buffer)

        self._background.submit(release)
        return restored


def _size(name: str, value: int | str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: a size in bytes or a string such as '512MiB', not {value!r}")
    try:
        size = parse_byte_size(value)
    except ConfigError as error:
        raise ConfigError(f"{name}: {error}") from None
    if size < 0:
        raise ConfigError(f"{name}: must be >= 0, got {value!r}")
    return size


def _signature(step: _Step) -> list[tuple[int, torch.dtype]]:
    """What a plan depends on: the sizes and dtypes of the saved storages, in save order."""
    return [(entry.nbytes, entry.dtype) for entry in step.entries]


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter)


def _spillable(tensor: torch.Tensor) -> bool:
    """Dense CPU or CUDA tensors that are not parameters (nor views of them)."""
    return (
        tensor.layout == torch.strided
        and tensor.device.type in ("cpu", "cuda")
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not _is_parameter(tensor)
    )
