"""Spill the tensors autograd saves in forward to a TierStore, and stage them back for backward.

The mechanism is :func:`torch.autograd.graph.saved_tensors_hooks`: ``pack`` runs in forward for
every tensor an operation saves and returns a handle; ``unpack`` runs in backward and returns the
tensor. On top of it, SSDTrain's mechanics:

* parameters and views of them are never spilled (``nn.Linear`` saves ``weight.t()``, a view);
  tensors under ``min_bytes`` stay in memory;
* at the save, the bytes the tensor covers are copied into the offloader's memory (a *capture*,
  :mod:`.layout`), so what backward gets is exactly what was saved, whatever forward writes into
  the storage afterwards; two saves of the same bytes share one capture and are spilled once;
* all memory the offloader uses, captures being written and bytes read back, is lent from one
  pool of ``budget`` bytes, page-aligned so the store reads and writes it with O_DIRECT as it is,
  and reused from step to step; a tensor rebuilt for backward shares its pool memory, which
  returns to the pool when autograd lets go of the tensor. The process holds ``budget`` for
  saved activations, and nothing that grows with the spilled bytes;
* writes are asynchronous: forward goes on at once and the capture returns to the pool when the
  write completes; forward waits only while the pool is full and writes are in flight;
* backward reads back in its own order, as far ahead as the pool allows (prefetch), and a tensor
  whose write has not finished is handed back without a read (forwarding). When backward needs a
  tensor out of that order, room is made by dropping read-ahead, or by waiting for reads and
  writes in flight, never by going over the budget;
* each spilled object lives exactly as long as autograd's handles to it (a retained graph reads
  it again): it is deleted once the graph frees them, after backward or when a failed step's
  graph is dropped.

Only when none of that can make room, because tensors rebuilt earlier are still held outside the
offloader (``autograd.grad(..., create_graph=True)`` keeps every one of them for the second
backward), does a read go to ordinary memory, or a save stay where it is, instead of waiting for
ever; ``stats()["overflow_bytes"]`` counts those bytes.

TERAIO's lifetime-aware plan (``plan="lifetime"``): the first steps spill everything and profile
each saved tensor's size, save time and first use (two steps saving the same sequence: the first
one warms up); :func:`tierstore.model.plan_spill` then decides which to keep in memory (the
short-lived ones of the last layers) by replaying the step with the tier's measured bandwidths.
The plan is reused while the sequence of saved tensors stays the same and rebuilt from a fresh
profile when it changes.

On CUDA the pool is pinned and the copies between device and host run on a side stream
(:mod:`.cuda`); the compute stream never waits on the host.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import torch
from torch import nn

from ..buffers import BufferPool, Lease
from ..config import parse_byte_size
from ..errors import ConfigError, StoreClosedError
from ..model import PathSpeed, SavedTensor, SpillPlan, plan_spill
from ..store import TierStore
from .cuda import DeviceCopies
from .layout import Capture, View, capture_of, copy_out, rebuild, view_of

Plan = Literal["lifetime", "all", "none"]
PLANS = ("lifetime", "all", "none")
OUT_OF_ROOM_WAIT_S = 0.05
"""How long a save or a read waits for memory that nothing in flight will free (tensors rebuilt
earlier and still held) before it overflows to ordinary memory instead."""


@dataclass(eq=False)
class _Step:
    """One forward (one ``with`` block) and the backward that consumes it."""

    number: int
    started: float
    following: SpillPlan | None
    """The plan this step executes; None while it profiles (spilling everything)."""
    entries: list[_Entry] = field(default_factory=list)
    captures: dict[tuple[object, ...], _Entry] = field(default_factory=dict)
    """Live entries by storage and capture identity, to share one capture between saves."""
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
    """One capture of one step: in memory, being written, spilled, or being read back."""

    step: _Step
    index: int
    key: str
    capture: Capture
    dtype: torch.dtype
    device: torch.device
    storage: weakref.ref[torch.UntypedStorage]
    spill: bool
    """Written to the store; otherwise kept in memory until autograd frees it (the plan's keep)."""
    saved_at: float
    data: torch.Tensor | None = None
    """The captured bytes (uint8, pool memory) while the offloader holds them."""
    io: torch.Tensor | None = None
    """The same bytes for the store's reads and writes (a :class:`~tierstore.buffers.Lease`'s)."""
    copied: torch.cuda.Event | None = None
    """CUDA: the end of the device-to-host copy into ``data``."""
    used_at: float | None = None
    handles: int = 0
    unpacked: set[int] = field(default_factory=set)
    writing: bool = False
    written: bool = False
    """The store holds the object (until deleted)."""
    reading: bool = False
    read_back: bool = False
    """Its bytes have been read from the store at least once."""
    read_ahead: bool = False
    """``data`` was read back before backward asked for it (it may be dropped to make room)."""
    claimed: bool = False
    """Backward reached it while its write was in flight: the capture stays to be handed back."""
    dead: bool = False
    error: BaseException | None = None


class _Handle:
    """What autograd keeps for one saved tensor: its entry, or the tensor itself (``alias``)."""

    __slots__ = ("__weakref__", "alias", "dtype", "entry", "size", "tensor", "type_name", "version", "view")

    def __init__(self, tensor: torch.Tensor, entry: _Entry | None = None, view: View | None = None) -> None:
        self.entry = entry
        self.view = view
        self.dtype = tensor.dtype
        self.size = list(tensor.shape)
        self.version = tensor._version
        self.type_name = tensor.type()
        self.tensor = weakref.ref(tensor)
        """While the saved tensor lives, an in-place change to it must fail backward."""
        self.alias = tensor.detach() if entry is None else None
        """Tensors kept as they are (small ones, parameters) are held here."""

    def check_version(self) -> None:
        """Raise as autograd does when a saved tensor was modified in place (with hooks active,
        autograd no longer checks by itself)."""
        tensor = self.alias if self.alias is not None else self.tensor()
        current = self.version if tensor is None else tensor._version
        if current != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.type_name} {self.size}] is at version {current}; "
                f"expected version {self.version} instead (detected by tierstore.activations)"
            )


