"""I/O performance model of a pass over offloaded objects (pure functions, no I/O).

A *pass* (one optimizer step, say) visits every object in an order: read it from its tier unless
it is still in DRAM, update it, write it back unless it stays in DRAM. With MLP-Offload's
alternating order (forward, then reverse), the objects at the end of one pass are the first of the
next, so an object kept in DRAM saves both its write now and its read next pass.

The model predicts a pass's time from the paths' bandwidths (striped tier: every path serves its
share of the reads and the writes, and the slowest path sets the time), chooses stripe weights,
and chooses which objects to keep cached: walking back from the end of the pass, every object
that still fits beside the working set. That is never worse than MLP-Offload's static choice (the
last K objects that fit), since it takes those and then any smaller ones further back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import ConfigError


@dataclass(frozen=True)
class PathSpeed:
    name: str
    read: float
    """Bytes per second."""
    write: float


def stripe_weights(paths: Sequence[PathSpeed]) -> list[float]:
    """Shares that make one write plus one read of a stripe take equal time on every path."""
    if not paths or any(p.read <= 0 or p.write <= 0 for p in paths):
        raise ConfigError(f"paths: every path needs positive read and write bandwidth, got {list(paths)}")
    return [1.0 / (1.0 / p.read + 1.0 / p.write) for p in paths]


def transfer_seconds(
    paths: Sequence[PathSpeed], weights: Sequence[float], read_bytes: float, write_bytes: float
) -> float:
    """Time to read and write these bytes striped by ``weights``: the slowest path's time."""
    total = sum(weights)
    return max(
        (read_bytes / p.read + write_bytes / p.write) * w / total for p, w in zip(paths, weights, strict=True)
    )


@dataclass(frozen=True)
class PassPlan:
    weights: list[float]
    keep: list[int]
    """Objects (indices into ``sizes``) to leave in DRAM at the end of the pass."""
    read_bytes: int
    write_bytes: int
    predicted_seconds: float
    """Steady-state pass time with ``keep`` cached."""
    no_cache_seconds: float
    static_seconds: float
    """With MLP-Offload's static choice: the last K objects of the pass that fit."""
    explanation: list[str] = field(default_factory=list)

    def explain(self) -> str:
        return "\n".join(self.explanation)


def plan_pass(
    paths: Sequence[PathSpeed],
    budget: int,
    sizes: Sequence[int],
    order: Sequence[int] | None = None,
    *,
    working_bytes: int | None = None,
    compute_seconds: float = 0.0,
) -> PassPlan:
    """Stripe weights, objects to keep cached, and the predicted time of a steady-state pass.

    ``working_bytes`` is DRAM the pass itself needs (the object being updated and those being
    prefetched or written back); by default two of the largest objects. ``compute_seconds`` is the
    update's own time, overlapped with I/O.
    """
    order = list(range(len(sizes))) if order is None else list(order)
    if sorted(order) != list(range(len(sizes))):
        raise ConfigError(f"order: must visit each of the {len(sizes)} objects exactly once, got {order}")
    weights = stripe_weights(paths)
    working = 2 * max(sizes, default=0) if working_bytes is None else working_bytes
    room = max(0, budget - working)
    total = sum(sizes)

    keep: list[int] = []
    kept = 0
    for index in reversed(order):
        if kept + sizes[index] <= room:
            keep.append(index)
            kept += sizes[index]
    static_kept = 0
    for index in reversed(order):
        if static_kept + sizes[index] > room:
            break
        static_kept += sizes[index]

    def seconds(cached: int) -> float:
        io = transfer_seconds(paths, weights, total - cached, total - cached)
        return max(io, compute_seconds)

    plan = PassPlan(
        weights=weights,
        keep=sorted(keep),
        read_bytes=total - kept,
        write_bytes=total - kept,
        predicted_seconds=seconds(kept),
        no_cache_seconds=seconds(0),
        static_seconds=seconds(static_kept),
    )
    share = [w / sum(weights) for w in weights]
    plan.explanation.extend(
        [
            f"{len(sizes)} objects, {total / 1e9:.3f} GB; DRAM budget {budget / 1e9:.3f} GB, "
            f"{working / 1e9:.3f} GB of it for the working set, {room / 1e9:.3f} GB left to keep objects",
            "stripe shares: "
            + ", ".join(
                f"{p.name} {s:.1%} (read {p.read / 1e9:.2f}, write {p.write / 1e9:.2f} GB/s)"
                for p, s in zip(paths, share, strict=True)
            ),
            f"keep {len(keep)} objects ({kept / 1e9:.3f} GB) from the end of the pass: they open the "
            "next (reversed) pass, saving their write now and their read then",
            f"predicted pass: {plan.predicted_seconds:.3f} s (static last-K choice "
            f"{plan.static_seconds:.3f} s, nothing cached {plan.no_cache_seconds:.3f} s)",
        ]
    )
    return plan


# -- activation spill ------------------------------------------------------------------------------
# The same paths and striping, applied to the other big consumer of training memory: tensors saved
# in forward for backward. A spilled tensor is written while forward goes on and read back before
# backward needs it; the simulation below replays one profiled step under exactly the policy that
# tierstore.activations executes, so its predicted time is what the plan is judged by.


