"""Concurrency control: per-path limits, priorities, and the node-wide limiter across processes."""

import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from tierstore.limits import NodeLimiter, PathScheduler, Priority


class Instrumented:
    """Requests that finish when told to, counting how many run at once per direction."""

    def __init__(self) -> None:
        self.running = {"read": 0, "write": 0}
        self.peak = {"read": 0, "write": 0}
        self.started: list[str] = []
        self.pending: list[Future[None]] = []
        self.lock = threading.Lock()

    def request(self, direction: str, label: str):  # type: ignore[no-untyped-def]
        def start() -> Future[None]:
            inner: Future[None] = Future()
            with self.lock:
                self.running[direction] += 1
                self.peak[direction] = max(self.peak[direction], self.running[direction])
                self.started.append(label)
                self.pending.append(inner)

            def done(_: Future[None]) -> None:
                with self.lock:
                    self.running[direction] -= 1

            inner.add_done_callback(done)
            return inner

        return start

    def finish_all(self) -> None:
        while True:
            with self.lock:
                pending, self.pending = self.pending, []
            if not pending:
                return
            for future in pending:
                future.set_result(None)


def wait_until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_in_flight_limits_are_never_exceeded() -> None:
    probe = Instrumented()
    scheduler = PathScheduler("p", max_reads=2, max_writes=3)
    futures = [
        scheduler.submit(direction, Priority.CRITICAL, 1, probe.request(direction, f"{direction}{i}"))
        for i in range(20)
        for direction in ("read", "write")
    ]
    wait_until(lambda: probe.running == {"read": 2, "write": 3})
    time.sleep(0.02)  # give the dispatcher a chance to overshoot, if it could
    assert probe.running == {"read": 2, "write": 3}
    while not all(f.done() for f in futures):
        probe.finish_all()
        time.sleep(0.001)
    scheduler.close()
    assert probe.peak == {"read": 2, "write": 3}
    assert scheduler.telemetry.max_in_flight == {"read": 2, "write": 3}
    assert scheduler.telemetry.requests == 40 and scheduler.telemetry.bytes == {"read": 20, "write": 20}


def test_critical_reads_go_before_prefetch_and_write_back() -> None:
    probe = Instrumented()
    scheduler = PathScheduler("p", max_reads=1, max_writes=1)
    blocker = scheduler.submit("read", Priority.CRITICAL, 1, probe.request("read", "blocker"))
    wait_until(lambda: probe.started == ["blocker"])
    scheduler.submit("write", Priority.BACKGROUND, 1, probe.request("write", "writeback"))
    scheduler.submit("read", Priority.PREFETCH, 1, probe.request("read", "prefetch"))
    scheduler.submit("read", Priority.CRITICAL, 1, probe.request("read", "critical"))
    time.sleep(0.02)
    assert probe.started == ["blocker"]  # write-back holds back while more urgent reads queue
    while len(probe.started) < 4:
        probe.finish_all()
        time.sleep(0.002)
    assert probe.started == ["blocker", "critical", "prefetch", "writeback"]
    probe.finish_all()
    blocker.result(timeout=5)
    scheduler.close()


def test_failures_reach_the_caller_and_free_the_slot() -> None:
    scheduler = PathScheduler("p", max_reads=1, max_writes=1)

    def broken() -> Future[None]:
        raise OSError(5, "boom")

    with pytest.raises(OSError, match="boom"):
        scheduler.submit("read", Priority.CRITICAL, 1, broken).result(timeout=5)
    ok: Future[None] = Future()
    ok.set_result(None)
    scheduler.submit("read", Priority.CRITICAL, 1, lambda: ok).result(timeout=5)
    scheduler.close()


def test_node_limiter_slots_are_exclusive_within_a_process(tmp_path: Path) -> None:
    limiter = NodeLimiter("shared", 2, tmp_path)
    first, second = limiter.try_acquire(), limiter.try_acquire()
    assert {first, second} == {0, 1}
    assert limiter.try_acquire() is None
    limiter.release(first)  # type: ignore[arg-type]
    assert limiter.try_acquire() == first
    with pytest.raises(TimeoutError):
        limiter.acquire(timeout=0.01)


HOLDER = """
import sys, time
from pathlib import Path
from tierstore.limits import NodeLimiter
limiter = NodeLimiter("shared", 1, Path(sys.argv[1]))
log = Path(sys.argv[2])
for _ in range(int(sys.argv[3])):
    slot = limiter.acquire(timeout=30)
    with log.open("a") as f:
        f.write(f"+ {time.monotonic():.6f}\\n")
    time.sleep(0.01)
    with log.open("a") as f:
        f.write(f"- {time.monotonic():.6f}\\n")
    limiter.release(slot)
"""


def test_node_limiter_is_shared_by_processes(tmp_path: Path) -> None:
    """Two processes, one slot: their holding intervals never overlap."""
    log = tmp_path / "log"
    workers = [
        subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(log), "15"]) for _ in range(2)
    ]
    for worker in workers:
        assert worker.wait(timeout=60) == 0
    holders = 0
    events = [line.split() for line in log.read_text().splitlines()]
    assert len(events) == 60
    for sign, _ in events:  # appended under the lock, so file order is time order
        holders += 1 if sign == "+" else -1
        assert 0 <= holders <= 1
