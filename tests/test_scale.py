"""Many objects: per-object costs stay flat as the count grows (issue 11)."""

from __future__ import annotations

import time

import torch
from tierstore.backends import open_backend

from tierstore import Tier, TierStore


def flush_seconds_per_object(count: int) -> float:
    """Seconds per object to flush ``count`` dirty 64-byte objects to a DRAM tier."""
    with TierStore([Tier("dram", open_backend("dram://"))], cache_budget=1 << 30) as store:
        puts = [store.put(f"k{index}", torch.full((16,), index, dtype=torch.int32)) for index in range(count)]
        for put in puts:
            put.result()
        start = time.perf_counter()
        store.flush()
        return (time.perf_counter() - start) / count


def test_flush_cost_per_object_does_not_grow_with_the_count() -> None:
    """Sorting the whole queue on every dispatch made 8x the objects cost ~8x more each."""
    small = min(flush_seconds_per_object(500) for _ in range(2))
    large = flush_seconds_per_object(4_000)
    assert large / small < 2.5, f"{large * 1e6:.0f} us/object at 4k vs {small * 1e6:.0f} us at 500"
