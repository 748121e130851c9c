"""Path bandwidth: measured once by a short probe (cached on disk), then tracked online.

`ThroughputMeter` turns completed requests into a throughput estimate: bytes moved per second of
*busy* time (time with at least one request in flight, so concurrency is not counted twice), sampled
over short windows and smoothed with an exponentially weighted moving average, so a path that slows
down is given less within a few objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from .backends.base import Backend
from .buffers import AlignedBuffer
from .config import StripeBy

PROBE_BYTES = 64 << 20
"""Size of the object a probe writes and reads back, unless told otherwise."""
_log = logging.getLogger("tierstore")


class InFlight:
    """Requests in flight on one path and the integral of their count over time (thread-safe).

    A path's read and write meters share one: a read that overlapped writes shared the device with
    them. Counting only other reads would credit each direction with about half the device, and a
    model adding read time to write time would predict a mixed pass about twice too slow.
    """

    def __init__(self) -> None:
        self._count = 0
        self._integral = 0.0
        self._busy = 0.0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def enter(self) -> tuple[float, float]:
        """A request starts; the stamp to pass to `leave`."""
        with self._lock:
            now = self._advance()
            self._count += 1
            return now, self._integral

    def leave(self, stamp: tuple[float, float]) -> tuple[float, float]:
        """A request ends: its duration and the average number of requests in flight meanwhile."""
        with self._lock:
            now = self._advance()
            self._count -= 1
            began, integral = stamp
            duration = now - began
            return duration, (self._integral - integral) / duration if duration > 0 else 1.0

    @property
    def busy_seconds(self) -> float:
        """Time with at least one request in flight: how long the path (the device, when both
        directions share this count) had work, whatever the direction."""
        with self._lock:
            self._advance()
            return self._busy

    def _advance(self) -> float:
        now = time.monotonic()
        if self._count:
            self._integral += self._count * (now - self._last)
            self._busy += now - self._last
        self._last = now
        return now


class ThroughputMeter:
    """EWMA of a path's throughput in one direction, one sample per completed request (thread-safe).

    Requests in flight share the path, so a request that took ``d`` seconds for ``b`` bytes while
    on average ``n`` requests were in flight (``in_flight``: in both directions when the path's two
    meters share it) saw the path move ``b * n / d`` bytes per second; with one request at a time
    it is simply ``b / d``.
    """

    def __init__(
        self, initial: float | None = None, *, alpha: float = 0.3, in_flight: InFlight | None = None
    ) -> None:
        self.estimate = initial
        self.alpha = alpha
        self.busy_seconds = 0.0
        """Time with at least one request of this direction in flight."""
        self.total_bytes = 0
        self.in_flight = InFlight() if in_flight is None else in_flight
        """Requests in flight on the path (shared with the other direction's meter)."""
        self._active = 0
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def started(self) -> tuple[float, float]:
        """Note a request's start; pass the returned stamp to `finished`."""
        with self._lock:
            self._advance()
            self._active += 1
            return self.in_flight.enter()

    def finished(self, stamp: tuple[float, float], nbytes: int) -> None:
        """A request ended, having moved ``nbytes`` (0 if it failed)."""
        with self._lock:
            self._advance()
            self._active -= 1
            self.total_bytes += nbytes
            duration, sharing = self.in_flight.leave(stamp)
            if nbytes and duration > 0:
                sample = nbytes * max(1.0, sharing) / duration
                self.estimate = (
                    sample
                    if self.estimate is None
                    else (self.alpha * sample + (1 - self.alpha) * self.estimate)
                )

    def _advance(self) -> None:
        now = time.monotonic()
        if self._active:
            self.busy_seconds += now - self._last
        self._last = now


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second of one path."""

    read: float
    write: float

    def as_gbps(self) -> dict[str, float]:
        return {"read_gb_per_s": round(self.read / 1e9, 3), "write_gb_per_s": round(self.write / 1e9, 3)}


@dataclass(frozen=True)
class PathSpeed:
    """One path's bandwidth estimates, by the path's name: what a workload plans its I/O with
    ([`TierStore.bandwidths`][])."""

    name: str
    read: float
    """Bytes per second."""
    write: float
    """Bytes per second."""


def stripe_weight(read: float, write: float, stripe_by: StripeBy) -> float:
    """A path's weight among a striped tier's paths (its share is its weight over their sum), from
    its bandwidths in bytes per second: the one rule for placement and for the I/O model.

    Args:
        read: the path's read bandwidth.
        write: its write bandwidth.
        stripe_by: which bandwidth sets the weight: ``"round-trip"`` (objects written and read
            back, as an optimizer's state is): ``1 / (1/read + 1/write)``, so a write plus a read
            of the same bytes finishes together on all paths; ``"write"`` or ``"read"``: that
            bandwidth alone.
    """
    if stripe_by == "write":
        return write
    if stripe_by == "read":
        return read
    return 1.0 / (1.0 / read + 1.0 / write)


@dataclass(frozen=True)
class Probed:
    """A path's bandwidth as a probe measured it, with the probe's object size and when."""

    bandwidth: Bandwidth
    nbytes: int
    """Size of the object the probe wrote and read back (small objects understate a fast device)."""
    measured_at: float
    """When, in seconds since the epoch."""


def probe(backend: Backend, nbytes: int = PROBE_BYTES, repeats: int = 2) -> Probed:
    """Write and read back a scratch object of ``nbytes`` ``repeats`` times; the best of each.

    Reads of buffered backends may be served from the page cache, which overstates them; the
    online meter corrects the estimate once real traffic flows.
    """
    buffer = AlignedBuffer(nbytes)
    buffer.view(nbytes).fill_(0x5A)
    name = f"tierstore-probe-{os.getpid()}-{threading.get_ident()}"
    best_write = best_read = 0.0
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            backend.write(name, 0, buffer.memoryview(nbytes)).result()
            best_write = max(best_write, nbytes / (time.perf_counter() - started))
            started = time.perf_counter()
            backend.read_into(name, 0, buffer.memoryview(nbytes)).result()
            best_read = max(best_read, nbytes / (time.perf_counter() - started))
            backend.delete(name)
    finally:
        if backend.exists(name):
            backend.delete(name)
        buffer.free()
    return Probed(Bandwidth(read=best_read, write=best_write), nbytes, time.time())


class ProbeCache:
    """Probe results on disk (JSON), keyed by host and path identity, valid for ``max_age`` seconds.

    The cache only saves probes: where it cannot be written (a read-only home, a full disk) a
    warning says so and the figures are simply not kept.
    """

    def __init__(self, path: Path | None = None, max_age: float = 7 * 24 * 3600) -> None:
        cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        self.path = path or cache_home / "tierstore" / "bandwidth.json"
        self.max_age = max_age

    def get(self, identity: str, nbytes: int | None = None) -> Probed | None:
        """The cached probe of the path ``identity``, if recent enough and, when ``nbytes`` is given,
        measured with an object of that size (a probe of another size measures something else)."""
        entry = self._load().get(self._key(identity), {})
        try:
            probed = Probed(
                Bandwidth(read=float(entry["read"]), write=float(entry["write"])),
                int(entry["nbytes"]),
                float(entry["measured_at"]),
            )
        except (KeyError, TypeError, ValueError):  # absent or incomplete
            return None
        if time.time() - probed.measured_at > self.max_age or nbytes not in (None, probed.nbytes):
            return None
        return probed

    def put(self, identity: str, probed: Probed) -> None:
        """Save a probe of the path ``identity``; if the cache file cannot be written, warn (the
        ``tierstore`` logger) and go on without it."""
        temporary = self.path.with_suffix(f".tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with FileLock(str(self.path) + ".lock"):
                entries = self._load()
                entries[self._key(identity)] = {
                    **asdict(probed.bandwidth),
                    "nbytes": probed.nbytes,
                    "measured_at": probed.measured_at,
                }
                temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
                os.replace(temporary, self.path)
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            _log.warning(
                "bandwidth probe not cached: cannot write %s: %s", self.path, error.strerror or error
            )

    def _load(self) -> dict[str, dict[str, float]]:
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    @staticmethod
    def _key(identity: str) -> str:
        return f"{socket.gethostname()}|{identity}"
