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
  staging area of ``budget`` bytes (:meth:`TierStore.staging`, reserved from the store's memory
  ledger), page-aligned so the store reads and writes it with O_DIRECT as it is, and reused from
  step to step; a tensor rebuilt for backward shares its pool memory, which returns to the pool
  when autograd lets go of the tensor. The process holds ``budget`` for saved activations, and
  nothing that grows with the spilled bytes;
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
profile when it changes. What is spilled, the order of the reads and how room is made are decided
by one :class:`~tierstore.spill_policy.SpillPolicy`, which the replay follows too: the plan
predicts what the runtime does by construction.

On CUDA the pool is pinned (from the first save of a CUDA tensor) and the copies between device
and host run on a copy stream of the device layer (:mod:`.cuda`, :mod:`tierstore.device`); the
compute stream never waits on the host.

:class:`ActivationOffload` puts the parts together: :mod:`.hooks` (the saved-tensor hooks and the
lifetimes of what autograd keeps), :mod:`.transfers` (admission, writes, reads and the room they
need), :mod:`.planning` (profiles and plans), :mod:`.cuda` (the copies to and from a device) and
:mod:`.entries` (what is recorded of each step and capture).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Self

import torch

from .._checks import check_arguments
from ..device import DeviceCopies
from ..errors import ConfigError
from ..store import TierStore
from .entries import Step
from .hooks import SavedTensorHooks
from .options import ActivationOptions, Plan
from .planning import Planner
from .transfers import Transfers


class ActivationOffload:
    """Offload the activations saved during a forward pass to ``store`` (see the module docstring).

    Use it as a context manager around forward; backward may run after the block. Entering a
    closed offloader, or entering one inside its own block, raises :class:`ConfigError`.

    Args:
        store: where saved tensors are spilled, and whose memory ledger ``budget`` is reserved
            from; the store stays the caller's (:meth:`close` leaves it open).
        budget: bytes (an int, or text such as ``"512MiB"``) of memory for saved tensors of at
            least ``min_bytes``: captures being written, tensors the plan keeps, and bytes read
            back ahead of backward or being used by it.
        min_bytes: bytes (an int or text); smaller saved tensors stay in memory as autograd keeps
            them.
        plan: ``"lifetime"`` (profile, then keep what cannot be hidden), ``"all"`` (spill every
            eligible tensor) or ``"none"`` (keep everything: the hooks only count).
        namespace: the key prefix of the spilled objects; None claims a fresh one on the store
            (``activations``, ``activations-2``, ...), so several offloaders (and other
            workloads) can share it.

    Raises:
        ConfigError: ``budget``, ``min_bytes`` or ``plan`` of the wrong type or out of range
            (the message names it).
        InvalidKeyError: ``namespace`` is not a valid key.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
        CapacityError: ``budget`` does not fit beside the store's other reservations.
        StoreClosedError: the store is closed.
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
        options = check_arguments(ActivationOptions, {"budget": budget, "min_bytes": min_bytes, "plan": plan})
        self.budget = int(options.budget)
        self.min_bytes = int(options.min_bytes)
        self.plan_mode: Plan = plan
        owner = type(self).__name__
        claim = (
            store.namespaces.claim_unique("activations", owner)
            if namespace is None
            else store.namespaces.claim(namespace, owner)
        )
        self.namespace = claim.namespace
        self._release_namespace = weakref.finalize(self, store.namespaces.release, claim)
        try:
            self._staging = store.staging(f"activations {self.namespace}", self.budget, resident=True)
        except BaseException:
            self._release_namespace()
            raise
        self._lock = threading.Condition()
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
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tierstore-activations")
        self._device = DeviceCopies()
        self._transfers = Transfers(
            store, claim, self._staging, self._lock, self._stats, self._background, self._device
        )
        self._hooks = SavedTensorHooks(
            self._transfers,
            self._lock,
            self._stats,
            min_bytes=self.min_bytes,
            keep_all=plan == "none",
        )
        self._planner = Planner(store, self.budget, plan, self._lock, self._stats)
        self._active: Step | None = None
        self._active_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._live: list[Step] = []
        """Steps some of whose saved tensors autograd may still hold."""
        self._closed = False

    # -- the forward block ------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._closed:
            raise ConfigError("this ActivationOffload is closed")
        if self._active is not None:
            raise ConfigError("ActivationOffload blocks do not nest")
        step = self._active = self._planner.start_step()
        with self._lock:
            self._stats["steps"] += 1
            self._stats["step_peak_resident_bytes"] = self._staging.pool.in_use_bytes
            self._stats["step_saved_bytes"] = 0
            self._live = [s for s in self._live if not all(e.dead for e in s.entries)]
            self._live.append(step)
        self._active_hooks = self._hooks.for_step(step)
        self._active_hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._active_hooks is not None and self._active is not None
        self._active_hooks.__exit__(kind, error, traceback)
        step, self._active, self._active_hooks = self._active, None, None
        with self._lock:
            self._planner.end_forward(step, failed=kind is not None)
            if kind is None:
                self._transfers.read_ahead(step)

    # -- public -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since creation, and the offloader's current state.

        Returns:
            By name: bytes spilled, read back, kept, deduplicated, forwarded; the peak of resident
            bytes (pool memory holding saved tensors: at most ``budget``); seconds forward waited
            on writes and backward on reads; ``overflow_bytes``, saved or read bytes that went to
            ordinary memory because tensors held outside the offloader left the pool no room. The
            ``step_`` ones cover the latest step: its peak, and the bytes of the saved tensors it
            captured (what keeping them all in memory would hold at the end of forward). Then
            ``resident_bytes``, ``pool_bytes``, ``budget_bytes``, ``plan`` and the planner's own
            figures.
        """
        with self._lock:
            stats: dict[str, Any] = dict(self._stats)
            stats["resident_bytes"] = self._staging.pool.in_use_bytes
            stats["pool_bytes"] = self._staging.pool.allocated_bytes
            stats["budget_bytes"] = self.budget
            stats["plan"] = self.plan_mode
            stats.update(self._planner.stats())
            return stats

    def plan_explain(self) -> str:
        """Which saved tensors are kept in memory and which are spilled, and why.

        Returns:
            Text: the plan in force and the rules every plan follows, then, for a ``"lifetime"``
            plan built from a profiled step, one line per saved tensor of that step (its size,
            when it was saved and used, kept or spilled).
        """
        return self._planner.explain(self.min_bytes)

    def synchronize(self) -> None:
        """Wait for every write, read and deletion this offloader has started."""
        self._transfers.wait_for_io()
        with contextlib.suppress(RuntimeError):  # the interpreter is exiting: the thread drains itself
            self._background.submit(lambda: None).result()

    def reset(self) -> None:
        """Let go of every saved tensor of earlier steps now: objects deleted, memory freed.

        For after a step raised in backward: PyTorch keeps a failed backward's graph, and with it
        the saved tensors' handles, until that thread's next backward. A later use of a tensor
        let go of raises instead of returning stale data.
        """
        with self._lock:
            for step in self._live:
                for entry in step.entries:
                    if not entry.dead:
                        entry.error = RuntimeError("it was let go of by ActivationOffload.reset()")
                        self._hooks.kill(entry)
            self._live.clear()

    def close(self) -> None:
        """Finish background work, free the pool and give back the budget and the namespace (the
        store stays open)."""
        if self._closed:
            return
        self.reset()
        self.synchronize()
        self._background.shutdown(wait=True)
        self._device.close()
        self._staging.close()
        self._release_namespace()
        self._closed = True
