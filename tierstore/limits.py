"""Concurrency control for a path: in-flight limits per direction, priorities, node-wide slots.

MLP-Offload found that offloading concurrently amplifies I/O bottlenecks (its own control was one
reader and one writer at a time on the parallel file system). A `PathScheduler` runs every request
of one path: at most ``max_reads`` reads and ``max_writes`` writes in flight, the most urgent
request first (a read on the critical path before a prefetch, a prefetch before a background
write-back, which also waits while anything more urgent is queued), and, for a path shared by
several processes on a node, a `NodeLimiter` slot per request.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Literal

from filelock import FileLock, Timeout

from ._checks import check_arguments, default_of, is_integer
from .bandwidth import InFlight, ThroughputMeter
from .config import PathOptions
from .errors import ConfigError, StoreClosedError

Direction = Literal["read", "write"]
DEFAULT_LIMIT_DIR = Path("/dev/shm/tierstore-limits") if Path("/dev/shm").is_dir() else None


class Priority(IntEnum):
    """Lower runs first."""

    CRITICAL = 0
    """A caller is waiting (get, write-through put)."""
    PREFETCH = 1
    BACKGROUND = 2
    """Write-back of evicted or flushed objects."""


class NodeLimiter:
    """A counting semaphore shared by every process on the node: ``slots`` lock files.

    A slot is an exclusive lock on ``<directory>/<key>.<i>.lock`` (``filelock``, i.e. ``flock``),
    so a crashed process gives its slots back automatically. In-process bookkeeping makes sure one
    process never takes the same slot twice.
    """

    def __init__(self, key: str, slots: int, directory: Path | None = None) -> None:
        if not is_integer(slots) or slots < 1:
            raise ConfigError(f"slots: must be an integer >= 1, not {slots!r}")
        base = directory or DEFAULT_LIMIT_DIR or Path.home() / ".cache" / "tierstore" / "limits"
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.key = key
        self._locks = [
            FileLock(base / f"{key}.{index}.lock", thread_local=False, is_singleton=False)
            for index in range(slots)
        ]
        self._free = list(range(slots))
        self._lock = threading.Lock()

    def try_acquire(self) -> int | None:
        """A slot index, or None if every slot is held (by this or another process)."""
        with self._lock:
            for position, index in enumerate(self._free):
                try:
                    self._locks[index].acquire(timeout=0)
                except Timeout:
                    continue
                del self._free[position]
                return index
        return None

    def acquire(self, timeout: float | None = None) -> int:
        """Wait (polling with back-off) for a slot."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while (slot := self.try_acquire()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no node-wide slot of {self.key!r} within {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._locks[slot].release()
            self._free.append(slot)


@dataclass(order=True)
class _Request:
    priority: int
    sequence: int
    direction: Direction = field(compare=False)
    nbytes: int = field(compare=False)
    start: Callable[[], Future[None]] = field(compare=False)
    done: Future[None] = field(compare=False)
    queued_at: float = field(compare=False)


@dataclass
class PathTelemetry:
    """Counted where the bytes move; aggregated upwards, never recomputed."""

    history: deque[tuple[float, float, int, str]] = field(default_factory=lambda: deque(maxlen=100_000))
    """(start, end, bytes, direction) of recent completed requests, monotonic clock (for timelines;
    comparable across the node's processes)."""
    requests: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0})
    queue_wait_seconds: float = 0.0
    max_in_flight: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0})


