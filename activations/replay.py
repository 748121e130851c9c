"""The activation spill simulator: one profiled step replayed on a simulated timeline, and the
plans judged by it.

The I/O model of a pass (`tierstore.pass_plan`) applied to the other big consumer of training
memory: tensors saved in forward for backward. A spilled tensor is written while forward goes on and
read back before backward needs it, on the paths of the tier the store places it on, striped as that
tier stripes. The replay executes the `SpillPolicy` that `tierstore.activations` executes at run
time, so its predicted time, by which a plan is judged, follows the runtime's decisions by
construction.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..bandwidth import PathSpeed
from ..config import StripeBy
from ..pass_plan import ExplainedPlan, stripe_weights, transfer_seconds
from .spill_policy import ReadAhead, Residence, Room, SpillPolicy


@dataclass(frozen=True)
class SavedTensor:
    """One tensor saved for backward, as profiled over a step with stalls removed."""

    nbytes: int
    saved_at: float
    """Compute seconds from the start of forward to the moment it was saved."""
    used_at: float
    """Compute seconds from the start of forward to backward's first use of it."""


@dataclass(frozen=True)
class SpillPlan(ExplainedPlan):
    keep: list[int]
    """Tensors (indices in save order) kept in memory; the others are spilled."""
    spill: frozenset[int]
    use_order: list[int]
    """Spilled tensors in the order backward uses them: the order reads are started in."""
    compute_seconds: float
    predicted_seconds: float
    """Forward plus backward, stalls included."""
    write_stall_seconds: float
    read_stall_seconds: float
    peak_resident_bytes: int
    spill_all_seconds: float
    """The same step with every tensor spilled (the ``"all"`` plan), for comparison."""

    def policy(self) -> SpillPolicy:
        """The policy a step following this plan runs under."""
        return SpillPolicy(self.spill, tuple(self.use_order))


@dataclass(frozen=True)
class _Replay:
    seconds: float
    write_stall: float
    read_stall: float
    peak_resident: int
    overflow_bytes: int
    """Bytes that found no room in the budget and went to ordinary memory."""


def replay_spill(
    paths: Sequence[PathSpeed],
    budget: int,
    tensors: Sequence[SavedTensor],
    spill: set[int],
    compute_seconds: float,
    *,
    stripe_by: StripeBy = "round-trip",
) -> _Replay:
    """Replay one step: what it costs to spill ``spill`` and keep the rest, within ``budget``.

    The step runs under the `SpillPolicy` of a plan that spills ``spill`` and reads back in the
    profiled use order, as ``tierstore.activations`` runs it. Memory is counted as the runtime's
    pool counts it: a saved tensor is resident from its save (a kept one until its use, a spilled
    one until its write ends unless read-ahead hands it back), and a spilled tensor again from the
    start of its read until its use. Writes and reads share the paths in issue order, striped by
    ``stripe_by`` (the tier's). Bytes that find no room go to ordinary memory (``overflow_bytes``).
    """
    policy = SpillPolicy(frozenset(spill), tuple(_use_order(spill, tensors)))
    return _StepReplay(paths, budget, tensors, policy, stripe_by).run(compute_seconds)


def _use_order(spill: Collection[int], tensors: Sequence[SavedTensor]) -> list[int]:
    """The spilled tensors in the order backward used them when profiled."""
    return sorted(spill, key=lambda i: tensors[i].used_at)


