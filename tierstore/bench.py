"""Throughput measurement of paths and tiers (used by ``tierstore bench`` and the benchmarks).

Each measurement streams ``count`` objects of ``nbytes`` from one page-aligned buffer, ``depth``
in flight, then reads them back into another; a :class:`Timeline` samples every path's byte
counters meanwhile, giving GB/s per path over time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, Self

from .buffers import AlignedBuffer
from .limits import Priority
from .tier import Placement, Tier, TierPath

Progress = Callable[[int], None]


class Timeline:
    """Samples cumulative bytes moved by each path every ``interval`` seconds."""

    def __init__(self, paths: Sequence[TierPath], interval: float = 0.05) -> None:
        self.paths = list(paths)
        self.interval = interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierstore-timeline", daemon=True)
        self._origin = time.monotonic()

    def __enter__(self) -> Self:
        self._origin = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def rates(self) -> dict[str, list[tuple[float, float]]]:
        """Per path: (seconds since start, GB/s over the preceding interval)."""
        series: dict[str, list[tuple[float, float]]] = {path.name: [] for path in self.paths}
        for (t0, before), (t1, after) in zip(self.samples, self.samples[1:], strict=False):
            if t1 > t0:
                for name in series:
                    series[name].append(
                        (round(t1, 4), round((after[name] - before[name]) / (t1 - t0) / 1e9, 4))
                    )
        return series

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        moved = {path.name: sum(path.scheduler.telemetry.bytes.values()) for path in self.paths}
        self.samples.append((time.monotonic() - self._origin, moved))


def _pipeline(starts: Iterable[Callable[[], Future[None]]], depth: int, progress: Progress | None) -> None:
    in_flight: deque[Future[None]] = deque()
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
    source, target = AlignedBuffer(nbytes), AlignedBuffer(nbytes)
    source.view(nbytes).fill_(0xA5)
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
    source, target = AlignedBuffer(nbytes), AlignedBuffer(nbytes)
    source.view(nbytes).fill_(0x5A)
    placements: list[Placement] = []
    object_seconds: dict[int, float] = {}

    def write(index: int) -> Future[None]:
        if between is not None:
            between(index)
        tier.reserve(nbytes)
        placement, future = tier.write(
            f"tierstore-bench-{index}", source.memoryview(nbytes), Priority.CRITICAL
        )
        placements.append(placement)
        begun = time.perf_counter()
        future.add_done_callback(lambda _: object_seconds.__setitem__(index, time.perf_counter() - begun))
        return future

    try:
        started = time.perf_counter()
        _pipeline((partial(write, index) for index in range(count)), depth, progress)
        write_seconds = time.perf_counter() - started
        if between_phases is not None:
            between_phases()
        started = time.perf_counter()
        target_view = target.memoryview(nbytes)
        reads = (
            partial(tier.read_into, placement, target_view, Priority.CRITICAL) for placement in placements
        )
        _pipeline(reads, depth, progress)
        read_seconds = time.perf_counter() - started
    finally:
        for placement in placements:
            tier.discard(placement)
    figures = _figures(nbytes * count, write_seconds, read_seconds)
    figures["object_write_seconds"] = [round(object_seconds[i], 5) for i in sorted(object_seconds)]
    return figures


def measure_round_trips(
    tier: Tier, nbytes: int, count: int, *, between: Callable[[int], None] | None = None
) -> list[float]:
    """Seconds per object to write it through the tier and read it back, one object at a time
    (the access pattern of an offloaded optimizer step). ``between(index)`` runs before each."""
    source, target = AlignedBuffer(nbytes), AlignedBuffer(nbytes)
    source.view(nbytes).fill_(0x3C)
    seconds = []
    for index in range(count):
        if between is not None:
            between(index)
        tier.reserve(nbytes)
        started = time.perf_counter()
        placement, future = tier.write(
            f"tierstore-trip-{index}", source.memoryview(nbytes), Priority.CRITICAL
        )
        try:
            future.result()
            tier.read_into(placement, target.memoryview(nbytes), Priority.CRITICAL).result()
        finally:
            tier.discard(placement)
        seconds.append(time.perf_counter() - started)
    return seconds


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
