"""``throttle``: EMULATION of a slower path, a token bucket in front of another backend.

Two directories on one disk share its bandwidth, so on a machine with one disk, paths of
different speeds (a node-local NVMe beside a parallel file system) are emulated by rate-limiting
another backend, typically ``dram://``. It is a test and benchmark device, not a production
backend::

    {"type": "throttle", "inner": "dram://", "read_bytes_per_s": "400MB", "write_bytes_per_s": "400MB"}

Transfers are cut into ``piece_bytes`` pieces paced by a virtual clock (`Pacer`), so concurrent
requests share the path's rate. `ThrottleBackend.set_rates` changes the rates at run time (a path
that slows down mid-run).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pydantic import ByteSize, Field

from ..errors import ConfigError
from .base import BackendOptions
from .wrapper import WrapperBackend, WrapperOptions


class ThrottleOptions(WrapperOptions):
    """Options of ``throttle://`` (``inner`` is the backend slowed down)."""

    read_bytes_per_s: ByteSize | None = None
    """Read rate (None: unlimited)."""
    write_bytes_per_s: ByteSize | None = None
    """Write rate (None: unlimited)."""
    piece_bytes: ByteSize = Field(ByteSize(1 << 20), ge=4096)
    """Pacing granularity (rounded up to the inner backend's alignment)."""
    workers: int = Field(8, ge=1, le=256)
    """Requests served at once; more wait in a queue."""


class Pacer:
    """A fixed-bandwidth link: each piece occupies the link for ``nbytes / rate`` seconds.

    A virtual clock, not a bucket with burst credit: a piece that arrives at an idle link finishes
    ``nbytes / rate`` after its I/O began, and concurrent pieces queue behind one another, so a
    measurement of any length sees exactly ``rate`` (or the inner backend's speed, if slower).

    Args:
        rate: the link's bytes per second; None leaves it unlimited.
    """

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._free_at = 0.0
        self._lock = threading.Lock()

    def set_rate(self, rate: float | None) -> None:
        """Change the link's rate (bytes per second; None: unlimited) for pieces paced from now on."""
        with self._lock:
            self.rate = rate

    def pace(self, nbytes: int, began: float) -> None:
        """Sleep until a piece of ``nbytes`` whose I/O began at ``began`` may be done."""
        with self._lock:
            if self.rate is None:
                return
            start = max(began, self._free_at)
            self._free_at = done = start + nbytes / self.rate
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class ThrottleBackend(WrapperBackend):
    """Another backend, slowed to a configured rate (emulation; see the module docstring).

    Args:
        options: a `ThrottleOptions`.
    """

    scheme = "throttle"
    Options = ThrottleOptions
    options: ThrottleOptions

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert isinstance(options, ThrottleOptions)
        caps = self.inner.capabilities
        self._piece = -(-int(options.piece_bytes) // caps.alignment) * caps.alignment
        self._pacers = {
            "read": Pacer(_rate(options.read_bytes_per_s)),
            "write": Pacer(_rate(options.write_bytes_per_s)),
        }
        self._pool = ThreadPoolExecutor(options.workers, thread_name_prefix="tierstore-throttle")

    def set_rates(self, *, read: float | None = None, write: float | None = None) -> None:
        """Change the rates at run time (a path that slows down mid-run).

        Args:
            read: the new read rate in bytes/s; None leaves it unchanged.
            write: the new write rate in bytes/s; None leaves it unchanged.

        Raises:
            ConfigError: a rate that is not a number above 0.
        """
        for direction, rate in (("read", read), ("write", write)):
            if rate is not None and (
                isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0
            ):
                raise ConfigError(f"throttle: {direction} must be bytes/s above 0 or None, not {rate!r}")
        if read is not None:
            self._pacers["read"].set_rate(read)
        if write is not None:
            self._pacers["write"].set_rate(write)

    def rates(self) -> dict[str, float | None]:
        """The current rates in bytes/s by direction (``"read"``, ``"write"``); None: unlimited."""
        return {direction: pacer.rate for direction, pacer in self._pacers.items()}

    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        """Implements `Backend._write`: paced piece by piece (whole objects in one piece)."""
        return self._pool.submit(self._write_now, name, offset, data)

    def _write_now(self, name: str, offset: int, data: memoryview) -> None:
        pacer = self._pacers["write"]
        if not self.inner.capabilities.partial_writes or data.nbytes == 0:  # whole objects only
            began = time.monotonic()
            self.inner.write(name, offset, data).result()
            pacer.pace(data.nbytes, began)
            return
        for start in range(0, data.nbytes, self._piece):
            piece = data[start : start + self._piece]
            began = time.monotonic()
            self.inner.write(name, offset + start, piece).result()
            pacer.pace(piece.nbytes, began)

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        """Implements `Backend._read_into`: paced piece by piece."""
        return self._pool.submit(self._read_now, name, offset, out)

    def _read_now(self, name: str, offset: int, out: memoryview) -> None:
        pacer = self._pacers["read"]
        for start in range(0, out.nbytes, self._piece):
            piece = out[start : start + self._piece]
            began = time.monotonic()
            self.inner.read_into(name, offset + start, piece).result()
            pacer.pace(piece.nbytes, began)

    def _close(self) -> None:
        """Implements `Backend._close`: waits for paced requests, then closes ``inner``."""
        self._pool.shutdown(wait=True)
        super()._close()


def _rate(value: ByteSize | None) -> float | None:
    return None if value is None else float(value)