class _StepReplay:
    """One step on a simulated timeline: the `SpilledTensors` that ``policy`` decides for, with
    memory counted against ``budget`` and I/O timed on ``paths`` (striped by ``stripe_by``)."""

    def __init__(
        self,
        paths: Sequence[PathSpeed],
        budget: int,
        tensors: Sequence[SavedTensor],
        policy: SpillPolicy,
        stripe_by: StripeBy,
    ) -> None:
        self.paths, self.weights, self.budget = paths, stripe_weights(paths, stripe_by), budget
        self.tensors, self.policy = tensors, policy
        self.now = 0.0
        self.channel = 0.0
        """When the shared I/O paths are next free."""
        self.write_stall = self.read_stall = 0.0
        self.resident = self.peak = self.overflow = 0
        self.in_pool: set[int] = set()
        """Tensors whose bytes hold memory of the budget."""
        self.spilled: set[int] = set()
        self.writes: dict[int, float] = {}
        """Spilled tensor -> end of its write in flight (its capture is in memory until then)."""
        self.reads: dict[int, float] = {}
        """Spilled tensor -> end of its read in flight."""
        self.held: set[int] = set()
        """Spilled tensors in memory and in the store before their use."""
        self.handed_back: set[int] = set()
        self.used: set[int] = set()
        self.read_ahead: ReadAhead[int] = ReadAhead()

    def run(self, compute_seconds: float) -> _Replay:
        """Forward's saves in save order, then backward's uses in use order; the step takes
        ``compute_seconds`` plus the time it waited for room, writes and reads."""
        tensors = self.tensors
        for i in sorted(range(len(tensors)), key=lambda i: tensors[i].saved_at):
            self._save(i, tensors[i].saved_at + self.write_stall)
        self._advance(max((t.saved_at for t in tensors), default=0.0) + self.write_stall)
        self.read_ahead = ReadAhead(self.policy.read_order(sorted(self.spilled)))
        self.read_ahead.advance(self)
        for i in sorted(range(len(tensors)), key=lambda i: tensors[i].used_at):
            self._use(i, tensors[i].used_at + self.write_stall + self.read_stall)
        stalls = self.write_stall + self.read_stall
        return _Replay(compute_seconds + stalls, self.write_stall, self.read_stall, self.peak, self.overflow)

    # -- what the policy asks -------------------------------------------------------------------
    def residence(self, index: int) -> Residence:
        if index not in self.spilled or index in self.used or index in self.reads:
            return Residence.DONE
        if index in self.writes:
            return Residence.WRITING
        return Residence.AHEAD if index in self.held else Residence.STORED

    def hand_back(self, index: int) -> None:
        self.handed_back.add(index)

    def try_read_ahead(self, index: int) -> bool:
        if not self._fits(index):
            return False
        self._read(index)
        return True

    def drop(self, index: int) -> None:
        self.held.discard(index)
        self._release(index)

    # -- the step -------------------------------------------------------------------------------
    def _save(self, index: int, now: float) -> None:
        """Forward saves the tensor: room for its capture, then its write if it is spilled."""
        self._advance(now)
        start = self.now
        while not self._fits(index) and self.policy.room_to_save(writing=bool(self.writes)) is Room.WAIT:
            self._advance(min(self.writes.values()))
        self.write_stall += self.now - start
        if not self._fits(index):  # it stays where autograd keeps it
            self.overflow += self.tensors[index].nbytes
            return
        self._occupy(index)
        if self.policy.spills(index):
            self.spilled.add(index)
            self.writes[index] = self._transfer(write_bytes=self.tensors[index].nbytes)

    def _use(self, index: int, now: float) -> None:
        """Backward uses the tensor: its bytes back (waiting for them), then freed."""
        self._advance(now)
        if index in self.spilled:
            start = self.now
            self._bring_back(index)
            self.read_stall += self.now - start
        self.used.add(index)
        self.held.discard(index)
        if index not in self.writes:  # a capture being written is let go of when its write ends
            self._release(index)
        self.read_ahead.advance(self)

    def _bring_back(self, index: int) -> None:
        """Advance to the moment the spilled tensor's bytes are in memory: forwarded (its capture
        is still there), read ahead, or read now, after making room for them."""
        if self.residence(index) is Residence.STORED:
            while not self._fits(index):
                room = self.policy.room_to_read(
                    self, self.read_ahead, index, writing=bool(self.writes), reading=bool(self.reads)
                )
                if room is Room.NONE:
                    break
                if room is Room.WAIT:
                    self._advance(min([*self.writes.values(), *self.reads.values()]))
            self._read(index)
        if index in self.reads:
            self._advance(self.reads[index])

    def _read(self, index: int) -> None:
        """Start reading the tensor back: into the budget if it fits, else into ordinary memory."""
        if self._fits(index):
            self._occupy(index)
        else:
            self.overflow += self.tensors[index].nbytes
        self.reads[index] = self._transfer(read_bytes=self.tensors[index].nbytes)

    def _advance(self, now: float) -> None:
        """Move the clock to ``now``: writes and reads that ended by then are done."""
        self.now = max(self.now, now)
        for index, end in list(self.writes.items()):
            if end <= self.now:
                del self.writes[index]
                handed_back = index in self.handed_back
                if self.policy.keeps_after_write(handed_back=handed_back, used=index in self.used):
                    self.held.add(index)
                else:
                    self._release(index)
        for index, end in list(self.reads.items()):
            if end <= self.now:
                del self.reads[index]
                self.held.add(index)

    def _transfer(self, *, read_bytes: int = 0, write_bytes: int = 0) -> float:
        """Queue I/O on the shared paths; when it ends."""
        start = max(self.now, self.channel)
        self.channel = start + transfer_seconds(self.paths, self.weights, read_bytes, write_bytes)
        return self.channel

    def _fits(self, index: int) -> bool:
        return self.resident + self.tensors[index].nbytes <= self.budget

    def _occupy(self, index: int) -> None:
        self.in_pool.add(index)
        self.resident += self.tensors[index].nbytes
        self.peak = max(self.peak, self.resident)

    def _release(self, index: int) -> None:
        if index in self.in_pool:
            self.in_pool.discard(index)
            self.resident -= self.tensors[index].nbytes


