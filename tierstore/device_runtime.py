"""The device runtime the device layer runs on, and page-locked host memory.

[`DeviceRuntime`][] is what the device layer (`tierstore.device`) and the pinned buffers
(`tierstore.buffers`) need of a device: streams, events, copies, kernels launched on a stream, and
page-locking host memory. [`CudaRuntime`][] is CUDA's through torch (`CUDA`, the default); a test's
simulated device ([`tierstore.testing.device.SimulatedDevice`][]) completes its copies only when the
test says so.

[`lock_pages`][] page-locks host memory for copies to the calling thread's current device; a failure
is a [`PinnedMemoryError`][] naming the size and the limits (``ulimit -l``, ``vm.max_map_count``),
and leaves no CUDA error behind for torch's next kernel launch to report.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from .errors import PinnedMemoryError


class DeviceRuntime(Protocol):
    """What [`DeviceCopies`][tierstore.device.DeviceCopies] needs of a device runtime. Streams and
    events are the runtime's own opaque handles."""

    def device_of(self, tensor: torch.Tensor) -> torch.device | None:
        """The device holding ``tensor``'s memory, or None for host memory."""

    def resolve(self, device: torch.device) -> torch.device:
        """``device`` with its index (``cuda`` alone: the calling thread's current device)."""

    def using(self, device: torch.device) -> AbstractContextManager[object]:
        """Make ``device`` the calling thread's current device inside the block (where new streams
        and page-locking go)."""

    def current_stream(self, device: torch.device) -> object:
        """The calling thread's current stream on ``device``."""

    def new_stream(self, device: torch.device) -> object:
        """A new stream on ``device``."""

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: object
    ) -> torch.Tensor:
        """Uninitialised device memory belonging to ``stream``: once freed, the caching allocator
        reuses it for work queued on that stream, in that stream's order."""

    def record(self, stream: object) -> object:
        """An event recorded on ``stream``: it completes once the work queued there so far has."""

    def record_timed(self, stream: object) -> object:
        """[`record`][], of an event that also takes the time it completes at (for
        [`elapsed`][])."""

    def elapsed(self, start: object, end: object) -> float:
        """Seconds between two completed events of [`record_timed`][] (on the device's clock)."""

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        """Tell the caching allocator that work queued on ``stream`` uses ``tensor``'s memory,
        allocated on another stream: once freed, it is reused only after that work has run."""

    def wait(self, stream: object, event: object) -> None:
        """Make the work queued on ``stream`` from now on wait for ``event``."""

    def copy(self, stream: object, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Queue ``destination.copy_(source)`` on ``stream`` (any direction, any strides) and return
        at once."""

    def launch(self, stream: object, work: Callable[[], object], name: str) -> None:
        """Queue the kernels ``work`` launches on ``stream``: CUDA's runs ``work`` at once with
        ``stream`` current (its kernels run asynchronously, in the stream's order); a simulated
        device queues ``work`` itself, named ``name``, to run in the stream's order when the test
        runs the stream. ``work`` must therefore hold every tensor it uses, not look them up when it
        runs."""

    def query(self, event: object) -> bool:
        """Whether ``event`` has completed (never waits)."""

    def synchronize(self, event: object) -> None:
        """Wait on the calling thread until ``event`` has completed."""

    def register(self, address: int, nbytes: int) -> str | None:
        """Page-lock ``nbytes`` of host memory at ``address`` for the calling thread's current
        device; None, or why it failed (which leaves the runtime's last error set)."""

    def unregister(self, address: int) -> None:
        """Undo [`register`][] of the memory at ``address``."""

    def clear_error(self) -> None:
        """Reset the runtime's last error on the calling thread."""


class CudaRuntime:
    """CUDA through torch ([`DeviceRuntime`][]). Nothing here runs, or initialises CUDA, until a
    method is called."""

    def __init__(self) -> None:
        self._registered: dict[int, int] = {}
        """Device index current when each address was page-locked: it is unlocked there."""

    def device_of(self, tensor: torch.Tensor) -> torch.device | None:
        return tensor.device if tensor.is_cuda else None

    def resolve(self, device: torch.device) -> torch.device:
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def using(self, device: torch.device) -> AbstractContextManager[object]:
        return torch.cuda.device(device)

    def current_stream(self, device: torch.device) -> object:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> object:
        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: object
    ) -> torch.Tensor:
        assert isinstance(stream, torch.cuda.Stream)
        with torch.cuda.stream(stream):
            return torch.empty(tuple(shape), dtype=dtype, device=device)

    def record(self, stream: object) -> object:
        assert isinstance(stream, torch.cuda.Stream)
        # Blocking: a thread that waits for it sleeps instead of spinning on a core.
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def record_timed(self, stream: object) -> object:
        assert isinstance(stream, torch.cuda.Stream)
        event = torch.cuda.Event(enable_timing=True, blocking=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def elapsed(self, start: object, end: object) -> float:
        assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
        return float(start.elapsed_time(end)) / 1e3

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        tensor.record_stream(stream)

    def wait(self, stream: object, event: object) -> None:
        assert isinstance(stream, torch.cuda.Stream) and isinstance(event, torch.cuda.Event)
        stream.wait_event(event)

    def copy(self, stream: object, destination: torch.Tensor, source: torch.Tensor) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)

    def launch(self, stream: object, work: Callable[[], object], name: str) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        with torch.cuda.stream(stream):
            work()

    def query(self, event: object) -> bool:
        assert isinstance(event, torch.cuda.Event)
        return bool(event.query())  # type: ignore[no-untyped-call]

    def synchronize(self, event: object) -> None:
        assert isinstance(event, torch.cuda.Event)
        event.synchronize()

    def register(self, address: int, nbytes: int) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device is available (torch.cuda.is_available() is False)"
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        status = cudart.cudaHostRegister(address, nbytes, 0)
        if int(status) == 0:
            self._registered[address] = torch.cuda.current_device()
            return None
        return f"cudaHostRegister: {cudart.cudaGetErrorString(status)} (cudaError {int(status)})"

    def unregister(self, address: int) -> None:
        index = self._registered.pop(address, None)
        if index is None:
            return
        with torch.cuda.device(index):
            status = torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
            if int(status) != 0:
                self.clear_error()

    def clear_error(self) -> None:
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return  # no runtime call was made, so none left an error
        # torch.cuda.cudart() does not bind cudaGetLastError: call the libcudart torch loaded (the
        # last error lives in that library's per-thread state, so it must be the same instance).
        library = _loaded_cudart()
        if library is not None:
            library.cudaGetLastError()
            return
        # A statically linked runtime: torch's next kernel launch checks (and so resets) the last
        # error; make that launch here and drop the error it reports.
        with contextlib.suppress(RuntimeError):
            torch.zeros(1, device="cuda")


@functools.cache
def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library mapped into this process (by torch), or None."""
    path = cudart_path(Path("/proc/self/maps").read_text())
    return None if path is None else ctypes.CDLL(path)


def cudart_path(maps: str) -> str | None:
    """The file of the CUDA runtime library (``libcudart.so...``) in a ``/proc/<pid>/maps`` text,
    or None if none is mapped."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libcudart.so"):
            return fields[5]
    return None


CUDA = CudaRuntime()
"""The runtime of every [`DeviceCopies`][tierstore.device.DeviceCopies] and pinned pool not given
another."""


def memory_limits() -> str:
    """The limits that bound page-locked memory, in words: the locked-memory limit (``ulimit -l``,
    ``RLIMIT_MEMLOCK``) and the most maps a process may have (``vm.max_map_count``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def limit(value: int) -> str:
        return "unlimited" if value == resource.RLIM_INFINITY else f"{value} bytes"

    try:
        max_maps = Path("/proc/sys/vm/max_map_count").read_text().strip()
    except OSError:
        max_maps = "unknown"
    return f"locked memory (ulimit -l) {limit(soft)}, hard limit {limit(hard)}; vm.max_map_count {max_maps}"


def lock_pages(runtime: DeviceRuntime, address: int, nbytes: int) -> None:
    """Page-lock host memory for copies to the calling thread's current device.

    Args:
        runtime: the device runtime that locks it.
        address: the first byte (page-aligned).
        nbytes: how many bytes.

    Raises:
        PinnedMemoryError: the runtime refused; the message names the size and the limits, and
            the runtime's last error is reset (torch would report it at its next kernel launch).
    """
    reason = runtime.register(address, nbytes)
    if reason is None:
        return
    runtime.clear_error()
    raise PinnedMemoryError(
        f"page-locking {nbytes} bytes of host memory for copies to a device failed ({reason}); "
        f"the limits: {memory_limits()}. Raise them, or give the workload a smaller budget"
    )


def unlock_pages(runtime: DeviceRuntime, address: int, locked_by: int) -> None:
    """Undo [`lock_pages`][] (a finalizer's callback): only in the process that locked the memory
    (``locked_by``, its pid), since a forked child neither inherits the lock nor, with
    ``MADV_DONTFORK``, the memory."""
    if os.getpid() == locked_by:
        runtime.unregister(address)