class ActivationOffload:
    """Offload the activations saved during a forward pass to ``store`` (see the module docstring).

    Use it as a context manager around forward; backward may run after the block.

    ``budget``: bytes of memory for saved tensors of at least ``min_bytes``: captures being
    written, tensors the plan keeps, and bytes read back ahead of backward or being used by it;
    reserved from the store's memory ledger. ``min_bytes``: smaller saved tensors stay in memory
    as autograd keeps them. ``plan``: ``"lifetime"`` (profile, then keep what cannot be hidden),
    ``"all"`` (spill every eligible tensor) or ``"none"`` (keep everything: the hooks only
    count). ``namespace``: the key prefix of the spilled objects; by default a fresh one
    (``activations``, ``activations-2``, ...) is claimed on the store, so several offloaders (and
    other workloads) can share it; a namespace claimed already raises
    :class:`~tierstore.NamespaceInUseError`.
    """

    def __init__(
        self,
        store: TierStore,
        budget: int | str = "512MiB",
        min_bytes: int | str = "1MiB",
        plan: Plan = "lifetime",
        *,
        namespace: str | None = None,
    ) -> None:
        self.store = store
        self.budget = _size("budget", budget)
        self.min_bytes = _size("min_bytes", min_bytes)
        if plan not in PLANS:
            raise ConfigError(f"plan: must be one of {', '.join(map(repr, PLANS))}, not {plan!r}")
        self.plan_mode: Plan = plan
        owner = type(self).__name__
        claim = (
            store.namespaces.claim_unique("activations", owner)
            if namespace is None
            else store.namespaces.claim(namespace, owner)
        )
        self.namespace = claim.namespace
        self._claim = claim
        try:
            self._reservation = store.memory.reserve(f"activations {self.namespace}", self.budget)
        except BaseException:
            store.namespaces.release(claim)
            raise
        weakref.finalize(self, _release, store, claim, self._reservation)
        self._serials = itertools.count()
        self._steps = itertools.count(1)
        self._cond = threading.Condition()
        self._writes_in_flight = 0
        self._reads_in_flight = 0
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
        self._pool = BufferPool(self.budget, pin=torch.cuda.is_available(), resident=True)
        self._device = DeviceCopies(self._background)
        self._closed = False
        self._warned = False
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
            "dropped_read_ahead_bytes": 0,
            "overflow_bytes": 0,
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
            self._stats["step_peak_resident_bytes"] = self._pool.in_use_bytes
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
                self._read_ahead(step)

    # -- public -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since creation: bytes spilled, read back, kept, deduplicated, forwarded; the
        peak of resident bytes (pool memory holding saved tensors: at most ``budget``); seconds
        forward waited on writes and backward on reads; ``overflow_bytes``, saved or read bytes
        that went to ordinary memory because tensors held outside the offloader left the pool no
        room. The ``step_`` ones cover the latest step: its peak, and the bytes of the saved
        tensors it captured (what keeping them all in memory would hold at the end of forward)."""
        with self._cond:
            stats: dict[str, Any] = dict(self._stats)
            stats["resident_bytes"] = self._pool.in_use_bytes
            stats["pool_bytes"] = self._pool.allocated_bytes
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
            "memory; the same bytes saved several times are spilled once"
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
                f"  #{entry.index:<4} {entry.capture.nbytes / 2**20:9.2f} MiB {entry.dtype!s:15} saved at "
                f"{entry.saved_at * 1e3:8.1f} ms, used at {used * 1e3:8.1f} ms: {decision}"
            )
        return "\n".join(lines)

    def synchronize(self) -> None:
        """Wait for every write, read and deletion this offloader has started."""
        with self._cond:
            self._cond.wait_for(lambda: self._writes_in_flight == 0 and self._reads_in_flight == 0)
        with contextlib.suppress(RuntimeError):  # the interpreter is exiting: the thread drains itself
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
                    if not entry.dead:
                        entry.error = RuntimeError("it was let go of by ActivationOffload.reset()")
                        self._kill(entry)
            self._live.clear()

    def close(self) -> None:
        """Finish background work, free the pool and give back the budget and the namespace (the
        store stays open)."""
        if self._closed:
            return
        self.reset()
        self.synchronize()
        self._background.shutdown(wait=True)
        self._pool.clear()
        _release(self.store, self._claim, self._reservation)
        self._closed = True

    # -- hooks ------------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> _Handle:
        step = self._active
        assert step is not None
        if not _spillable(tensor):
            if _is_parameter(tensor):
                self._count("parameter_bytes", tensor.untyped_storage().nbytes())
            return _Handle(tensor)
        capture = capture_of(tensor)
        if self.plan_mode == "none" or capture.nbytes < self.min_bytes:
            self._count("kept_bytes" if self.plan_mode == "none" else "small_bytes", capture.nbytes)
            return _Handle(tensor)
        storage = tensor.untyped_storage()
        identity = (storage._cdata, *capture.identity)
        with self._cond:
            entry = step.captures.get(identity)
            if entry is not None and not entry.dead and entry.storage() is storage:
                self._stats["deduplicated_bytes"] += capture.nbytes
                return self._handle(tensor, entry)
        entry = self._admit(step, tensor, capture, storage)
        if entry is None:  # no room: it stays as autograd keeps it
            self._count("overflow_bytes", capture.nbytes)
            return _Handle(tensor)
        with self._cond:
            step.captures[identity] = entry
            return self._handle(tensor, entry)

    def _handle(self, tensor: torch.Tensor, entry: _Entry) -> _Handle:
        """A handle on ``entry`` for ``tensor`` (under the lock); freed by autograd in its time."""
        entry.handles += 1
        handle = _Handle(tensor, entry, view_of(tensor, entry.capture))
        weakref.finalize(handle, self._handle_gone, entry, id(handle)).atexit = False
        return handle

    def _unpack(self, handle: _Handle) -> torch.Tensor:
        handle.check_version()
        entry, view = handle.entry, handle.view
        if entry is None or view is None:
            assert handle.alias is not None
            return handle.alias
        data = self._bytes_for(entry, handle)
        if entry.device.type == "cuda":
            data = self._device.to_device(data, entry.device)
        restored = rebuild(data, handle.dtype, view)
        with self._cond:
            entry.unpacked.add(id(handle))
            if entry.spill and entry.written and len(entry.unpacked) >= entry.handles:
                self._drop(entry)  # every handle served; a retained graph reads it again
            step = entry.step
            if entry.used_at is None:
                entry.used_at = step.last_use = step.now()
            self._read_ahead(step)
        return restored

    # -- forward: capturing and writing -----------------------------------------------------------
    def _admit(
        self, step: _Step, tensor: torch.Tensor, capture: Capture, storage: torch.UntypedStorage
    ) -> _Entry | None:
        """Capture ``tensor`` into pool memory and start its write if the plan spills it; None if
        no room can be made."""
        if not self._pool.fits(capture.nbytes):
            raise ConfigError(
                f"budget: {self.budget} bytes cannot hold one saved tensor of {capture.nbytes} bytes "
                f"({tensor.type()} {list(tensor.shape)}); raise budget, or min_bytes above it"
            )
        stalled = time.perf_counter()
        lease = self._lease(capture.nbytes)
        waited = time.perf_counter() - stalled
        with self._cond:
            self._stats["write_stall_s"] += waited
            step.stalls += waited
        if lease is None:
            return None
        entry = _Entry(
            step=step,
            index=len(step.entries),
            key=self._claim.key(str(next(self._serials))),
            capture=capture,
            dtype=tensor.dtype,
            device=tensor.device,
            storage=weakref.ref(storage),
            spill=True,
            saved_at=step.now(),
            data=lease.tensor,
            io=lease.io,
        )
        if tensor.device.type == "cuda":
            entry.copied = self._device.to_host(tensor, capture, lease.tensor)
        else:
            copy_out(tensor, capture, lease.tensor)
        with self._cond:
            plan = step.following
            if plan is not None and (
                entry.index >= len(self._plan_signature)
                or self._plan_signature[entry.index] != (capture.nbytes, tensor.dtype)
            ):
                step.following = plan = None  # the saved sequence changed: this step profiles
            entry.spill = plan is None or entry.index in plan.spill
            step.entries.append(entry)
            self._stats["step_saved_bytes"] += capture.nbytes
            if entry.spill:
                self._start_write(entry)
            else:
                self._stats["kept_bytes"] += capture.nbytes
        return entry

    def _start_write(self, entry: _Entry) -> None:
        """Write the entry's capture to the store in the background (under the lock)."""
        assert entry.io is not None
        entry.writing = True
        self._writes_in_flight += 1
        self._stats["spilled_bytes"] += entry.capture.nbytes
        self._stats["spilled_tensors"] += 1
        if entry.copied is not None:  # CUDA: the bytes are in host memory once the copy is done
            self._background.submit(self._write_after_copy, entry, entry.io, entry.copied)
            return
        self._put(entry, entry.io)

    def _write_after_copy(self, entry: _Entry, data: torch.Tensor, copied: torch.cuda.Event) -> None:
        try:
            copied.synchronize()
        except BaseException as error:
            self._write_done(entry, error)
            return
        self._put(entry, data)

    def _put(self, entry: _Entry, data: torch.Tensor) -> None:
        try:
            future = self.store.put(entry.key, data, scratch=True)
        except BaseException as error:
            self._write_done(entry, error)
            return
        future.add_done_callback(lambda done: self._write_done(entry, done.exception()))

    def _write_done(self, entry: _Entry, error: BaseException | None) -> None:
        with self._cond:
            entry.writing = False
            self._writes_in_flight -= 1
            if error is not None:  # the capture stays in memory: backward still gets it
                entry.error = error
                self._stats["write_errors"] += 1
            else:
                entry.written = True
                if entry.dead:
                    self._delete(entry)
                elif not entry.claimed or len(entry.unpacked) >= entry.handles:
                    self._drop(entry)
            self._cond.notify_all()

    # -- backward: reading back -------------------------------------------------------------------
    def _read_ahead(self, step: _Step) -> None:
        """Start reads in backward's order for as many spilled tensors as the pool has room for
        now (under the lock); one still being written stays in memory instead."""
        while step.cursor < len(step.read_order):
            entry = step.read_order[step.cursor]
            if entry.dead or entry.used_at is not None or entry.reading or entry.error is not None:
                pass
            elif entry.data is not None:
                entry.claimed = True
            elif entry.written:
                lease = self._pool.try_lease(entry.capture.nbytes, self._returned)
                if lease is None:
                    return
                self._start_read(entry, lease, ahead=True)
            else:
                return
            step.cursor += 1

    def _start_read(self, entry: _Entry, lease: Lease, *, ahead: bool) -> None:
        """Read the entry's object into ``lease`` (under the lock)."""
        self._note_resident()
        self._stats["read_bytes"] += entry.capture.nbytes
        entry.data, entry.io = lease
        entry.reading, entry.read_ahead, entry.read_back = True, ahead, True
        self._reads_in_flight += 1
        try:
            future = self.store.get(entry.key, out=lease.io, cache=False)
        except BaseException as error:
            self._read_done(entry, error)
            return
        future.add_done_callback(lambda done: self._read_done(entry, done.exception()))

    def _read_done(self, entry: _Entry, error: BaseException | None) -> None:
        with self._cond:
            entry.reading = False
            self._reads_in_flight -= 1
            if error is not None:
                entry.error = error
            if error is not None or entry.dead:
                entry.data = entry.io = None
            self._cond.notify_all()

    def _bytes_for(self, entry: _Entry, handle: _Handle) -> torch.Tensor:
        """The entry's captured bytes: still in memory (forwarded), read ahead, or read now."""
        stalled = time.perf_counter()
        with self._cond:
            while entry.data is None or entry.reading:
                if entry.error is not None:
                    raise RuntimeError(
                        f"saved tensor {handle.type_name} {handle.size} cannot be restored: {entry.error}"
                    ) from entry.error
                if entry.reading:
                    self._cond.wait()
                    continue
                lease = self._lease(entry.capture.nbytes, wanted=entry)
                if lease is None:  # no room: read into ordinary memory
                    self._stats["overflow_bytes"] += entry.capture.nbytes
                    memory = torch.empty(entry.capture.nbytes, dtype=torch.uint8)
                    lease = Lease(memory, memory)
                if entry.data is None and not entry.reading:
                    self._start_read(entry, lease, ahead=False)
            if entry.spill and not entry.read_back and entry.used_at is None:
                self._stats["forwarded_bytes"] += entry.capture.nbytes
            entry.read_ahead = False
            waited = time.perf_counter() - stalled
            self._stats["read_stall_s"] += waited
            entry.step.stalls += waited
            return entry.data

    # -- room in the pool -------------------------------------------------------------------------
    def _lease(self, nbytes: int, wanted: _Entry | None = None) -> Lease | None:
        """Pool memory for ``nbytes``, making room if needed: in backward (``wanted`` is the entry
        asked for) by dropping read-ahead, then by waiting for reads and writes in flight; in
        forward by waiting for writes; then by taking fresh pages where buffers in use split up
        the free ones. None when nothing the offloader does can make room."""
        with self._cond:
            while True:
                lease = self._pool.try_lease(nbytes, self._returned)
                if lease is None and wanted is not None and self._drop_read_ahead(wanted):
                    continue
                if lease is None and (
                    self._writes_in_flight or (wanted is not None and self._reads_in_flight)
                ):
                    self._cond.wait()
                    continue
                if lease is None:
                    lease = self._pool.try_lease(nbytes, self._returned, fresh_pages=True)
                if lease is not None:
                    self._note_resident()
                    return lease
                if not self._cond.wait(OUT_OF_ROOM_WAIT_S):
                    self._warn_overflow(nbytes)
                    return None

    def _drop_read_ahead(self, wanted: _Entry) -> bool:
        """Let go of one spilled tensor held ahead of its use (read ahead, or its capture kept for
        forwarding), the one backward needs last (under the lock); it is read again when its turn
        comes. Whether one was dropped."""
        step = wanted.step
        for index in range(len(step.read_order) - 1, -1, -1):
            entry = step.read_order[index]
            if (
                entry is not wanted
                and entry.data is not None
                and entry.written
                and not entry.reading
                and entry.used_at is None
            ):
                self._stats["dropped_read_ahead_bytes"] += entry.capture.nbytes
                step.cursor = min(step.cursor, index)
                self._drop(entry)
                return True
        return False

    def _warn_overflow(self, nbytes: int) -> None:
        """Say once that the budget is too small for what is held at once (under the lock)."""
        if self._warned:
            return
        self._warned = True
        held = self._pool.in_use_bytes
        warnings.warn(
            f"ActivationOffload: {nbytes} more bytes of saved tensors are needed while {held} bytes "
            f"of the budget ({self.budget}) are held by tensors autograd is still using (one "
            "backward operation needs them all at once, or a graph built with create_graph=True "
            f"keeps them); they go to ordinary memory (stats()['overflow_bytes']). A budget of at "
            f"least {held + nbytes} bytes keeps them within it.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _returned(self) -> None:
        """Pool memory came back (autograd or the store let go of a tensor over it)."""
        with self._cond:
            self._cond.notify_all()

    def _note_resident(self) -> None:
        resident = self._pool.in_use_bytes
        self._stats["peak_resident_bytes"] = max(self._stats["peak_resident_bytes"], resident)
        self._stats["step_peak_resident_bytes"] = max(self._stats["step_peak_resident_bytes"], resident)

    # -- lifetimes --------------------------------------------------------------------------------
    def _handle_gone(self, entry: _Entry, handle_id: int) -> None:
        """Autograd freed a handle; the last one takes the entry's memory and object with it."""
        with self._cond:
            entry.handles -= 1
            entry.unpacked.discard(handle_id)
            if entry.handles <= 0 and not entry.dead:
                self._kill(entry)

    def _kill(self, entry: _Entry) -> None:
        """No handle will ask for the entry again: free its memory and object (under the lock)."""
        entry.dead = True
        if not entry.reading:
            self._drop(entry)
        if not entry.writing:
            self._delete(entry)

    def _drop(self, entry: _Entry) -> None:
        """Let go of the entry's bytes in memory (under the lock): their pool memory returns once
        no rebuilt tensor holds it either."""
        entry.data = entry.io = entry.copied = None
        entry.claimed = entry.read_ahead = False

    def _delete(self, entry: _Entry) -> None:
        """Delete the entry's store object in the background (under the lock)."""
        if not entry.written:
            return
        entry.written = False
        self._stats["deleted_objects"] += 1

        def delete() -> None:
            with contextlib.suppress(StoreClosedError):  # a closed store has let go of it already
                self.store.delete(entry.key)

        # Closed, or the interpreter is exiting: a scratch store deletes its objects when it
        # closes, and a persistent one collects scratch objects when it next opens.
        with contextlib.suppress(RuntimeError):
            if not self._closed:
                self._background.submit(delete)

    def _count(self, counter: str, nbytes: int) -> None:
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
            SavedTensor(
                e.capture.nbytes, e.saved_at, e.used_at if e.used_at is not None else profiled.last_use
            )
            for e in profiled.entries
        ]
        speeds: list[PathSpeed] = next(iter(self.store.bandwidths().values()), [])
        if tensors and not speeds:
            return  # the tier has no estimate yet: profile on
        plan = plan_spill(speeds, self.budget, tensors, profiled.last_use)
        with self._cond:
            self._plan = plan
            self._plan_signature = _signature(profiled)
            self._profiled = profiled
            self._stats["plans_built"] += 1


def _release(store: TierStore, claim: Any, reservation: Any) -> None:
    """Give the namespace and the memory reservation back to the store (idempotent)."""
    store.namespaces.release(claim)
    store.memory.release(reservation)


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
    """What a plan depends on: the sizes and dtypes of the captures, in save order."""
    return [(entry.capture.nbytes, entry.dtype) for entry in step.entries]


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter)


def _spillable(tensor: torch.Tensor) -> bool:
    """Plain dense CPU or CUDA tensors with elements that are not parameters (nor views of them);
    lazily conjugated or negated views keep their memory unchanged behind a flag, and tensor
    subclasses may have no memory of their own: those stay as they are."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and tensor.device.type in ("cpu", "cuda")
        and tensor.numel() > 0
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not _is_parameter(tensor)
    )