class PathScheduler:
    """Runs one path's requests under its limits (one dispatcher thread per path).

    Args:
        name: the path's name (the dispatcher thread's and the telemetry's).
        max_reads: read requests in flight at once.
        max_writes: write requests in flight at once.
        node_limits: per direction, a slot shared with the node's other processes per request.
        meters: per direction, the path's throughput meters; new ones sharing one in-flight count
            by default.

    Raises:
        ConfigError: ``max_reads`` or ``max_writes`` outside their definition (`PathOptions`), named
            as in ``"path 'p': max_reads: must be
            ..., not ..."``.
    """

    def __init__(
        self,
        name: str,
        *,
        max_reads: int = default_of(PathOptions, "max_reads"),
        max_writes: int = default_of(PathOptions, "max_writes"),
        node_limits: dict[Direction, NodeLimiter] | None = None,
        meters: dict[Direction, ThroughputMeter] | None = None,
    ) -> None:
        check_arguments(
            PathOptions, {"max_reads": max_reads, "max_writes": max_writes}, where=f"path {name!r}: "
        )
        self.name = name
        self.limits: dict[Direction, int] = {"read": max_reads, "write": max_writes}
        self.node_limits = node_limits or {}
        in_flight = InFlight()
        self.meters = meters or {
            "read": ThroughputMeter(in_flight=in_flight),
            "write": ThroughputMeter(in_flight=in_flight),
        }
        self.telemetry = PathTelemetry()
        self._in_flight: dict[Direction, int] = {"read": 0, "write": 0}
        self._queues: dict[Direction, list[_Request]] = {"read": [], "write": []}
        """One heap per direction, ordered by (priority, arrival): a direction at its limit (or
        without a node slot) is skipped as a whole, so picking a request costs O(log n)."""
        self._sequence = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._dispatch, name=f"tierstore-path-{name}", daemon=True)
        self._thread.start()

    def submit(
        self, direction: Direction, priority: Priority, nbytes: int, start: Callable[[], Future[None]]
    ) -> Future[None]:
        """Queue a request; ``start`` issues it (returning the backend's future) when its turn comes."""
        done: Future[None] = Future()
        with self._cond:
            if self._closed:
                raise StoreClosedError(f"path {self.name!r} is closed")
            request = _Request(
                int(priority), next(self._sequence), direction, nbytes, start, done, time.monotonic()
            )
            heapq.heappush(self._queues[direction], request)
            self._cond.notify_all()
        return done

    def close(self) -> None:
        """Finish queued and running requests, then stop the dispatcher."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self._cond.wait_for(lambda: not any(self._in_flight.values()))

    # -- dispatcher ---------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            with self._cond:
                request, slot, retry = self._next_startable()
                if request is None:
                    if self._closed and not any(self._queues.values()):
                        return
                    self._cond.wait(timeout=retry)
                    continue
                self._in_flight[request.direction] += 1
                in_flight = self._in_flight[request.direction]
                telemetry = self.telemetry
                telemetry.max_in_flight[request.direction] = max(
                    telemetry.max_in_flight[request.direction], in_flight
                )
                telemetry.queue_wait_seconds += time.monotonic() - request.queued_at
                telemetry.requests += 1
                stamp = self.meters[request.direction].started()
            self._start(request, slot, stamp)

    def _next_startable(self) -> tuple[_Request | None, int | None, float | None]:
        """The most urgent request that may start now (under the lock), its node slot, and how
        long to wait before looking again if none may (None: until notified).

        Within a direction every request shares one limit and one node limiter, so only the head
        of each direction's heap is a candidate."""
        retry: float | None = None
        heads = sorted(queue[0] for queue in self._queues.values() if queue)
        most_urgent = heads[0].priority if heads else None
        for request in heads:
            if (
                request.priority == Priority.BACKGROUND
                and most_urgent is not None
                and most_urgent < request.priority
            ):
                break  # write-back waits while anything more urgent is queued
            if self._in_flight[request.direction] >= self.limits[request.direction]:
                continue
            slot = None
            limiter = self.node_limits.get(request.direction)
            if limiter is not None:
                slot = limiter.try_acquire()
                if slot is None:
                    retry = 0.002  # another process holds every slot: poll
                    continue
            heapq.heappop(self._queues[request.direction])
            return request, slot, None
        return None, None, retry

    def _start(self, request: _Request, slot: int | None, stamp: tuple[float, float]) -> None:
        try:
            inner = request.start()
        except BaseException as error:
            self._finish(request, slot, stamp, error)
            return
        inner.add_done_callback(lambda done: self._finish(request, slot, stamp, done.exception()))

    def _finish(
        self, request: _Request, slot: int | None, stamp: tuple[float, float], error: BaseException | None
    ) -> None:
        finished = time.monotonic()  # before the node-wide slot goes back: intervals never overlap
        if slot is not None:
            self.node_limits[request.direction].release(slot)
        with self._cond:
            self._in_flight[request.direction] -= 1
            self.meters[request.direction].finished(stamp, 0 if error else request.nbytes)
            if error is None:
                self.telemetry.bytes[request.direction] += request.nbytes
                self.telemetry.history.append((stamp[0], finished, request.nbytes, request.direction))
            self._cond.notify_all()
        if error is None:
            request.done.set_result(None)
        else:
            request.done.set_exception(error)
