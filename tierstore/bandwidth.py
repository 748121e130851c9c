"""Path bandwidth: measured once by a short probe (cached on disk), then tracked online.

:class:`ThroughputMeter` turns completed requests into a throughput estimate: bytes moved per
second of *busy* time (time with at least one request in flight, so concurrency is not counted
twice), sampled over short windows and smoothed with an exponentially weighted moving average, so
a path that slows down is given less within a few objects.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

from .backends.base import Backend
from .buffers import AlignedBuffer


class ThroughputMeter:
    """EWMA of bytes per busy second, fed by request start/finish events (thread-safe)."""

    def __init__(self, initial: float | None = None, *, alpha: float = 0.3, window: float = 0.02) -> None:
        self.estimate = initial
        self.alpha = alpha
        self.window = window
        self._active = 0
        self._since = 0.0
        self._busy = 0.0
        self._bytes = 0
        self.busy_seconds = 0.0
        self.total_bytes = 0
        self._lock = threading.Lock()

    def started(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._active == 0:
                self._since = now
            self._active += 1

    def finished(self, nbytes: int) -> None:
        """A request ended, having moved ``nbytes`` (0 if it failed)."""
        with self._lock:
            now = time.monotonic()
            self._busy += now - self._since
            self.busy_seconds += now - self._since
            self.total_bytes += nbytes
            self._since = now
            self._active -= 1
            self._bytes += nbytes
            if self._bytes and (self.estimate is None or self._busy >= self.window):  # any beats none
                sample = self._bytes / self._busy
                self.estimate = (
                    sample
                    if self.estimate is None
                    else (self.alpha * sample + (1 - self.alpha) * self.estimate)
                )
                self._busy, self._bytes = 0.0, 0


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second of one path."""

    read: float
    write: float

    def as_gbps(self) -> dict[str, float]:
        return {"read_gb_per_s": round(self.read / 1e9, 3), "write_gb_per_s": round(self.write / 1e9, 3)}


def probe(backend: Backend, nbytes: int = 64 << 20, repeats: int = 2) -> Bandwidth:
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
    return Bandwidth(read=best_read, write=best_write)


class ProbeCache:
    """Probe results on disk (JSON), keyed by host and path identity, valid for ``max_age`` seconds."""

    def __init__(self, path: Path | None = None, max_age: float = 7 * 24 * 3600) -> None:
        cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        self.path = path or cache_home / "tierstore" / "bandwidth.json"
        self.max_age = max_age

    def get(self, identity: str) -> Bandwidth | None:
        entry = self._load().get(self._key(identity))
        if entry is None or time.time() - entry["measured_at"] > self.max_age:
            return None
        return Bandwidth(read=entry["read"], write=entry["write"])

    def put(self, identity: str, bandwidth: Bandwidth) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with FileLock(str(self.path) + ".lock"):
            entries = self._load()
            entries[self._key(identity)] = {**asdict(bandwidth), "measured_at": time.time()}
            temporary = self.path.with_suffix(f".tmp-{os.getpid()}")
            temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(temporary, self.path)

    def _load(self) -> dict[str, dict[str, float]]:
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    @staticmethod
    def _key(identity: str) -> str:
        return f"{socket.gethostname()}|{identity}"
