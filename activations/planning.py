"""TERAIO's lifetime-aware plan (``plan="lifetime"``): profile, plan, follow the plan.

The first steps spill everything and profile each saved tensor's size, save time and first use
(two steps saving the same sequence: the first one warms up); :func:`tierstore.model.plan_spill`
then decides which to keep in memory (the short-lived ones of the last layers) by replaying the
step under the same :class:`~tierstore.spill_policy.SpillPolicy` the runtime follows, with the
tier's measured bandwidths. The plan is reused while the sequence of saved tensors stays the same
and rebuilt from a fresh profile when it changes.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from ..errors import BandwidthUnknownError
from ..model import SavedTensor, SpillPlan, placement_speeds, plan_spill
from ..spill_policy import SpillPolicy
from ..store import TierStore
from .entries import Signature, Step
from .options import Plan


class Planner:
    """Which policy each step runs under, the profile it is built from, and what it says.

    Args:
        store: whose measured bandwidths the plan is built for.
        budget: the offloader's memory budget in bytes, which the plan keeps tensors within.
        mode: ``"lifetime"`` plans from profiles; ``"all"`` and ``"none"`` never plan (every step
            runs under the policy that spills everything; with ``"none"`` nothing reaches it).
        lock: the offloader's lock.
        stats: the offloader's counters (updated under ``lock``).
    """

    def __init__(
        self, store: TierStore, budget: int, mode: Plan, lock: threading.Condition, stats: dict[str, float]
    ) -> None:
        self._store = store
        self._budget = budget
        self.mode: Plan = mode
        self._lock = lock
        self._stats = stats
        self._numbers = itertools.count(1)
        self._plan: SpillPlan | None = None
        self._signature: Signature = []
        """The saved sequence the plan was built for."""
        self._profiled: Step | None = None
        """The step the current plan was built from."""
        self._profiling: Step | None = None
        """The latest step that ran without a plan, to build the next plan from."""
        self._previous_profile: Step | None = None

    def start_step(self) -> Step:
        """A new step under the current plan's policy, the plan first rebuilt if a fresh profile
        is ready."""
        self._maybe_replan()
        with self._lock:
            policy = self._plan.policy() if self._plan is not None else SpillPolicy()
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
            if self._plan is None:
                return {}
            return {
                "predicted_step_s": self._plan.predicted_seconds,
                "planned_keep_bytes": sum(self._signature[i][0] for i in self._plan.keep),
            }

    def explain(self, min_bytes: int) -> str:
        """Which saved tensors are kept in memory and which are spilled, and why."""
        if self.mode == "none":
            return "plan 'none': every saved tensor stays in memory; the hooks only count bytes"
        rule = (
            f"tensors under {min_bytes} bytes and parameters (or views of them) always stay in "
            "memory; the same bytes saved several times are spilled once"
        )
        if self.mode == "all":
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
        tensors = [
            SavedTensor(
                e.capture.nbytes, e.saved_at, e.used_at if e.used_at is not None else profiled.last_use
            )
            for e in profiled.entries
        ]
        try:
            speeds = placement_speeds(self._store) if tensors else []  # nothing to spill needs no speed
        except BandwidthUnknownError:
            return  # the tier has no estimate yet: profile on
        plan = plan_spill(speeds, self._budget, tensors, profiled.last_use)
        with self._lock:
            self._plan = plan
            self._signature = profiled.signature()
            self._profiled = profiled
            self._stats["plans_built"] += 1