def plan_spill(
    paths: Sequence[PathSpeed],
    budget: int,
    tensors: Sequence[SavedTensor],
    compute_seconds: float,
    *,
    stripe_by: StripeBy = "round-trip",
) -> SpillPlan:
    """Which saved tensors to keep in memory, TERAIO-style: from the profiled lifetimes.

    Start from spilling everything, then keep tensors in order of their shortest lifetime (saved
    late, used early: the last layers, whose write and read can hardly hide behind compute) as long
    as each one lowers the replayed step time and sends no bytes to ordinary memory (none that the
    budget could not hold). ``stripe_by`` is the tier's: how its paths share the bytes (see
    `stripe_weights`).
    """
    if not tensors:  # nothing to spill is a plan too, and needs no bandwidth to make
        return SpillPlan([], frozenset(), [], compute_seconds, compute_seconds, 0.0, 0.0, 0, compute_seconds)
    spill = set(range(len(tensors)))
    spill_all = replay_spill(paths, budget, tensors, spill, compute_seconds, stripe_by=stripe_by)
    best = spill_all
    for i in sorted(spill, key=lambda i: tensors[i].used_at - tensors[i].saved_at):
        trial = replay_spill(paths, budget, tensors, spill - {i}, compute_seconds, stripe_by=stripe_by)
        if trial.overflow_bytes == 0 and trial.seconds <= best.seconds:
            spill.discard(i)
            best = trial
    keep = sorted(set(range(len(tensors))) - spill)
    spilled_bytes = sum(tensors[i].nbytes for i in spill)
    plan = SpillPlan(
        keep=keep,
        spill=frozenset(spill),
        use_order=_use_order(spill, tensors),
        compute_seconds=compute_seconds,
        predicted_seconds=best.seconds,
        write_stall_seconds=best.write_stall,
        read_stall_seconds=best.read_stall,
        peak_resident_bytes=best.peak_resident,
        spill_all_seconds=spill_all.seconds,
    )
    plan.explanation.extend(
        [
            f"{len(tensors)} saved tensors, {sum(t.nbytes for t in tensors) / 1e6:.1f} MB; budget "
            f"{budget / 1e6:.1f} MB; compute {compute_seconds:.3f} s per step",
            f"paths (striped by {stripe_by}): "
            + ", ".join(f"{p.name} (read {p.read / 1e9:.2f}, write {p.write / 1e9:.2f} GB/s)" for p in paths),
            f"keep {len(keep)} ({sum(tensors[i].nbytes for i in keep) / 1e6:.1f} MB): the shortest "
            "lifetimes, whose I/O would not hide behind compute",
            f"spill {len(spill)} ({spilled_bytes / 1e6:.1f} MB), read back in backward's order as the "
            "budget allows",
            f"predicted step {best.seconds:.3f} s (write stalls {best.write_stall:.3f} s, read stalls "
            f"{best.read_stall:.3f} s; spilling everything {spill_all.seconds:.3f} s); resident peak "
            f"{best.peak_resident / 1e6:.1f} MB",
        ]
    )
    return plan


def keep_on_device(
    tensors: Sequence[SavedTensor], to_host: float, to_device: float, budget: int
) -> list[int]:
    """Which saved tensors of a device to leave there, never copied (the third place beside host
    memory and storage; the choice between those two is `plan_spill`'s).

    A tensor whose copy to host memory and back, at the bus's measured bandwidths, takes longer
    than its lifetime (from its save to backward's first use, on the device's clock) cannot hide
    behind the compute in between: copying it would stall. Such tensors stay, the shortest
    lifetimes first, as long as their bytes fit ``budget``.

    Args:
        tensors: the profiled step's saved tensors, timed on the device's clock.
        to_host: the bus's bandwidth from the device to host memory (bytes per second).
        to_device: its bandwidth back (bytes per second).
        budget: the most bytes to leave on the device.

    Returns:
        Their indices, ascending.
    """
    if to_host <= 0 or to_device <= 0:
        return []
    chosen: list[int] = []
    held = 0
    for index in sorted(range(len(tensors)), key=lambda i: tensors[i].used_at - tensors[i].saved_at):
        tensor = tensors[index]
        round_trip = tensor.nbytes / to_host + tensor.nbytes / to_device
        if tensor.used_at - tensor.saved_at < round_trip and held + tensor.nbytes <= budget:
            chosen.append(index)
            held += tensor.nbytes
    return sorted(chosen)
