"""Throughput measurement of paths and tiers (used by ``tierstore probe``, ``tierstore bench`` and
the benchmarks).

Each measurement streams ``count`` objects of ``nbytes`` from one page-aligned buffer, ``depth`` in
flight, then reads them back into another; a `Timeline` samples every path's byte counters
meanwhile, giving GB/s per path over time.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from datetime import UTC, datetime
from functools import partial
from typing import Any, Self

from tqdm import tqdm

from ..backends import open_backend
from ..bandwidth import ProbeCache, probe
from ..buffers import AlignedBuffer
from ..config import StoreConfig
from ..limits import Priority
from ..tier import Placement, Tier, TierPath

Progress = Callable[[int], None]


class Timeline:
    """GB/s per path over time, from the requests each path completed while the timeline ran.

    Each request's bytes are spread evenly over its duration, so a curve is smooth and correct
    even when one request spans many bins."""

    def __init__(self, paths: Sequence[TierPath], interval: float = 0.1) -> None:
        self.paths = list(paths)
        self.interval = interval
        self._start = self._stop = 0.0

    def __enter__(self) -> Self:
        self._start = time.monotonic()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop = time.monotonic()

    def rates(self) -> dict[str, list[tuple[float, float]]]:
        """Per path: (seconds since start at the end of each bin, GB/s in that bin)."""
        bins = max(1, math.ceil((self._stop - self._start) / self.interval))
        series: dict[str, list[tuple[float, float]]] = {}
        for path in self.paths:
            moved = [0.0] * bins
            for started, finished, nbytes, _ in list(path.scheduler.telemetry.history):
                began, ended = max(started, self._start), min(finished, self._stop)
                if ended <= began:
                    continue
                density = nbytes / (finished - started)
                first = int((began - self._start) / self.interval)
                last = min(bins - 1, int((ended - self._start) / self.interval))
                for index in range(first, last + 1):
                    low = max(began, self._start + index * self.interval)
                    high = min(ended, self._start + (index + 1) * self.interval)
                    moved[index] += density * max(0.0, high - low)
            series[path.name] = [
                (round((index + 1) * self.interval, 4), round(value / self.interval / 1e9, 4))
                for index, value in enumerate(moved)
            ]
        return series


def _pipeline(starts: Iterable[Callable[[], Future[Any]]], depth: int, progress: Progress | None) -> None:
    in_flight: deque[Future[Any]] = deque()
    for start in starts:
        if len(in_flight) >= depth:
            in_flight.popleft().result()
            if progress:
                progress(1)
        in_flight.append(start())
    while in_flight:
        in_flight.popleft().result()
        if progress:
            progress(1)


def measure_path(
    path: TierPath,
    nbytes: int,
    count: int,
    *,
    depth: int = 2,
    progress: Progress | None = None,
    between_phases: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write then read ``count`` objects on one path alone; GB/s of each phase.

    ``between_phases`` runs after the writes (e.g. to drop the page cache before the reads)."""
    source, target = _buffers(nbytes)
    names = [f"tierstore-bench-{index}" for index in range(count)]
    try:
        started = time.perf_counter()
        writes = (partial(path.write, name, source.memoryview(nbytes), Priority.CRITICAL) for name in names)
        _pipeline(writes, depth, progress)
        write_seconds = time.perf_counter() - started
        if between_phases is not None:
            between_phases()
        started = time.perf_counter()
        reads = (
            partial(path.read_into, name, target.memoryview(nbytes), Priority.CRITICAL) for name in names
        )
        _pipeline(reads, depth, progress)
        read_seconds = time.perf_counter() - started
    finally:
        for name in names:
            if path.backend.exists(name):
                path.backend.delete(name)
    return _figures(nbytes * count, write_seconds, read_seconds)


