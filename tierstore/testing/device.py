"""A simulated device, for testing the order of device copies and the lifetimes of what they hold
on a machine without a GPU.

[`SimulatedDevice`][] is a [`DeviceRuntime`][tierstore.device.DeviceRuntime] whose device memory is
host memory ([`DeviceTensor`][], a tensor subclass that views and results keep) and whose streams
are queues of operations that run only when a test says so ([`SimulatedDevice.run`][]): a copy moves
its bytes then, an event completes then, and a wait holds its stream until its event has completed.
A test so sees what each copy read and wrote, in what order copies complete, and what is held until
when. A thread that waits for an event (`SimulatedDevice.synchronize`) runs the device until the
event completes, copy streams first and the caller's stream last, so that a copy that does not wait
for the caller's work reads or writes too early and the test sees it.

Page-locking is recorded too: which addresses are locked, how many lock and unlock calls came,
every error the runtime reported, and its last error (what ``cudaGetLastError`` would return).

`SimulatedModelDevice` runs a whole model written for a device on the CPU: every tensor not
page-locked through it is device memory, and the caller's stream is the calling thread (torch runs
the model's operations as they are called), so only the copies wait for the test.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch


class DeviceTensor(torch.Tensor):
    """A tensor the simulated device counts as device memory (its views and results are too)."""


@dataclass(eq=False)
class SimulatedEvent:
    """An event: complete once the operations queued on its stream before its record have run."""

    name: str
    done: bool = False
    completed_at: float | None = None
    """When it completed (the host's clock), for a timed event."""
    timed: bool = False


@dataclass(eq=False)
class Operation:
    """One queued operation: a copy or a kernel (``work``), an event's record, or a wait."""

    kind: str
    """``copy``, ``kernel``, ``record`` or ``wait``."""
    name: str
    work: Callable[[], object] | None = None
    event: SimulatedEvent | None = None


@dataclass(eq=False)
class SimulatedStream:
    """A stream: operations run in the order they were queued."""

    name: str
    queue: deque[Operation] = field(default_factory=deque)

    def pending(self) -> list[str]:
        """What is still queued, first first (``kind name`` each)."""
        return [f"{operation.kind} {operation.name}" for operation in self.queue]


class SimulatedDevice:
    """A device whose work runs only when the test says so (see the module docstring).

    Attributes:
        compute: the caller's current stream (every thread's, on every device).
        completed: every operation run, in order, as ``stream: kind name``.
        locked: the page-locked host memory: bytes by address.
        lock_calls: how many times memory was page-locked (attempts, failed ones included).
        unlock_calls: how many times it was unlocked.
        errors: every error the runtime reported (a failed lock, an unlock of memory not locked).
        last_error: the last error not reset since (``clear_error`` resets it).
        fail_lock: set it to make the next page-lock fail with this reason.
        used_on: every ``record_stream``: the tensor's data pointer and the stream's name.
    """

    device = torch.device("cuda", 0)

    def __init__(self) -> None:
        self.compute = SimulatedStream("compute")
        self.streams: list[SimulatedStream] = [self.compute]
        self.completed: list[str] = []
        self.locked: dict[int, int] = {}
        self.lock_calls = 0
        self.unlock_calls = 0
        self.errors: list[str] = []
        self.last_error: str | None = None
        self.fail_lock: str | None = None
        self.used_on: list[tuple[int, str]] = []
        self._names = itertools.count()
        self._lock = threading.RLock()

    # -- for tests --------------------------------------------------------------------------------
    def tensor(self, values: torch.Tensor) -> DeviceTensor:
        """A copy of ``values`` in device memory."""
        return values.clone().as_subclass(DeviceTensor)

    def kernel(
        self, work: Callable[[], object], name: str = "kernel", stream: SimulatedStream | None = None
    ) -> None:
        """Queue ``work`` (reading or writing device tensors) on ``stream`` (default the caller's)."""
        self._queue(stream or self.compute, Operation("kernel", name, work=work))

    def run(self, stream: SimulatedStream, count: int | None = None) -> int:
        """Run up to ``count`` operations (default all) queued on ``stream``, stopping at a wait
        whose event has not completed.

        Returns:
            How many ran.
        """
        ran = 0
        with self._lock:
            while stream.queue and (count is None or ran < count):
                operation = stream.queue[0]
                if operation.kind == "wait":
                    assert operation.event is not None
                    if not operation.event.done:
                        break
                elif operation.kind == "record":
                    assert operation.event is not None
                    operation.event.done = True
                    operation.event.completed_at = time.perf_counter()
                else:
                    assert operation.work is not None
                    operation.work()
                stream.queue.popleft()
                self.completed.append(f"{stream.name}: {operation.kind} {operation.name}")
                ran += 1
        return ran

    def run_all(self) -> int:
        """Run every stream as far as it goes, copy streams before the caller's, until nothing
        more can run.

        Returns:
            How many operations ran.
        """
        total = 0
        with self._lock:
            while ran := sum(self.run(stream) for stream in reversed(self.streams)):
                total += ran
        return total

    def copy_streams(self) -> list[SimulatedStream]:
        """The streams made for copies, in the order they were made."""
        return self.streams[1:]

    # -- DeviceRuntime ----------------------------------------------------------------------------
    def device_of(self, tensor: torch.Tensor) -> torch.device | None:
        return self.device if isinstance(tensor, DeviceTensor) else None

    def resolve(self, device: torch.device) -> torch.device:
        return device if device.index is not None else torch.device(device.type, 0)

    def using(self, device: torch.device) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def current_stream(self, device: torch.device) -> object:
        return self.compute

    def new_stream(self, device: torch.device) -> object:
        with self._lock:
            stream = SimulatedStream(f"copy{len(self.streams)}")
            self.streams.append(stream)
            return stream

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: object
    ) -> torch.Tensor:
        # Filled with a pattern, so that reading memory no copy has written yet shows.
        shape = tuple(shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        memory = torch.full((nbytes,), 0xA5, dtype=torch.uint8).view(dtype).reshape(shape)
        return memory.as_subclass(DeviceTensor)

    def record(self, stream: object) -> object:
        assert isinstance(stream, SimulatedStream)
        event = SimulatedEvent(f"event{next(self._names)}")
        self._queue(stream, Operation("record", event.name, event=event))
        return event

    def record_timed(self, stream: object) -> object:
        event = self.record(stream)
        assert isinstance(event, SimulatedEvent)
        event.timed = True
        return event

    def elapsed(self, start: object, end: object) -> float:
        assert isinstance(start, SimulatedEvent) and isinstance(end, SimulatedEvent)
        if not (start.timed and end.timed):
            raise RuntimeError("simulated device: elapsed() needs two timed events")
        if start.completed_at is None or end.completed_at is None:
            raise RuntimeError("simulated device: elapsed() of an event that has not completed")
        return end.completed_at - start.completed_at

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        assert isinstance(stream, SimulatedStream)
        with self._lock:
            self.used_on.append((tensor.data_ptr(), stream.name))

    def wait(self, stream: object, event: object) -> None:
        assert isinstance(stream, SimulatedStream) and isinstance(event, SimulatedEvent)
        self._queue(stream, Operation("wait", event.name, event=event))

    def copy(self, stream: object, destination: torch.Tensor, source: torch.Tensor) -> None:
        assert isinstance(stream, SimulatedStream)

        def work() -> None:
            with torch.no_grad():
                destination.copy_(source)

        self._queue(stream, Operation("copy", f"{source.nbytes} bytes", work=work))

    def launch(self, stream: object, work: Callable[[], object], name: str) -> None:
        assert isinstance(stream, SimulatedStream)
        self.kernel(work, name, stream)

    def query(self, event: object) -> bool:
        assert isinstance(event, SimulatedEvent)
        return event.done

    def synchronize(self, event: object) -> None:
        assert isinstance(event, SimulatedEvent)
        with self._lock:
            if not event.done:
                self.run_all()
            if not event.done:
                raise RuntimeError(f"simulated device: {event.name} can never complete")

    def register(self, address: int, nbytes: int) -> str | None:
        with self._lock:
            self.lock_calls += 1
            reason, self.fail_lock = self.fail_lock, None
            if reason is None and address in self.locked:
                reason = f"memory at {address:#x} is already registered"
            if reason is not None:
                self.errors.append(reason)
                self.last_error = reason
                return reason
            self.locked[address] = nbytes
            return None

    def unregister(self, address: int) -> None:
        with self._lock:
            self.unlock_calls += 1
            if self.locked.pop(address, None) is None:
                reason = f"memory at {address:#x} is not registered"
                self.errors.append(reason)
                self.last_error = reason

    def clear_error(self) -> None:
        self.last_error = None

    def _queue(self, stream: SimulatedStream, operation: Operation) -> None:
        with self._lock:
            stream.queue.append(operation)


CUDA_ALIGNMENT = 512
"""The alignment of every block CUDA's caching allocator hands out."""


class SimulatedModelDevice(SimulatedDevice):
    """A device that a whole model written for a GPU runs on, on the CPU.

    Every tensor is device memory except host memory page-locked through this runtime (the pinned
    pools of the workloads under test), and device memory it allocates is plain tensors. The
    caller's stream is the calling thread itself, since torch runs the model's operations as they
    are called: what is queued on it runs at once, and a wait queued on it runs the device until
    the event completes. So the copies alone are what the test orders: they run when a thread
    waits for them, or when the test runs their stream.

    `hold` makes every thread that would run the device (a wait of the caller's stream or
    `synchronize`) wait until the block ends instead: copies queued in it run only after everything
    the model did in it, the latest a GPU could run them, so that a copy that reads memory later
    operations change reads the changed bytes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held = False
        self._release = threading.Condition()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Run no copy inside the block (see the class docstring)."""
        with self._release:
            self._held = True
        try:
            yield
        finally:
            with self._release:
                self._held = False
                self._release.notify_all()

    def device_of(self, tensor: torch.Tensor) -> torch.device | None:
        address = tensor.data_ptr()
        with self._lock:
            pinned = any(start <= address < start + size for start, size in self.locked.items())
        return None if pinned else self.device

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: object
    ) -> torch.Tensor:
        # 512-byte aligned, as CUDA's caching allocator hands memory out (the CPU's aligns to 64),
        # and filled with a pattern, so that reading memory no copy has written yet shows.
        shape = tuple(shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        memory = torch.full((nbytes + CUDA_ALIGNMENT,), 0xA5, dtype=torch.uint8)
        start = -memory.data_ptr() % CUDA_ALIGNMENT
        return memory[start : start + nbytes].view(dtype).reshape(shape)

    def synchronize(self, event: object) -> None:
        assert isinstance(event, SimulatedEvent)
        if not event.done:
            self._wait_for_release()
        super().synchronize(event)

    def _queue(self, stream: SimulatedStream, operation: Operation) -> None:
        super()._queue(stream, operation)
        if stream is not self.compute:
            return
        if operation.kind == "wait":
            assert operation.event is not None
            if not operation.event.done:
                self._wait_for_release()
            with self._lock:
                while not operation.event.done and self.run_all():
                    pass
        with self._lock:
            self.run(self.compute)
        if stream.queue:
            raise RuntimeError(f"simulated device: the caller's stream waits for ever on {stream.pending()}")

    def _wait_for_release(self) -> None:
        with self._release:
            self._release.wait_for(lambda: not self._held)
