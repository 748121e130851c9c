"""Where the bytes of an object go across a tier's paths: pure functions, no I/O.

``stripe`` splits every object across the paths in proportion to their weights (measured
bandwidth), so that all paths finish together; ``place`` sends each whole object to one path, in
the same proportion over many objects (MLP-Offload's per-subgroup placement).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PAGE = 4096
"""Stripe edges fall on page multiples: the source and destination buffers of every extent stay
page-aligned, which O_DIRECT needs to avoid bounce copies."""


@dataclass(frozen=True)
class Extent:
    """Bytes ``[offset, offset + length)`` of an object, stored on path ``path`` (an index)."""

    path: int
    offset: int
    length: int


def stripe(
    nbytes: int, weights: Sequence[float], granules: Sequence[int] | None = None, *, unit: int = PAGE
) -> list[Extent]:
    """Split ``nbytes`` into at most one contiguous extent per path, sized by ``weights``.

    Each extent is stored as its own backend object from offset 0, so backend offset alignment
    always holds. Edges fall on multiples of ``unit``; a path whose share is at least its granule
    (e.g. its chunk size) gets a whole number of granules, so its backend issues no runt chunk
    except at the object's end. Zero-weight paths and zero-length extents are left out; a zero-size
    object has no extents. Sizes are assigned by largest remaining deficit, so the split is as
    close to the weights as the rounding allows.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero: {list(weights)}")
    if nbytes == 0:
        return []
    granules = granules or [unit] * len(weights)
    total_units = -(-nbytes // unit)
    total_weight = sum(weights)
    ideal = [total_units * w / total_weight for w in weights]
    allocated = []
    for share, granule in zip(ideal, granules, strict=True):
        per = max(1, granule // unit)
        allocated.append(int(share // per) * per if share >= per else int(share))
    remaining = total_units - sum(allocated)
    while remaining > 0:
        neediest = max(range(len(weights)), key=lambda i: (ideal[i] - allocated[i], weights[i]))
        grant = min(remaining, max(1, math.ceil(ideal[neediest] - allocated[neediest])))
        allocated[neediest] += grant
        remaining -= grant
    extents = []
    offset = 0
    for path, units in enumerate(allocated):
        if units:
            length = min(units * unit, nbytes - offset)
            extents.append(Extent(path, offset, length))
            offset += length
    return extents


def place(nbytes: int, weights: Sequence[float], assigned: Sequence[float]) -> int:
    """The path that would finish ``nbytes`` first, given the bytes ``assigned`` to each so far.

    Over many objects this sends bytes to paths in proportion to ``weights`` (an earliest-finish
    rule, so a faster path takes more objects and no path runs ahead).
    """
    if len(weights) != len(assigned) or not any(w > 0 for w in weights):
        raise ValueError("need one assigned total per path and at least one positive weight")
    candidates = [i for i, w in enumerate(weights) if w > 0]
    return min(candidates, key=lambda i: ((assigned[i] + nbytes) / weights[i], i))
