import time
from pathlib import Path

import numpy as np
import pytest
from tierstore.backends import Backend, open_backend
from tierstore.backends.dram import DramBackend
from tierstore.backends.throttle import Pacer, ThrottleBackend

from tierstore import ConfigError
from tierstore.testing import BackendTests


def _inner(backend: Backend) -> DramBackend:
    assert isinstance(backend, ThrottleBackend) and isinstance(backend.inner, DramBackend)
    return backend.inner


class TestThrottleBackend(BackendTests):
    """The wrapper honours the contract (fast rates keep the suite quick)."""

    def open(self, root: Path) -> Backend:
        return open_backend(
            {
                "type": "throttle",
                "inner": "dram://",
                "read_bytes_per_s": "4GB",
                "write_bytes_per_s": "4GB",
                "piece_bytes": "64KiB",
            }
        )

    def raw_get(self, backend: Backend, name: str) -> bytes:
        return _inner(backend).view(name).tobytes()

    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        inner = _inner(backend)  # the wrapped backend is the throttle's medium
        inner._buffers[name] = np.frombuffer(data, np.uint8).copy()
        inner._sizes[name] = len(data)


def test_rate_is_a_lower_bound_on_transfer_time() -> None:
    """Sleeps make the emulated path at least this slow, whatever the machine's load."""
    rate = 40e6
    with open_backend(
        {"type": "throttle", "inner": "dram://", "write_bytes_per_s": rate, "read_bytes_per_s": rate}
    ) as backend:
        data = bytes(8 << 20)
        started = time.monotonic()
        backend.write("x", 0, data).result()
        written = time.monotonic() - started
        started = time.monotonic()
        backend.read_into("x", 0, bytearray(len(data))).result()
        read = time.monotonic() - started
    assert written >= len(data) / rate
    assert read >= len(data) / rate


def test_rates_change_at_run_time() -> None:
    with open_backend({"type": "throttle", "inner": "dram://", "write_bytes_per_s": "1GB"}) as backend:
        assert isinstance(backend, ThrottleBackend)
        backend.set_rates(write=250e6)
        assert backend.rates() == {"read": None, "write": 250e6}
        for wrong in (0, -1.0, True):  # a division by zero in a worker, or a hang at 1 byte/s
            with pytest.raises(
                ConfigError, match=rf"throttle: read must be bytes/s above 0 or None, not {wrong}"
            ):
                backend.set_rates(read=wrong)
        assert backend.rates() == {"read": None, "write": 250e6}


def test_unlimited_pacer_never_sleeps() -> None:
    pacer = Pacer(None)
    started = time.monotonic()
    for _ in range(1000):
        pacer.pace(1 << 30, time.monotonic())
    assert time.monotonic() - started < 1.0


def test_concurrent_pieces_share_the_rate() -> None:
    import threading

    pacer = Pacer(100e6)
    started = time.monotonic()
    threads = [threading.Thread(target=pacer.pace, args=(1_000_000, started)) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - started >= 10 * 1_000_000 / 100e6


def test_throttle_needs_a_valid_inner_backend() -> None:
    with pytest.raises(ConfigError, match=r"throttle\.inner"):
        open_backend({"type": "throttle", "inner": {"path": "/x"}})
