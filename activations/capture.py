"""Which bytes of a saved tensor the offloader captures, and how it rebuilds the tensor from them.

A tensor autograd saves is often a view, and its storage is often written again after the save
*outside* the view, legally and without any version bump: torch's RNN cells split one gate
projection with ``unsafe_chunk`` and finish each chunk in place (``sigmoid_``, ``tanh_``), and
BatchNorm updates its running statistics inside its kernel. So the offloader never writes a storage
that forward may still be changing: at the save it copies exactly the bytes the view covers (a
`Capture`), and backward gets a tensor rebuilt from that copy with the view's dtype, shape and
strides.

* A view whose elements fill one contiguous byte range (a dense tensor in any dimension order, or an
  overlapping one such as an expanded tensor) is captured as that range, from the boundary below its
  first byte of the alignment the tensor's allocator gives every storage (`HOST_ALIGN` on the CPU,
  `DEVICE_ALIGN` on a CUDA device): the rebuilt tensor has the original's strides and its address
  modulo that alignment, so kernels take the same paths (a kernel may be chosen by its operands'
  alignment) and give the same bits.
* A view with gaps (one chunk of a gate projection, ``q`` of a fused ``qkv``) is captured
  compactly, its elements only, laid out densely in the view's own dimension order (as
  ``torch.empty_like`` lays it out): several chunks of one storage cost their own bytes, never the
  whole storage each.

Two saves of the same bytes (the same storage, the same range or the same view, at the same
version) share one capture: a tensor saved as one operation's output and the next one's input is
spilled once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HOST_ALIGN = 64
"""The alignment of every storage torch's CPU allocator makes."""
DEVICE_ALIGN = 512
"""The alignment of every block CUDA's caching allocator hands out."""


@dataclass(frozen=True)
class Capture:
    """The bytes of one storage that a save copies out."""

    identity: tuple[object, ...]
    """Equal for two saves of one storage that need the same bytes (geometry and version): one
    capture then serves both."""
    nbytes: int
    start: int | None
    """Storage byte offset of the first byte of a range; None for a compact copy."""
    dense_strides: tuple[int, ...]
    """Strides (in elements) of a compact copy's layout; empty for a range."""


@dataclass(frozen=True)
class View:
    """Where one saved tensor lies inside its capture's bytes."""

    offset: int
    """Element offset of its first element from the start of the captured bytes."""
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


def capture_of(tensor: torch.Tensor, align: int = HOST_ALIGN) -> Capture:
    """How to capture ``tensor``: a strided CPU or CUDA tensor with at least one element, whose
    allocator aligns every storage to ``align`` bytes."""
    itemsize = tensor.element_size()
    sizes, strides, offset = tuple(tensor.shape), tensor.stride(), int(tensor.storage_offset())
    span = 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))
    if tensor.numel() < span:  # gaps between the elements: copy the elements alone
        dense = tuple(int(stride) for stride in torch.empty_like(tensor, device="meta").stride())
        identity = ("compact", tensor.dtype, offset, sizes, strides, tensor._version)
        return Capture(identity, tensor.numel() * itemsize, None, dense)
    first = offset * itemsize
    start, end = first - first % align, first + span * itemsize
    return Capture(("range", start, end, tensor._version), end - start, start, ())


def view_of(tensor: torch.Tensor, capture: Capture) -> View:
    """Where ``tensor`` lies inside ``capture``, which may have been made for another view of the
    same bytes (``x`` and ``x.view(-1, d)`` share one range)."""
    if capture.start is None:
        return View(0, tuple(tensor.shape), capture.dense_strides)
    first = tensor.storage_offset() * tensor.element_size()
    return View((first - capture.start) // tensor.element_size(), tuple(tensor.shape), tensor.stride())


def copy_views(
    tensor: torch.Tensor, capture: Capture, destination: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What copying ``capture``'s bytes of ``tensor`` into ``destination`` (a uint8 tensor of
    ``capture.nbytes``) copies: ``destination`` or a typed view of it, and the captured bytes of
    ``tensor``'s storage or ``tensor`` itself (a compact capture's elements)."""
    if capture.start is None:
        typed = destination.view(tensor.dtype).as_strided(tensor.shape, capture.dense_strides)
        return typed, tensor
    return destination, storage_bytes(tensor, capture)


def storage_bytes(tensor: torch.Tensor, capture: Capture) -> torch.Tensor:
    """The bytes of ``tensor``'s storage a range capture covers, as a uint8 tensor over them."""
    assert capture.start is not None
    source = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return source.set_(tensor.untyped_storage(), capture.start, (capture.nbytes,), (1,))


def copy_out(tensor: torch.Tensor, capture: Capture, destination: torch.Tensor) -> None:
    """Copy ``capture``'s bytes of ``tensor`` into ``destination``: a uint8 tensor of
    ``capture.nbytes`` on any device (a copy between devices is queued on the current stream)."""
    typed, source = copy_views(tensor, capture, destination)
    typed.copy_(source, non_blocking=True)


def rebuild(data: torch.Tensor, dtype: torch.dtype, view: View) -> torch.Tensor:
    """The saved tensor over ``data`` (its capture's bytes: a uint8 tensor, contiguous, at any
    offset of its storage that the view's element size divides). It shares that storage, so the
    bytes live exactly as long as some rebuilt tensor or the offloader holds them."""
    rebuilt = torch.empty(0, dtype=dtype, device=data.device)
    offset = data.storage_offset() // dtype.itemsize + view.offset
    return rebuilt.set_(data.untyped_storage(), offset, view.sizes, view.strides)
