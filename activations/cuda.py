"""The copies between a CUDA device and the offloader's pinned host memory.

Both directions run on a side stream per device, so the compute stream never waits on the host:

* out (at a save): the captured bytes are first copied within device memory on the compute stream
  (a *snapshot*, in order with the kernels around it, so later in-place writes to the storage
  cannot reach it), then from the snapshot to pinned host memory on the side stream; the snapshot
  is freed once that copy is done (``record_stream``). An event marks the copy's end: whatever
  reads the host bytes (the write to the store) waits for it.
* back (at a use): pinned host memory is copied into a new device tensor on the side stream, and
  the compute stream waits for it with an event before it uses the tensor; the host bytes are
  held until the copy is done.
"""

from __future__ import annotations

from concurrent.futures import Executor

import torch

from .layout import Capture, copy_out


class DeviceCopies:
    """Side streams and the copies on them (one instance per offloader)."""

    def __init__(self, background: Executor) -> None:
        """``background`` runs what waits for a copy to end (off the caller's thread)."""
        self._background = background
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def to_host(self, tensor: torch.Tensor, capture: Capture, host: torch.Tensor) -> torch.cuda.Event:
        """Start copying ``capture``'s bytes of ``tensor`` into ``host`` (pinned); the returned
        event marks the end of the copy."""
        snapshot = torch.empty(capture.nbytes, dtype=torch.uint8, device=tensor.device)
        copy_out(tensor, capture, snapshot)
        copied = self._copy_on_side(tensor.device, host, snapshot)
        snapshot.record_stream(self._side(tensor.device))
        return copied

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A new uint8 tensor on ``device`` holding ``host``'s bytes, ready for the compute stream
        (which waits for the copy); ``host`` is held until the copy is done."""
        restored = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        copied = self._copy_on_side(device, restored, host)
        torch.cuda.current_stream(device).wait_event(copied)
        self._background.submit(_wait, copied, host)
        return restored

    def _copy_on_side(
        self, device: torch.device, destination: torch.Tensor, source: torch.Tensor
    ) -> torch.cuda.Event:
        """Copy ``source`` into ``destination`` on ``device``'s side stream, after the work the
        compute stream has queued so far; the returned event marks the end of the copy."""
        side = self._side(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            destination.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(side)
        return copied

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


def _wait(event: torch.cuda.Event, held: torch.Tensor) -> None:
    """Wait for ``event``; ``held``, the memory its copy reads, lives until then."""
    event.synchronize()