@dataclass(frozen=True)
class SavedTensor:
    """One tensor saved for backward, as profiled over a step with stalls removed."""

    nbytes: int
    saved_at: float
    """Compute seconds from the start of forward to the moment it was saved."""
    used_at: float
    """Compute seconds from the start of forward to backward's first use of it."""


@dataclass(frozen=True)
class SpillPlan:
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
    explanation: list[str] = field(default_factory=list)

    def explain(self) -> str:
        return "\n".join(self.explanation)


@dataclass(frozen=True)
class _Replay:
    seconds: float
    write_stall: float
    read_stall: float
    peak_resident: int


def replay_spill(
    paths: Sequence[PathSpeed],
    budget: int,
    tensors: Sequence[SavedTensor],
    spill: set[int],
    compute_seconds: float,
) -> _Replay:
    """Replay one step: what it costs to spill ``spill`` and keep the rest, within ``budget``.

    The policy replayed (and executed by ``tierstore.activations``): a spilled tensor is resident
    from its save until its write ends; writes and reads share the paths in issue order; forward
    waits at a save only while the new tensor would exceed ``budget`` and writes are in flight. At
    the end of forward, and after each use, reads start in use order for as many spilled tensors
    as ``budget`` holds (one whose write is still in flight stays resident instead: no read); a use
    waits for its read. A kept tensor is resident from its save to its use.
    """
    weights = stripe_weights(paths)
    channel = 0.0  # when the shared I/O paths are next free
    stall_w = stall_r = 0.0
    writing: dict[int, float] = {}  # spilled tensor -> end of its write, while resident for it
    ready: dict[int, float] = {}  # spilled tensor -> when its data is back (or kept resident)
    resident = peak = 0

    def occupy(nbytes: int) -> None:
        nonlocal resident, peak
        resident += nbytes
        peak = max(peak, resident)

    def settle(now: float) -> None:
        nonlocal resident
        for i, end in list(writing.items()):
            if end <= now:
                del writing[i]
                resident -= tensors[i].nbytes

    def wait_for_a_write(now: float) -> float:
        end = min(writing.values())
        settle(max(now, end))
        return max(now, end)

    for i in sorted(range(len(tensors)), key=lambda i: tensors[i].saved_at):
        tensor = tensors[i]
        now = tensor.saved_at + stall_w
        settle(now)
        while resident + tensor.nbytes > budget and writing:
            later = wait_for_a_write(now)
            stall_w += later - now
            now = later
        occupy(tensor.nbytes)
        if i in spill:
            channel = max(now, channel) + transfer_seconds(paths, weights, 0, tensor.nbytes)
            writing[i] = channel
    forward_end = max((t.saved_at for t in tensors), default=0.0) + stall_w

    uses = sorted(range(len(tensors)), key=lambda i: tensors[i].used_at)
    pending = [i for i in uses if i in spill]
    cursor = 0

    def issue(now: float, force: bool = False) -> None:
        nonlocal cursor, channel
        settle(now)
        while cursor < len(pending):
            j = pending[cursor]
            if j in writing:  # still resident: handed back without a read
                del writing[j]
                ready[j] = now
            elif resident + tensors[j].nbytes <= budget or force:
                channel = max(now, channel) + transfer_seconds(paths, weights, tensors[j].nbytes, 0)
                ready[j] = channel
                occupy(tensors[j].nbytes)
                force = False
            else:
                return
            cursor += 1

    issue(forward_end)
    for i in uses:
        now = tensors[i].used_at + stall_w + stall_r
        issue(now)
        if i in spill:
            start = now
            while i not in ready:  # the budget holds its read back until writes end
                if writing:
                    now = wait_for_a_write(now)
                issue(now, force=not writing)
            now = max(now, ready[i])
            stall_r += now - start
        resident -= tensors[i].nbytes
        issue(now)
    return _Replay(compute_seconds + stall_w + stall_r, stall_w, stall_r, peak)


def plan_spill(
    paths: Sequence[PathSpeed],
    budget: int,
    tensors: Sequence[SavedTensor],
    compute_seconds: float,
) -> SpillPlan:
    """Which saved tensors to keep in memory, TERAIO-style: from the profiled lifetimes.

    Start from spilling everything, then keep tensors in order of their shortest lifetime (saved
    late, used early: the last layers, whose write and read can hardly hide behind compute) as long
    as each one lowers the replayed step time and the resident peak stays within ``budget``.
    """
    if not tensors:  # nothing to spill is a plan too, and needs no bandwidth to make
        return SpillPlan([], frozenset(), [], compute_seconds, compute_seconds, 0.0, 0.0, 0, compute_seconds)
    spill = set(range(len(tensors)))
    spill_all = replay_spill(paths, budget, tensors, spill, compute_seconds)
    best = spill_all
    for i in sorted(spill, key=lambda i: tensors[i].used_at - tensors[i].saved_at):
        trial = replay_spill(paths, budget, tensors, spill - {i}, compute_seconds)
        if trial.peak_resident <= budget and trial.seconds <= best.seconds:
            spill.discard(i)
            best = trial
    keep = sorted(set(range(len(tensors))) - spill)
    use_order = sorted(spill, key=lambda i: tensors[i].used_at)
    spilled_bytes = sum(tensors[i].nbytes for i in spill)
    plan = SpillPlan(
        keep=keep,
        spill=frozenset(spill),
        use_order=use_order,
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
            "paths: "
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
