"""The gradients of an offloaded optimizer's step: their global norm, the coefficient that unscales
and clips them, and their delayed conversion into a reused fp32 buffer.

[`StagedOptimizer`][] measures the norm from the low-precision gradients (fp32 accumulation over
cache-sized pieces, no full fp32 copy), derives one coefficient from it (None for an overflow, which
skips the step), and per sub-group converts the gradients into the buffer, multiplied by the
coefficient, just before its kernel reads them. On the device path the norm is taken on the device
(`device_squares`) and the buffer and step counts are device memory (`DeviceBuffers`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from .partition import KERNEL_ALIGNMENT, Piece, SubGroup, cut_length

GRADIENT_CHUNK = 1 << 19
"""fp32 elements converted at a time for the norm and for element-wise kernels (2 MiB: sized so
that, with the state it is combined with, it stays in a CPU's cache)."""

DEVICE_GRADIENT_CHUNK = 1 << 24
"""fp32 elements converted at a time for element-wise kernels on a device (64 MiB: few kernel
launches per sub-group, little device memory beside the slots)."""

NO_GRADIENTS = torch.empty(0, dtype=torch.float32)
"""The device path's gradient buffer between steps: none (each step makes its own)."""

PiecesWithGradients = Iterable[tuple[Piece, torch.Tensor]]
"""A sub-group's pieces whose parameter has a gradient, each with that gradient flat."""


def gradient_numel(subgroups: list[SubGroup], *, whole_params: bool, on_device: bool) -> int:
    """Elements of the fp32 gradient buffer ``subgroups`` need.

    Args:
        subgroups: the sub-groups whose gradients the buffer takes.
        whole_params: the kernel needs whole parameters, so the buffer holds a whole sub-group's.
        on_device: the buffer is device memory (`DEVICE_GRADIENT_CHUNK`, else `GRADIENT_CHUNK`,
            elements at most for an element-wise kernel).
    """
    largest = max((sg.numel for sg in subgroups), default=1)
    chunk = DEVICE_GRADIENT_CHUNK if on_device else GRADIENT_CHUNK
    return largest if whole_params else min(largest, chunk)


def convert_gradients(
    buffer: torch.Tensor, pieces: PiecesWithGradients, numel: int, coefficient: float
) -> list[tuple[Piece, torch.Tensor]]:
    """Delayed conversion: a sub-group's low-precision gradients into the fp32 ``buffer`` (at the
    pieces' offsets), times the coefficient.

    Args:
        buffer: the fp32 gradient buffer, at least a sub-group's worth.
        pieces: the sub-group's pieces with gradients (a piece without one is left out: as in
            torch, no gradient means no update and no weight decay).
        numel: the sub-group's elements (the part of the buffer scaled).
        coefficient: the step's unscaling and clipping factor.

    Returns:
        Each piece with its converted gradient, a view into ``buffer``.
    """
    grads = []
    for piece, flat in pieces:
        converted = buffer[piece.offset : piece.offset + piece.length]
        converted.copy_(flat[piece.param_offset : piece.param_offset + piece.length])
        grads.append((piece, converted))
    if grads and coefficient != 1.0:
        buffer[:numel].mul_(coefficient)
    return grads


def gradient_chunks(
    buffer: torch.Tensor, pieces: PiecesWithGradients, coefficient: float
) -> Iterator[list[tuple[Piece, torch.Tensor]]]:
    """The same as `convert_gradients`, a buffer's worth at a time: each chunk lists pieces (parts
    of the sub-group's, cut near the buffer's end where `cut_length` allows) with their fp32
    gradients. An element-wise kernel run on each chunk reads the converted gradient while it is
    still in cache: a whole sub-group's worth would go out to memory and come back, traffic that
    competes with the state I/O for the memory bus.

    Args:
        buffer: the fp32 gradient buffer (its size is the chunk's).
        pieces: the sub-group's pieces with gradients.
        coefficient: the step's unscaling and clipping factor.
    """
    room = buffer.numel()
    alignment = KERNEL_ALIGNMENT if room >= KERNEL_ALIGNMENT else 1
    chunk: list[tuple[Piece, torch.Tensor]] = []
    used = 0
    for piece, flat in pieces:
        done = 0
        while done < piece.length:
            take = cut_length(piece.param_offset + done, piece.length - done, room - used, alignment)
            if take == 0:  # cut the parameter where the sub-group partition could have
                yield _scaled(buffer, chunk, used, coefficient)
                chunk, used = [], 0
                continue
            part = Piece(piece.param, piece.param_offset + done, piece.offset + done, take)
            converted = buffer[used : used + take]
            converted.copy_(flat[part.param_offset : part.param_offset + take])
            chunk.append((part, converted))
            used += take
            done += take
            if used == room:
                yield _scaled(buffer, chunk, used, coefficient)
                chunk, used = [], 0
    if chunk:
        yield _scaled(buffer, chunk, used, coefficient)


def _scaled(
    buffer: torch.Tensor, chunk: list[tuple[Piece, torch.Tensor]], used: int, coefficient: float
) -> list[tuple[Piece, torch.Tensor]]:
    """``chunk``, its ``used`` elements of ``buffer`` multiplied by the coefficient."""
    if coefficient != 1.0:
        buffer[:used].mul_(coefficient)
    return chunk


def clip_coefficient(total: float, grad_scale: float, max_grad_norm: float | None) -> float | None:
    """From the unscaled gradient norm ``total``: 1/grad_scale times the clipping factor (as
    ``clip_grad_norm_`` takes it, for ``max_grad_norm``; None: no clipping), or None if the norm is
    not finite (the gradients overflowed)."""
    if not math.isfinite(total):
        return None
    coefficient = 1.0 / grad_scale
    if max_grad_norm is not None:
        coefficient *= min(1.0, max_grad_norm / (total + 1e-6))  # as clip_grad_norm_
    return coefficient


def squares(grad: torch.Tensor, buffer: torch.Tensor) -> float:
    """A gradient's sum of squares, in fp32 over cache-sized pieces summed in double. A
    low-precision gradient is converted piece by piece into the fp32 ``buffer`` and then reduced,
    rather than reduced with the conversion inside (``vector_norm(dtype=torch.float32)``), which is
    slower on a CPU; each piece stays in cache between the two."""
    flat, total = grad.reshape(-1), 0.0
    size = min(buffer.numel(), GRADIENT_CHUNK)
    for start in range(0, flat.numel(), size):
        part = flat[start : start + size]
        if part.dtype != torch.float32:
            part = buffer[: part.numel()].copy_(part)
        total += float(torch.dot(part, part))
    return total


def device_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' sum of squares on their device (a 0-d fp32 tensor; torch's per-tensor fp32
    norms, as ``clip_grad_norm_`` takes them, of gradients of any dtype)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


class DeviceBuffers:
    """What one step's kernels on the device share: the fp32 gradient buffer (device memory of the
    caller's stream) and the step counts as 0-d fp32 tensors on the device, made by the first
    kernel that needs each count.

    Args:
        grad: the gradient buffer.
        device: where torch places the parameters' memory (for the step counts).
    """

    def __init__(self, grad: torch.Tensor, device: torch.device) -> None:
        self.grad = grad
        self.device = device
        self.steps: dict[int, torch.Tensor] = {}
        self.seconds = 0.0
        """Host seconds spent queueing the step's kernels."""

    def step_tensor(self, count: int) -> torch.Tensor:
        """``count`` as a 0-d fp32 tensor on the device (filled by a kernel, no copy from the
        host)."""
        tensor = self.steps.get(count)
        if tensor is None:
            tensor = self.steps[count] = torch.full((), float(count), dtype=torch.float32, device=self.device)
        return tensor


def host_step_tensor(count: int) -> torch.Tensor:
    """A step count as torch's fused CPU kernels take it: a 0-d fp32 CPU tensor."""
    return torch.tensor(float(count))
