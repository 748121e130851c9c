"""Spill the tensors autograd saves in forward to a TierStore, and stage them back for backward.

The mechanism is `torch.autograd.graph.saved_tensors_hooks`: ``pack`` runs in forward for every
tensor an operation saves and returns a handle; ``unpack`` runs in backward and returns the tensor.
On top of it, SSDTrain's mechanics:

* parameters and views of them are never spilled (``nn.Linear`` saves ``weight.t()``, a view);
  tensors under ``min_bytes`` stay in memory;
* at the save, the bytes the tensor covers are copied into the offloader's memory (a *capture*,
  `capture`), so what backward gets is exactly what was saved, whatever forward writes into the
  storage afterwards; two saves of the same bytes share one capture and are spilled once;
* all memory the offloader uses, captures being written and bytes read back, is lent from one
  staging area of ``budget`` bytes ([`TierStore.staging`][], reserved from the store's memory
  ledger), page-aligned so the store reads and writes it with O_DIRECT as it is, and reused from
  step to step; a tensor rebuilt for backward shares its pool memory, which returns to the pool when
  autograd lets go of the tensor. The process holds ``budget`` for saved activations, and nothing
  that grows with the spilled bytes;
* writes are asynchronous: forward goes on at once and the capture returns to the pool when the
  write completes; forward waits only while the pool is full and writes are in flight;
* a saved tensor of a device (a CUDA GPU) goes to host memory first and to storage only beyond the
  budget: while no plan says otherwise its capture is kept in the pinned pool, and when the pool
  is full the oldest kept capture is spilled (the captures saved last, which backward wants first,
  stay); a plan may also leave it on the device;
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
each saved tensor's size, save time and first use (two steps saving the same sequence: the first one
warms up); `tierstore.activations.replay.plan_spill` then decides which to keep in memory (the
short-lived ones of the last layers) by replaying the step with the tier's measured bandwidths. The
plan is reused while the sequence of saved tensors stays the same and rebuilt from a fresh profile
when it changes. What is spilled, the order of the reads and how room is made are decided by one
`SpillPolicy`, which the replay follows too: the plan predicts what the runtime does by
construction.

On a device the pool is pinned (from the first save of a device tensor) and the copies between
device and host run on a copy stream of the device layer, in both directions overlapped with the
compute (`cuda`, `tierstore.device`): a saved tensor is copied out after the kernel that produced it
and held (never snapshotted, unless it is outside autograd's graph) until its copy has ended, within
``device_budget`` (forward waits for the oldest copy while the budget is full); backward's tensors
are copied back ahead of their use into memory of the copy stream, within the same budget, and the
compute stream waits for a copy only at its use. A tensor whose copy out has not ended when forward
ends stays on the device. Profiles of a device's steps are timed on its clock.

With ``scope="checkpoint-inputs"`` only the inputs of checkpointed regions are taken
([`ActivationOffload.checkpoint`][], or a Hugging Face model's gradient checkpointing through
[`ActivationOffload.attach`][]): recompute and offload combined, the memory floor of recomputation
for a small share of the traffic.

[`ActivationOffload`][] puts the parts together: `hooks` (the saved-tensor hooks and the lifetimes
of what autograd keeps), `transfers` (admission, writes, reads, copies to and from a device and the
room they need), `planning` (profiles and plans), `cuda` (the copies to and from a device),
`entries` (what is recorded of each step and capture) and `report` (what each step moved and cost).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, Self, TypeVar

import torch
import torch.utils.checkpoint
from torch import nn

from .._checks import check_arguments
from ..device import DeviceCopies
from ..errors import ConfigError
from ..store import TierStore
from .entries import Step
from .hooks import SavedTensorHooks
from .options import ActivationOptions, Plan, Scope
from .planning import Planner
from .report import StepReport, report_of
from .transfers import Transfers

_log = logging.getLogger("tierstore.activations")
Result = TypeVar("Result")


class ActivationOffload:
    """Offload the activations saved during a forward pass to ``store`` (see the module docstring).

    Use it as a context manager around forward; backward may run after the block. Entering a closed
    offloader, or entering one inside its own block, raises [`ConfigError`][]. [`attach`][] enters
    the block at each call of a model's forward instead (a training loop written elsewhere), and
    [`checkpoint`][] marks the inputs of checkpointed regions.

    Args:
        store: where saved tensors are spilled, and whose memory ledger ``budget`` is reserved from;
            the store stays the caller's ([`close`][] leaves it open).
        budget: bytes (an int, or text such as ``"512MiB"``) of memory for saved tensors of at
            least ``min_bytes``: captures being written, tensors the plan keeps, and bytes read
            back ahead of backward or being used by it.
        min_bytes: bytes (an int or text); smaller saved tensors stay in memory as autograd keeps
            them.
        plan: ``"lifetime"`` (profile, then keep in memory, or on the device, what cannot be
            hidden), ``"all"`` (spill every eligible tensor; a device's to host memory first and
            to storage beyond ``budget``) or ``"none"`` (keep everything: the hooks only count).
        namespace: the key prefix of the spilled objects; None claims a fresh one on the store
            (``activations``, ``activations-2``, ...), so several offloaders (and other
            workloads) can share it.
        device_budget: bytes (an int or text) of device memory for saved tensors of a device:
            those held while their copy to host memory runs, those left on the device, and
            those copied back ahead of backward's use. Forward waits for copies while it is full.
        scope: ``"saved"`` (every tensor autograd saves in the block) or ``"checkpoint-inputs"``
            (only the inputs of checkpointed regions, see [`checkpoint`][]; the rest stays as
            autograd keeps it).

    Raises:
        ConfigError: ``budget``, ``min_bytes``, ``plan``, ``device_budget`` or ``scope`` of the
            wrong type or out of range (the message names it).
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
        device_budget: int | str = "512MiB",
        scope: Scope = "saved",
    ) -> None:
        self.store = store
        options = check_arguments(
            ActivationOptions,
            {
                "budget": budget,
                "min_bytes": min_bytes,
                "plan": plan,
                "device_budget": device_budget,
                "scope": scope,
            },
        )
        self.budget = int(options.budget)
        self.min_bytes = int(options.min_bytes)
        self.device_budget = int(options.device_budget)
        self.plan_mode: Plan = plan
        self.scope: Scope = scope
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
            "host_bytes": 0,
            "restored_bytes": 0,
            "device_kept_bytes": 0,
            "peak_device_bytes": 0,
            "outside_checkpoint_bytes": 0,
            "snapshot_bytes": 0,
        }
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tierstore-activations")
        runtime = store.device_runtime
        self._device = DeviceCopies(runtime)
        self._transfers = Transfers(
            store,
            claim,
            self._staging,
            self._lock,
            self._stats,
            self._background,
            self._device,
            self.device_budget,
        )
        self._hooks = SavedTensorHooks(
            self._transfers,
            self._lock,
            self._stats,
            runtime,
            min_bytes=self.min_bytes,
            keep_all=plan == "none",
            checkpoint_inputs=scope == "checkpoint-inputs",
        )
        self._planner = Planner(
            store, self.budget, self.device_budget, plan, runtime, self._lock, self._stats
        )
        self._active: Step | None = None
        self._active_hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._live: list[Step] = []
        """Steps some of whose saved tensors autograd may still hold."""
        self._report: StepReport | None = None
        self._reported = 0
        """The number of the latest step reported."""
        self._warned_at_plans = -1
        """``plans_built`` when the offload was last said not to be hidden (once per plan)."""
        self._entered_by_hook = threading.local()
        """Per thread: for each call of an attached module's forward under way, whether its
        pre-hook entered the block."""
        self._closed = False

    # -- the forward block ------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._closed:
            raise ConfigError("this ActivationOffload is closed")
        if self._active is not None:
            raise ConfigError("ActivationOffload blocks do not nest")
        self._report_finished(wait=False)
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
                self._transfers.end_forward(step)

    # -- drop-ins ---------------------------------------------------------------------------------
    def checkpoint(self, function: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
        """`torch.utils.checkpoint.checkpoint` (the same arguments, reentrant or not: it is torch's,
        called as given) whose region inputs this offloader takes inside its block; with
        ``scope="checkpoint-inputs"`` they are the only tensors it takes. What the region saves
        inside is recomputed by backward as torch's checkpoint does. Outside the block it is torch's
        checkpoint alone.

        Args:
            function: the region.
            args: its arguments, then torch's checkpoint options (``use_reentrant=...``).
            kwargs: as ``args``.

        Returns:
            What ``function`` returns.
        """
        with self._hooks.region_inputs():
            result: Result = torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
            return result

    def attach(self, module: nn.Module) -> Attachment:
        """Offload what ``module``'s forward saves, without an edit of the loop that calls it:
        each call of its forward enters this offloader's block (unless the caller has already
        entered it) and leaves it when forward returns or raises (forward hooks, so backward
        runs after the block as usual). It suits a model trained by a loop written elsewhere:
        Hugging Face's ``Trainer``, a model sharded with FSDP2's ``fully_shard``.

        With ``scope="checkpoint-inputs"``, the checkpointing function of every submodule that
        has one (a Hugging Face model's gradient checkpointing, switched on before or after this
        call) is made to mark its regions' inputs, at each call of forward.

        Args:
            module: the model.

        Returns:
            The attachment; [`Attachment.remove`][] undoes it.
        """
        pre = module.register_forward_pre_hook(self._forward_starts)
        post = module.register_forward_hook(self._forward_ends, always_call=True)
        return Attachment(self, module, (pre, post))

    def _forward_starts(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        calls: list[bool] = self._entered_by_hook.__dict__.setdefault("calls", [])
        # Not inside the caller's own block, nor a nested call, nor a forward without autograd.
        entering = self._active is None and not calls and torch.is_grad_enabled()
        calls.append(entering)
        if self.scope == "checkpoint-inputs":
            self.mark_regions(module)
        if entering:
            self.__enter__()

    def _forward_ends(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        calls: list[bool] = self._entered_by_hook.__dict__.setdefault("calls", [])
        if not calls or not calls.pop():
            return
        kind, error, traceback = sys.exc_info() if output is None else (None, None, None)
        self.__exit__(kind, error, traceback)

    def mark_regions(self, module: nn.Module) -> None:
        """Make the checkpointing function of every submodule of ``module`` that has one (Hugging
        Face's ``_gradient_checkpointing_func``) mark its regions' inputs for this offloader, as
        [`checkpoint`][] does ([`attach`][] calls it at each forward; a function marked already is
        left as it is).

        Args:
            module: the model.
        """
        for submodule in module.modules():
            function = submodule.__dict__.get("_gradient_checkpointing_func")
            if function is not None and getattr(function, "tierstore_offload", None) is not self:
                setattr(submodule, "_gradient_checkpointing_func", self._marking(function))  # noqa: B010

    def _marking(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def marked(*args: Any, **kwargs: Any) -> Any:
            with self._hooks.region_inputs():
                return function(*args, **kwargs)

        marked.tierstore_offload = self  # type: ignore[attr-defined]
        marked.__wrapped__ = function  # type: ignore[attr-defined]
        return marked

    # -- public -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since creation, and the offloader's current state.

        Returns:
            By name: bytes spilled, read back, kept, deduplicated, forwarded; the peak of resident
            bytes (pool memory holding saved tensors: at most ``budget``); seconds forward waited
            on writes and backward on reads; ``overflow_bytes``, saved or read bytes that went to
            ordinary memory because tensors held outside the offloader left the pool no room. The
            ``step_`` ones cover the latest step: its peak, and the bytes of the saved tensors it
            captured (what keeping them all in memory would hold at the end of forward). For
            saved tensors of a device: ``host_bytes`` copied to host memory, ``snapshot_bytes`` of
            them copied within device memory first, ``restored_bytes`` copied back,
            ``device_kept_bytes`` left on the device, ``peak_device_bytes`` (device memory held:
            at most ``device_budget``). ``outside_checkpoint_bytes``: saved outside the inputs of
            checkpointed regions (scope ``"checkpoint-inputs"``), left as autograd keeps them.
            Then ``resident_bytes``, ``pool_bytes``, ``budget_bytes``, ``device_bytes``,
            ``device_budget_bytes``, ``plan``, ``scope`` and the planner's own figures.
        """
        with self._lock:
            stats: dict[str, Any] = dict(self._stats)
            stats["resident_bytes"] = self._staging.pool.in_use_bytes
            stats["pool_bytes"] = self._staging.pool.allocated_bytes
            stats["budget_bytes"] = self.budget
            stats["device_bytes"] = self._transfers.device_held
            stats["device_budget_bytes"] = self.device_budget
            stats["plan"] = self.plan_mode
            stats["scope"] = self.scope
            stats.update(self._planner.stats())
            return stats

    def report(self) -> dict[str, Any] | None:
        """What the latest step whose backward is over moved and cost (`report`): by link (device to
        host, host to storage and back), the bytes, the bandwidth they needed to hide behind compute
        and what the link gave; the seconds the step waited; whether the offload was hidden, and
        ``line``, all of it in one line. Each step's line also goes to the ``tierstore.activations``
        logger (DEBUG), and a step not hidden is said once per plan (WARNING).

        Returns:
            The report as plain data, or None before any step's backward is over.
        """
        self._report_finished(wait=True)
        return None if self._report is None else {**self._report.as_dict(), "line": self._report.line()}

    def _report_finished(self, *, wait: bool) -> None:
        """Report the steps whose backward is over and that were not reported yet, in order; with
        ``wait``, a device's step is waited for, else it is left for later while its events have
        not completed (a new step does not wait for the device)."""
        with self._lock:
            finished = [s for s in self._live if s.number > self._reported and s.profiled()]
        for step in finished:
            report = report_of(step, self.store, self._device.runtime, wait=wait)
            if report is None:
                return
            self._report, self._reported = report, step.number
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug("ActivationOffload %s", report.line())
            plans = int(self._stats["plans_built"])
            if not report.hidden and plans != self._warned_at_plans:
                self._warned_at_plans = plans
                _log.warning(
                    "ActivationOffload: the offload is not hidden (%s); raise budget (host memory) or "
                    "device_budget, plan='lifetime', or scope='checkpoint-inputs' (offload.report())",
                    report.line(),
                )

    def plan_explain(self) -> str:
        """Which saved tensors are kept in memory and which are spilled, and why.

        Returns:
            Text: the plan in force and the rules every plan follows, then, for a ``"lifetime"``
            plan built from a profiled step, one line per saved tensor of that step (its size,
            when it was saved and used, kept or spilled).
        """
        return self._planner.explain(self.min_bytes)

    def synchronize(self) -> None:
        """Wait for every copy, write, read and deletion this offloader has started."""
        self._device.synchronize()
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


class Attachment:
    """An [`ActivationOffload`][] attached to a module ([`ActivationOffload.attach`][])."""

    def __init__(
        self,
        offload: ActivationOffload,
        module: nn.Module,
        handles: tuple[torch.utils.hooks.RemovableHandle, ...],
    ) -> None:
        self.offload = offload
        self.module = module
        self._handles = handles

    def remove(self) -> None:
        """Detach: the module's forward hooks go, and its submodules get back the checkpointing
        functions they had."""
        for handle in self._handles:
            handle.remove()
        for submodule in self.module.modules():
            function = submodule.__dict__.get("_gradient_checkpointing_func")
            if function is not None and getattr(function, "tierstore_offload", None) is self.offload:
                setattr(submodule, "_gradient_checkpointing_func", function.__wrapped__)  # noqa: B010
