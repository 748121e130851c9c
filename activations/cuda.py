"""The copies between a device (a CUDA GPU) and the offloader's pinned host memory, on the store's
device layer (`tierstore.device`: one copy stream per device, ordered with the caller's stream by
events, and every copy's memory held until the copy has ended).

* out (at a save): the captured bytes are copied to pinned host memory on the copy stream, after
  an event recorded on the caller's stream at the save, so after the kernel that produced them.
  The copy reads the saved tensor's own memory: the transfer holds the saved tensor until the copy
  has ended, so the caching allocator cannot hand its memory to later kernels before. Backward
  gets exactly the bytes saved whenever nothing writes them in between; for a tensor in
  autograd's graph (one that requires grad) only writes autograd tracks can, and the offloader
  checks its version counter when the copy has ended (backward then raises autograd's own error,
  as it would without offload). Writes to *other* bytes of the same storage (torch's RNN cells
  finish each chunk of one projection in place) do not matter: backward reads only the saved
  view's elements (a view with gaps is gathered densely on the copy stream first, then copied
  out). A tensor outside the graph (a buffer such as BatchNorm's running statistics, an input, a
  tensor made under ``no_grad``) may be written behind autograd's back, so it alone is first
  copied within device memory on the caller's stream (a *snapshot*, in order with the kernels
  around it) and then from the snapshot.
* back (ahead of a use): pinned host memory is copied into new memory of the copy stream
  ([`fetch`][tierstore.device.DeviceCopies.fetch]), waiting for no other stream; at the use the
  caller's stream waits for the copy's end event, and the memory is marked as used by that stream
  for the caching allocator ([`hand_over`][tierstore.device.DeviceCopies.hand_over]).

Neither direction makes the caller's stream or the forward thread wait for the host. Every copy is
timed on the device's clock (its [`Transfer`][]'s ``seconds``): the bus bandwidth the plan and the
step report use.

The lifetime of every buffer and event of a saved tensor of a device:

* the *caller event*, recorded on the compute stream at the save (after the producing kernel): the
  copy stream waits for it before the copy out; held until that copy is queued;
* the *copy out* (a timed [`Transfer`][] on the copy stream): it holds the saved tensor (or its
  snapshot) and the pinned lease it fills until its end event has completed and a reap has seen it
  (the background thread waits for each), never shorter; then its ``on_end`` checks the saved
  tensor's version and lets go of the device memory, unless the entry stays on the device (then
  ``Entry.source`` holds it until the entry dies);
* the *pinned lease* (``Entry.data``): from the save until the entry's write ends (a spilled
  capture, unless read-ahead hands it back) or until the entry dies (a capture kept in host
  memory); a copy in flight that reads or writes it holds it longer, so its pages return to the
  pool only after that copy's end event, also when autograd let go of the entry earlier;
* the *copy back* (a timed transfer into new memory of the copy stream, [`DeviceCopies.fetch`][]):
  it holds the lease until its end event; the restored memory is held by ``Entry.restored`` until
  the entry's last handle is served, and by the rebuilt tensors afterwards; at each use the compute
  stream waits for the copy's end event and the memory is marked as used by it (``record_stream``),
  so that it is reused only after that use;
* the *timed marks* on the compute stream (at the step's first save of a device tensor, each save,
  the end of forward, each first use, around each wait at a use): kept by the step until its
  report and profile are taken from them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..device import DeviceCopies, Transfer
from .capture import Capture, copy_out, copy_views, storage_bytes


def needs_snapshot(tensor: torch.Tensor) -> bool:
    """Whether forward may change the saved bytes after the save without autograd noticing: a
    saved tensor outside autograd's graph (see the module docstring)."""
    return not tensor.requires_grad


def kept_bytes(tensor: torch.Tensor, capture: Capture) -> torch.Tensor | None:
    """The captured bytes of a saved tensor left on its device, as a uint8 tensor over its
    storage; None for a compact capture (a view with gaps), which is never left there."""
    return None if capture.start is None else storage_bytes(tensor, capture)


def to_host(
    copies: DeviceCopies,
    device: torch.device,
    tensor: torch.Tensor,
    capture: Capture,
    host: torch.Tensor,
    on_end: Callable[[], None],
    *,
    snapshot: bool,
) -> tuple[Transfer, torch.Tensor | None]:
    """Start copying ``capture``'s bytes of ``tensor`` (on ``device``) into ``host`` (pinned
    memory of ``capture.nbytes``); call it on the thread that runs forward, whose current stream
    wrote the tensor.

    Args:
        copies: the device layer.
        device: the tensor's device.
        tensor: the saved tensor, detached (the copy holds it, and must not hold autograd's graph
            through it).
        capture: which of its bytes.
        host: where they go.
        on_end: called once the copy has ended.
        snapshot: copy the bytes within device memory first (`needs_snapshot`).

    Returns:
        The transfer (``host`` holds the bytes once it has ended; it holds the bytes it reads
        until then, and calls ``on_end`` then), and the captured bytes on the device as a uint8
        tensor (the snapshot, or a view of the tensor's storage), or None for a compact capture.
    """
    if snapshot:
        copied = torch.empty(capture.nbytes, dtype=torch.uint8, device=tensor.device)
        copy_out(tensor, capture, copied)  # on the caller's stream, before the event below
        caller = copies.caller(device)
        return copies.copy(host, copied, caller, on_end=on_end, timed=True), copied
    if capture.start is None:
        # A view with gaps: its elements gathered densely on the copy stream first, so that the
        # copy out moves contiguous bytes asynchronously. The dense memory is the caller's
        # stream's (allocated before the event below, after every earlier user of it), and each
        # transfer holds it until its end.
        dense = torch.empty(capture.nbytes, dtype=torch.uint8, device=tensor.device)
        typed, _ = copy_views(tensor, capture, dense)
        caller = copies.caller(device)
        copies.copy(typed, tensor, caller, hold=(tensor,))
        transfer = copies.copy(host, dense, caller, hold=(tensor,), on_end=on_end, timed=True)
        return transfer, None
    destination, source = copy_views(tensor, capture, host)
    caller = copies.caller(device)
    transfer = copies.copy(destination, source, caller, hold=(tensor,), on_end=on_end, timed=True)
    return transfer, kept_bytes(tensor, capture)
