"""The copies between a CUDA device and the offloader's pinned host memory, on the store's device
layer (:mod:`tierstore.device`: one copy stream per device, ordered with the compute stream by
events, and every copy's memory held until the copy has ended).

* out (at a save): the captured bytes are first copied within device memory on the compute stream
  (a *snapshot*, in order with the kernels around it, so later in-place writes to the storage
  cannot reach it), then from the snapshot to pinned host memory on the copy stream, after the
  snapshot. The transfer holds the snapshot and the host memory until the copy has ended: the
  snapshot's device memory is freed, and the host memory can return to the pool, only then.
  Whatever reads the host bytes (the write to the store) waits for the transfer first.
* back (at a use): pinned host memory is copied into a new device tensor on the copy stream, and
  the compute stream waits for the copy before the kernels that use the tensor; the transfer holds
  the host memory until the copy has ended.

Neither direction makes the compute stream or the forward thread wait for the host; the
offloader's background thread waits for each transfer's end, so that its memory comes back
promptly.
"""

from __future__ import annotations

import torch

from ..device import DeviceCopies, Transfer
from .layout import Capture, copy_out


def to_host(copies: DeviceCopies, tensor: torch.Tensor, capture: Capture, host: torch.Tensor) -> Transfer:
    """Start copying ``capture``'s bytes of ``tensor`` into ``host`` (pinned memory of
    ``capture.nbytes``); call it on the thread that runs forward, whose current stream wrote the
    tensor.

    Returns:
        The transfer; ``host`` holds the bytes once it has ended.
    """
    snapshot = torch.empty(capture.nbytes, dtype=torch.uint8, device=tensor.device)
    copy_out(tensor, capture, snapshot)
    return copies.copy(host, snapshot, copies.caller(tensor.device))


def to_device(
    copies: DeviceCopies, host: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, Transfer]:
    """A new uint8 tensor on ``device`` that will hold ``host``'s bytes, ready for the calling
    thread's current stream (which waits for the copy); call it on the thread that uses it.

    Returns:
        The tensor, and the transfer that holds ``host`` until the copy has ended.
    """
    restored = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    transfer = copies.to_device(restored, host, copies.caller(device))
    return restored, transfer