def measure_tier(
    tier: Tier,
    nbytes: int,
    count: int,
    *,
    depth: int = 2,
    progress: Progress | None = None,
    between: Callable[[int], None] | None = None,
    between_phases: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write then read ``count`` objects through the tier's placement; aggregate GB/s and each
    object's write time. ``between(index)`` runs before object ``index`` is written (to change
    conditions mid-run, e.g. slow a path down); ``between_phases`` after all the writes."""
    source, target = _buffers(nbytes)
    writes: list[Future[Placement]] = []
    object_seconds: dict[int, float] = {}

    def write(index: int) -> Future[Placement]:
        if between is not None:
            between(index)
        future = tier.write(f"tierstore-bench-{index}", source.memoryview(nbytes), Priority.CRITICAL)
        begun = time.perf_counter()
        future.add_done_callback(lambda _: object_seconds.__setitem__(index, time.perf_counter() - begun))
        writes.append(future)
        return future

    try:
        started = time.perf_counter()
        _pipeline((partial(write, index) for index in range(count)), depth, progress)
        write_seconds = time.perf_counter() - started
        if between_phases is not None:
            between_phases()
        started = time.perf_counter()
        target_view = target.memoryview(nbytes)
        reads = (partial(tier.read_into, write.result(), target_view, Priority.CRITICAL) for write in writes)
        _pipeline(reads, depth, progress)
        read_seconds = time.perf_counter() - started
    finally:
        for written in writes:
            if written.done() and written.exception() is None:
                tier.discard(written.result())
    figures = _figures(nbytes * count, write_seconds, read_seconds)
    figures["object_write_seconds"] = [round(object_seconds[i], 5) for i in sorted(object_seconds)]
    return figures


def measure_round_trips(
    tier: Tier, nbytes: int, count: int, *, between: Callable[[int], None] | None = None
) -> list[float]:
    """Seconds per object to write it through the tier and read it back, one object at a time
    (the access pattern of an offloaded optimizer step). ``between(index)`` runs before each."""
    source, target = _buffers(nbytes)
    seconds = []
    for index in range(count):
        if between is not None:
            between(index)
        started = time.perf_counter()
        placement = tier.write(
            f"tierstore-trip-{index}", source.memoryview(nbytes), Priority.CRITICAL
        ).result()
        try:
            tier.read_into(placement, target.memoryview(nbytes), Priority.CRITICAL).result()
        finally:
            tier.discard(placement)
        seconds.append(time.perf_counter() - started)
    return seconds


def run_probe(config: StoreConfig, size: int, refresh: bool) -> dict[str, Any]:
    """Bandwidth of every path of every tier, with where each figure came from: measured now, or
    the cache's (a probe of the same ``size`` at most a week old) unless ``refresh``."""
    cache = ProbeCache()
    report: dict[str, Any] = {}
    for index, tier in enumerate(config.tiers):
        for position, path in enumerate(tier.path_configs()):
            identity = json.dumps(path.backend, sort_keys=True, default=str)
            name = path.name or f"{tier.name}.{position}"
            probed = None if refresh else cache.get(identity, size)
            source = "cache"
            if probed is None:
                with open_backend(path.backend, where=f"tiers.{index}.backend") as backend:
                    probed = probe(backend, size)
                cache.put(identity, probed)
                source = "measured"
            report[name] = {
                "tier": tier.name,
                "backend": path.backend,
                **probed.bandwidth.as_gbps(),
                "probe_bytes": probed.nbytes,
                "source": source,
                "measured_at": datetime.fromtimestamp(probed.measured_at, UTC).isoformat(timespec="seconds"),
            }
    return report


def run_bench(config: StoreConfig, size: int, count: int) -> dict[str, Any]:
    """Each path alone, then each tier with all its paths, sampled over time."""
    report: dict[str, Any] = {"object_bytes": size, "objects": count, "tiers": {}}
    series: dict[str, list[tuple[float, float]]] = {}
    offset = 0.0
    for index, tier_config in enumerate(config.tiers):
        tier = Tier.from_config(tier_config, where=f"tiers.{index}")
        try:
            phases = 2 * count * (len(tier.paths) + 1)
            with tqdm(total=phases, desc=tier.name, unit="obj", file=sys.stderr) as bar:
                solo = {}
                with Timeline(tier.paths) as timeline:
                    for path in tier.paths:
                        solo[path.name] = measure_path(path, size, count, progress=bar.update)
                    combined = measure_tier(tier, size, count, progress=bar.update)
            for name, points in timeline.rates().items():
                series[name] = series.get(name, []) + [(t + offset, g) for t, g in points]
            offset = max((t for points in series.values() for t, _ in points), default=offset)
            combined.pop("object_write_seconds")
            report["tiers"][tier.name] = {
                "placement": tier.placement,
                "paths_alone": solo,
                "tier": combined,
                "sum_of_paths_alone": {
                    side: round(sum(figures[side] for figures in solo.values()), 4)
                    for side in ("write_gb_per_s", "read_gb_per_s")
                },
                "stats": tier.stats(),
            }
        finally:
            tier.close()
    report["timeline_gb_per_s"] = series
    return report


def _buffers(nbytes: int) -> tuple[AlignedBuffer, AlignedBuffer]:
    """A source filled with a non-zero pattern and a destination, both page-aligned."""
    source, target = AlignedBuffer(nbytes), AlignedBuffer(nbytes)
    source.view(nbytes).fill_(0xA5)
    return source, target


def _figures(moved: int, write_seconds: float, read_seconds: float) -> dict[str, Any]:
    return {
        "bytes": moved,
        "write_gb_per_s": round(moved / write_seconds / 1e9, 4),
        "read_gb_per_s": round(moved / read_seconds / 1e9, 4),
        "write_seconds": round(write_seconds, 4),
        "read_seconds": round(read_seconds, 4),
    }


def plot_timeline(series: dict[str, list[tuple[float, float]]], title: str, path: str) -> None:
    """A PNG of GB/s per path over time (needs matplotlib: ``pip install 'tierstore[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.5))
    for name, points in series.items():
        if points:
            axes.plot([t for t, _ in points], [g for _, g in points], label=name)
    axes.set_xlabel("seconds")
    axes.set_ylabel("GB/s")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
