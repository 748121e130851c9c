"""The I/O model of a pass over offloaded objects (pure functions, no I/O).

A *pass* (one optimizer step, say) visits every object in an order: read it from its tier unless
it is still in DRAM, update it, write it back unless it stays in DRAM. With MLP-Offload's
alternating order (forward, then reverse), the objects at the end of one pass are the first of the
next, so an object kept in DRAM saves both its write now and its read next pass.

The model predicts a pass's time from the paths' bandwidths (striped tier: every path serves its
share of the reads and the writes, by the tier's own `stripe_weight`, and the slowest path sets the
time), and chooses which objects to keep cached: walking back from the end of the pass, every object
that still fits beside the working set. That is never worse than MLP-Offload's static choice (the
last K objects that fit), since it takes those and then any smaller ones further back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .bandwidth import PathSpeed, stripe_weight
from .config import StripeBy
from .errors import BandwidthUnknownError, ConfigError
from .store import TierStore


def stripe_weights(paths: Sequence[PathSpeed], stripe_by: StripeBy = "round-trip") -> list[float]:
    """Each path's share of a striped object, as a tier striping by ``stripe_by`` gives it
    (`stripe_weight`): by default, shares that make one write plus one read of a stripe take equal
    time on every path.

    Raises:
        ConfigError: no paths, or a path without positive read and write bandwidth.
    """
    if not paths or any(p.read <= 0 or p.write <= 0 for p in paths):
        raise ConfigError(f"paths: every path needs positive read and write bandwidth, got {list(paths)}")
    return [stripe_weight(p.read, p.write, stripe_by) for p in paths]


def transfer_seconds(
    paths: Sequence[PathSpeed], weights: Sequence[float], read_bytes: float, write_bytes: float
) -> float:
    """Time to read and write these bytes striped by ``weights``: the slowest path's time."""
    total = sum(weights)
    return max(
        (read_bytes / p.read + write_bytes / p.write) * w / total for p, w in zip(paths, weights, strict=True)
    )


@dataclass(frozen=True)
class TierSpeeds:
    """The paths of the tier a workload's objects are placed on, and how the tier stripes over
    them: what a plan of their I/O needs to predict as the tier places."""

    tier: str
    """The tier's name."""
    paths: list[PathSpeed]
    """Its paths with a bandwidth estimate."""
    stripe_by: StripeBy
    """The tier's ``stripe_by``: which bandwidth sets each path's share."""


def placement_speeds(store: TierStore) -> TierSpeeds:
    """The speeds a workload plans its I/O with: those of the store's first tier, where its objects
    are placed, from [`TierStore.bandwidths`][] (measured online, else as configured or probed; a
    path without an estimate yet is left out), with the tier's striping.

    Raises [`BandwidthUnknownError`][] while no path of the tier has an estimate, rather than plan
    with made-up speeds: a plan that depends on them waits for the store to measure some traffic (or
    configure the paths' ``bandwidth``, or set ``probe = true``, to plan at once)."""
    tier, speeds = next(iter(store.bandwidths().items()), ("", []))
    if not speeds:
        raise BandwidthUnknownError(
            f"tier {tier!r}: no path has a bandwidth estimate yet (none configured or probed, and too "
            "little traffic measured)"
        )
    return TierSpeeds(tier, speeds, store.tiers[0].stripe_by)


@dataclass(frozen=True)
class ExplainedPlan:
    """A plan of the I/O model that says in words how it was made."""

    explanation: list[str] = field(default_factory=list, kw_only=True)
    """The reasoning, one line per step: the inputs, the choice and the predicted time."""

    def explain(self) -> str:
        """The explanation as text, a line per step."""
        return "\n".join(self.explanation)


@dataclass(frozen=True)
class PassPlan(ExplainedPlan):
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


def plan_pass(
    paths: Sequence[PathSpeed],
    budget: int,
    sizes: Sequence[int],
    order: Sequence[int] | None = None,
    *,
    working_bytes: int | None = None,
    compute_seconds: float = 0.0,
    stripe_by: StripeBy = "round-trip",
) -> PassPlan:
    """Stripe weights, objects to keep cached, and the predicted time of a steady-state pass.

    ``working_bytes`` is DRAM the pass itself needs (the object being updated and those being
    prefetched or written back); by default two of the largest objects. ``compute_seconds`` is the
    update's own time, overlapped with I/O. ``stripe_by`` is the tier's (see `stripe_weights`).
    """
    order = list(range(len(sizes))) if order is None else list(order)
    if sorted(order) != list(range(len(sizes))):
        raise ConfigError(f"order: must visit each of the {len(sizes)} objects exactly once, got {order}")
    weights = stripe_weights(paths, stripe_by)
    working = 2 * max(sizes, default=0) if working_bytes is None else working_bytes
    room = max(0, budget - working)
    total = sum(sizes)

    keep = keep_from_end(sizes, room, order)
    kept = sum(sizes[index] for index in keep)
    static_kept = sum(sizes[index] for index in last_that_fit(sizes, room, order))

    def seconds(cached: int) -> float:
        io = transfer_seconds(paths, weights, total - cached, total - cached)
        return max(io, compute_seconds)

    plan = PassPlan(
        weights=weights,
        keep=keep,
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


def keep_from_end(sizes: Sequence[int], room: int, order: Sequence[int]) -> list[int]:
    """The model's choice of objects to keep in DRAM at the end of a pass that visits ``sizes``
    (bytes) in ``order``, with ``room`` bytes to keep them in: walking back from the end, every
    object that still fits beside those taken (sorted indices). Each kept byte saves a write now
    and a read next pass on every path alike, so the paths' speeds change the pass's time, not
    the choice."""
    keep: list[int] = []
    kept = 0
    for index in reversed(order):
        if kept + sizes[index] <= room:
            keep.append(index)
            kept += sizes[index]
    return sorted(keep)


def last_that_fit(sizes: Sequence[int], room: int, order: Sequence[int]) -> list[int]:
    """MLP-Offload's static choice, as `keep_from_end` takes its arguments: the objects from the end
    of the pass back to the first that does not fit (sorted indices)."""
    keep: list[int] = []
    kept = 0
    for index in reversed(order):
        if kept + sizes[index] > room:
            break
        keep.append(index)
        kept += sizes[index]
    return sorted(keep)
