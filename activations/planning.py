"""TERAIO's lifetime-aware plan (``plan="lifetime"``): profile, plan, follow the plan.

The first steps run without a plan and profile each saved tensor's size, save time and first use
(two steps saving the same sequence: the first one warms up). A step in host memory is timed on
the host's clock with its waits taken out; a step on a device is timed by the device's own clock
(timed events of the caller's stream at each save and use, and around each wait for a copy back,
which is taken out), since the host only queues the device's work, ahead of it.

From the profile the plan decides where each saved tensor goes:

* a device's tensor whose copy to host memory and back, at the bus bandwidths measured by the
  profiled step's copies, takes longer than its lifetime stays on the device (`keep_on_device`,
  within half the ``device_budget``: the other half is for copies in flight and read-ahead);
* of the others, `plan_spill` keeps in host memory the ones whose write and read to storage could
  not hide (the short-lived ones of the last layers), replaying the step under the same
  `SpillPolicy` the runtime follows, with the tier's measured bandwidths and its striping; when host
  memory holds them all, none is spilled.

The plan is reused while the sequence of saved tensors stays the same and rebuilt from a fresh
profile when it changes.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from ..device_runtime import DeviceRuntime
from ..errors import BandwidthUnknownError
from ..pass_plan import placement_speeds
from ..store import TierStore
from .entries import Signature, Step
from .options import Plan
from .replay import SavedTensor, SpillPlan, keep_on_device, plan_spill
from .spill_policy import SpillPolicy


class Planner:
    """Which policy each step runs under, the profile it is built from, and what it says.

    Args:
        store: whose measured bandwidths the plan is built for.
        budget: the offloader's host memory budget in bytes, which the plan keeps tensors within.
        device_budget: the offloader's device memory budget in bytes.
        mode: ``"lifetime"`` plans from profiles; ``"all"`` and ``"none"`` never plan (every step
            runs under the policy without a plan; with ``"none"`` nothing reaches it).
        runtime: the device runtime whose clock times a device's steps.
        lock: the offloader's lock.
        stats: the offloader's counters (updated under ``lock``).
    """

    def __init__(
        self,
        store: TierStore,
        budget: int,
        device_budget: int,
        mode: Plan,
        runtime: DeviceRuntime,
        lock: threading.Condition,
        stats: dict[str, float],
    ) -> None:
        self._store = store
        self._budget = budget
        self._device_budget = device_budget
        self.mode: Plan = mode
        self._runtime = runtime
        self._lock = lock
        self._stats = stats
        self._numbers = itertools.count(1)
        self._policy: SpillPolicy | None = None
        self._plan: SpillPlan | None = None
        """The storage part of the plan (None when host memory holds every tensor it keeps)."""
        self._signature: Signature = []
        """The saved sequence the plan was built for."""
        self._profiled: Step | None = None
        """The step the current plan was built from."""
        self._profile: list[SavedTensor] = []
        """Its saved tensors as timed (on the device's clock for a device's step)."""
        self._profiling: Step | None = None
        """The latest step that ran without a plan, to build the next plan from."""
        self._previous_profile: Step | None = None

    def start_step(self) -> Step:
        """A new step under the current plan's policy, the plan first rebuilt if a fresh profile
        is ready."""
        self._maybe_replan()
        with self._lock:
            policy = self._policy if self._policy is not None else SpillPolicy()
            return Step(next(self._numbers), time.perf_counter(), policy, self._signature)

    def end_forward(self, step: Step, *, failed: bool) -> None:
        """Forward of ``step`` is over (under the lock); a step that ran without a plan and did
        not fail is the profile of the next plan."""
        step.end_forward()
        if not step.policy.planned and not failed:
            self._profiling = step

    def stats(self) -> dict[str, Any]:
        """The plan's prediction and what it keeps in memory, once there is a plan."""
        with self._lock:
            if self._policy is None:
                return {}
            sizes = [nbytes for nbytes, _ in self._signature]
            spilled = self._policy.spill or frozenset()
            figures: dict[str, Any] = {
                "planned_keep_bytes": sum(
                    nbytes
                    for index, nbytes in enumerate(sizes)
                    if index not in spilled and index not in self._policy.on_device
                ),
                "planned_device_bytes": sum(sizes[index] for index in self._policy.on_device),
            }
            if self._plan is not None:
                figures["predicted_step_s"] = self._plan.predicted_seconds
            return figures

    def explain(self, min_bytes: int) -> str:
        """Which saved tensors are left on the device, kept in memory or spilled, and why."""
        if self.mode == "none":
            return "plan 'none': every saved tensor stays in memory; the hooks only count bytes"
        rule = (
            f"tensors under {min_bytes} bytes and parameters (or views of them) always stay in "
            "memory; the same bytes saved several times are spilled once"
        )
        if self.mode == "all":
            return (
                "plan 'all': every other saved tensor in host memory is spilled, and every one of a "
                "device goes to host memory first and to storage beyond the host budget (the oldest "
                f"captures first), read back in reverse order; {rule}"
            )
        profiled, policy = self._profiled, self._policy
        if profiled is None or policy is None:
            return f"plan 'lifetime': no plan yet, the first two steps profile without a plan; {rule}"
        clock = "the device's clock" if profiled.device is not None else "the host's clock"
        lines = [f"plan 'lifetime', built from step {profiled.number} (timed on {clock}); {rule}"]
        if self._plan is not None:
            lines.append(self._plan.explain())
        spilled = policy.spill or frozenset()
        for entry, timed in zip(profiled.entries, self._profile, strict=True):
            if entry.index in policy.on_device:
                decision = "device (its copy out and back would outlast its lifetime)"
            elif entry.index in spilled:
                decision = "spill"
            else:
                decision = "keep (lifetime too short to hide I/O)"
            lines.append(
                f"  #{entry.index:<4} {entry.capture.nbytes / 2**20:9.2f} MiB {entry.dtype!s:15} saved at "
                f"{timed.saved_at * 1e3:8.1f} ms, used at {timed.used_at * 1e3:8.1f} ms: {decision}"
            )
        return "\n".join(lines)

    def _maybe_replan(self) -> None:
        """Build a plan from the last step that ran without one, once its backward is done and the
        step before it saved the same sequence: the first step of a sequence warms allocators and
        kernels up, and two alike show the sequence is stable enough to plan for."""
        with self._lock:
            profiled, previous = self._profiling, self._previous_profile
            if self.mode != "lifetime" or profiled is None or not profiled.profiled():
                return
            self._profiling = None
            self._previous_profile = profiled
            if previous is None or previous.signature() != profiled.signature():
                return
        tensors, compute = self._timeline(profiled)  # its backward is over: nothing changes it
        on_device: list[int] = []
        if profiled.device is not None:
            traffic = profiled.traffic
            to_host = traffic.to_host_bytes / traffic.to_host_seconds if traffic.to_host_seconds else 0.0
            to_device = (
                traffic.to_device_bytes / traffic.to_device_seconds if traffic.to_device_seconds else 0.0
            )
            on_device = keep_on_device(tensors, to_host, to_device, self._device_budget // 2)
        rest = [index for index in range(len(tensors)) if index not in set(on_device)]
        plan: SpillPlan | None = None
        spill: list[int] = []
        if sum(tensors[index].nbytes for index in rest) > self._budget:
            try:
                speeds = placement_speeds(self._store)
            except BandwidthUnknownError:
                return  # the tier has no estimate yet: profile on
            saved = [tensors[index] for index in rest]
            plan = plan_spill(speeds.paths, self._budget, saved, compute, stripe_by=speeds.stripe_by)
            spill = [rest[index] for index in plan.spill]
        use_order = sorted(spill, key=lambda index: tensors[index].used_at)
        first_use = sorted(range(len(tensors)), key=lambda index: tensors[index].used_at)
        policy = SpillPolicy(frozenset(spill), tuple(use_order), frozenset(on_device), tuple(first_use))
        with self._lock:
            self._policy, self._plan, self._profile = policy, plan, tensors
            self._signature = profiled.signature()
            self._profiled = profiled
            self._stats["plans_built"] += 1

    def _timeline(self, step: Step) -> tuple[list[SavedTensor], float]:
        """The step's saved tensors as profiled, and its compute seconds up to the last use: on
        the device's clock for a device's step, its waits for copies back taken out."""
        times = step.times
        if step.device is None or times is None:
            tensors = [
                SavedTensor(
                    e.capture.nbytes, e.saved_at, e.used_at if e.used_at is not None else step.last_use
                )
                for e in step.entries
            ]
            return tensors, step.last_use
        runtime = self._runtime
        events = [e.used_event for e in step.entries if e.used_event is not None]
        for event in [*events, *(after for _, after in times.stalls)]:
            runtime.synchronize(event)
        stalls = sorted(
            (runtime.elapsed(times.origin, before), runtime.elapsed(before, after))
            for before, after in times.stalls
        )

        def at(event: object) -> float:
            """Seconds from the step's origin to ``event``, the stalls before it taken out."""
            moment = runtime.elapsed(times.origin, event)
            return moment - sum(stalled for start, stalled in stalls if start < moment)

        used = {id(e): at(e.used_event) for e in step.entries if e.used_event is not None}
        last_use = max(used.values(), default=0.0)
        tensors = [
            SavedTensor(
                e.capture.nbytes,
                at(e.saved_event) if e.saved_event is not None else 0.0,
                used.get(id(e), last_use),
            )
            for e in step.entries
        ]
        return tensors, last_use
