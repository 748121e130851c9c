"""The kernels of compressed optimizer state ([`tierstore.optimizer.state_precision`][]): 8-bit
blockwise quantisation on a dynamic-tree map, and the compensation term of a bf16 master.

Each kernel is defined by torch operations over whole rows (no Python loop per block), which run
wherever the tensors are: the device path's. On a CPU the same kernels run as C++ loops
([`NATIVE_SOURCE`][], built on first use), each one pass over memory with the torch operations'
bits; where no C++ compiler builds them, the torch operations run there too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

BLOCK = 256
"""Elements per quantisation block of an ``int8`` row (one fp32 absmax each)."""

QUANTISE_CHUNK = 1 << 18
"""Elements the torch operations quantise or dequantise at a time (a multiple of [`BLOCK`][]):
bounds their temporaries."""


@functools.cache
def _map(signed: bool) -> torch.Tensor:
    """The dynamic-tree map (CPU, fp32, sorted)."""
    decades = 7 if signed else 8  # the sign takes a bit of the signed map
    values = [0.0]
    for exponent in range(decades):  # decade 10^(exponent - decades + 1), 2^exponent fractions
        steps = 1 << exponent
        fractions = [0.1 + 0.9 * step / steps for step in range(1, steps + 1)]
        scale = 10.0 ** (exponent - decades + 1)
        values += [scale * fraction for fraction in fractions]
        if signed:
            values += [-scale * fraction for fraction in fractions]
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _dequantisation_table(signed: bool) -> torch.Tensor:
    """Each code's value: the map, NaN past its end (the signed map's 255 entries leave the code
    255 unused), so that every byte indexes the table."""
    return torch.nn.functional.pad(_map(signed), (0, 256 - _map(signed).numel()), value=math.nan)


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 8-bit dynamic-tree map of normalised values (fp32, sorted, at most 256 entries): 0, and
    per decimal exponent ``d`` (10^-6..10^0 signed, 10^-7..10^0 non-negative) the fractions
    ``0.1 + 0.9 k / 2^i`` (``k = 1..2^i``, ``i`` counting decades up from the smallest) times 10^d,
    with both signs for the signed map: 255 entries signed, 256 non-negative, ±1.0 among them."""
    return _map(signed).clone()


_BUCKET_SHIFT = 15
"""A normalised value's fp32 bits shifted right by this name its bucket (its sign, exponent and 8
significand bits): the map's entries are at least 2^-8 of their magnitude apart, so a bucket holds
at most one midpoint between entries, and one comparison of the low bits finds the nearest."""

_LOW_BITS = (1 << _BUCKET_SHIFT) - 1
"""The bits of a normalised value below its bucket."""


@functools.cache
def _bucket_table(signed: bool, device: torch.device) -> torch.Tensor:
    """Each bucket's ``entry``, one int32 per bucket of normalised values (indexed by a value's fp32
    bits >> ``_BUCKET_SHIFT``, its sign bit included), such that ``(entry + the value's low bits)
    >> 15`` is the code of the map entry nearest to the value, all bits inverted for a negative
    value (its low byte then counts down from the entry 0): ``entry`` is the code of the entry
    nearest to the bucket's start times 2^15, plus 2^15 - 1 minus the low bits of the midpoint to
    the next entry inside the bucket (all ones if there is none), so that the low bits carry into
    the code exactly when the value lies beyond that midpoint. Beyond ±1 (a block whose absmax is
    NaN, where the block is divided by 1) a bucket holds the code of ±1, and NaN the code of 1, as
    comparisons with NaN are false; a negative value of the non-negative map takes the code of 0."""
    table = _map(signed)
    positive = table[table >= 0]
    midpoints = (positive[1:] + positive[:-1]) / 2
    count = (int(torch.tensor(1.0).view(torch.int32)) >> _BUCKET_SHIFT) + 1
    starts = (torch.arange(count + 1, dtype=torch.int32) << _BUCKET_SHIFT).view(torch.float32)
    lower = torch.searchsorted(midpoints, starts[:-1])  # midpoints below each bucket's start
    padded = torch.cat([midpoints, torch.tensor([math.inf, math.inf])])
    inside = padded[lower]
    assert bool((padded[lower + 1] >= starts[1:]).all()), "a bucket holds two midpoints"
    # the midpoint's low bits, or all ones (never exceeded) for a bucket without one
    threshold = torch.where(inside < starts[1:], inside.view(torch.int32) & _LOW_BITS, _LOW_BITS).long()
    zero = (table.numel() - 1) // 2 if signed else 0  # the code of the entry 0
    half = 1 << (31 - _BUCKET_SHIFT)  # buckets of each sign
    codes = torch.full((2 * half,), zero + int(lower[-1]), dtype=torch.int64)  # NaN's
    codes[:count] = zero + lower
    if signed:  # inverted: (~code) & 255 counts down from the entry 0
        codes[half:] = ~(zero + int(lower[-1]))  # NaN's
        infinite = int(torch.tensor(math.inf).view(torch.int32)) >> _BUCKET_SHIFT
        codes[half : half + infinite] = ~(zero - int(lower[-1]))  # below -1 (an absmax of NaN)
        codes[half : half + count] = ~(zero - lower)
    else:
        codes[half:] = 0
    thresholds = torch.full((2 * half,), _LOW_BITS, dtype=torch.int64)
    thresholds[:count] = threshold
    if signed:
        thresholds[half : half + count] = threshold
    entries = (codes << _BUCKET_SHIFT) + _LOW_BITS - thresholds
    return entries.to(torch.int32).to(device)


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _padded(short: torch.Tensor) -> torch.Tensor:
    """A row's short last block as one zero-padded block (``1 x BLOCK``, a copy)."""
    return torch.nn.functional.pad(short, (0, BLOCK - short.numel())).view(1, BLOCK)


def _quantise_blocks(
    blocks: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    *,
    table: torch.Tensor,
    flip: torch.Tensor,
) -> None:
    """The kernel of [`quantise_blockwise`][]: fp32 ``blocks`` (``n x BLOCK``) as uint8 ``codes``
    (``n x BLOCK``) and their largest magnitudes ``absmax`` (``n``), by ``table``
    ([`_bucket_table`][]); ``flip`` (int32, -1 for the signed map, else 0) inverts a negative
    value's code."""
    peak = blocks.abs().amax(dim=1)
    peak = torch.where(peak.isnan(), math.nan, peak)  # one NaN's bits, however the maximum is taken
    normalised = blocks / torch.where(peak > 0, peak, 1.0).unsqueeze(1)
    bits = normalised.view(torch.int32)
    entry = (table[(bits >> _BUCKET_SHIFT) & (table.numel() - 1)] + (bits & _LOW_BITS)) >> _BUCKET_SHIFT
    codes.copy_(entry ^ ((bits >> 31) & flip))
    absmax.copy_(peak)


@functools.cache
def _sign_flip(signed: bool) -> torch.Tensor:
    """``flip`` of [`_quantise_blocks`][] for the signed or the non-negative map."""
    return torch.tensor(-1 if signed else 0, dtype=torch.int32)


NATIVE_SOURCE = Path(__file__).with_name("state_kernels.cpp")
"""The CPU kernels' C++ source: each kernel one loop over a row, with the bits of the torch
operations here (the same IEEE fp32 operations in the same order, no fused multiply-adds)."""

_NATIVE_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")


def _kernel_cache() -> Path:
    """Where the built CPU kernels are kept between processes: ``$XDG_CACHE_HOME/tierstore/kernels``
    (``~/.cache`` by default), one library per source, compiler and flags."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierstore" / "kernels"


def _build(compiler: str) -> Path:
    """The library built from [`NATIVE_SOURCE`][] by ``compiler``, from the cache or built into it
    (into a temporary name first, so that a process never loads a half-written library and two
    processes building at once each leave a whole one)."""
    source = NATIVE_SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), *(f.encode() for f in _NATIVE_FLAGS)]))
    library = _kernel_cache() / f"state_kernels-{platform.machine()}-{key.hexdigest()[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as building:
            built = Path(building) / library.name
            subprocess.run(
                [compiler, *_NATIVE_FLAGS, "-o", str(built), str(NATIVE_SOURCE)],
                check=True,
                capture_output=True,
                text=True,
            )
            os.replace(built, library)
    return library


@functools.cache
def _native() -> ctypes.CDLL | None:
    """The CPU kernels, built on first use by the C++ compiler ``$CXX`` (``c++`` by default; about a
    second, then cached: [`_kernel_cache`][]); None, after one warning, where they cannot be built
    or loaded: the kernels then run as torch operations (slower, the same bits)."""
    compiler = os.environ.get("CXX") or "c++"
    try:
        native = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr if isinstance(error, subprocess.CalledProcessError) else error
        warnings.warn(
            f"tierstore: compressed optimizer state runs its CPU kernels as torch operations (slower, "
            f"the same bits): the C++ compiler {compiler!r} could not build them ({str(detail)[:300]})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    signatures = {
        "tierstore_quantise": [pointer, count, pointer, pointer, pointer, ctypes.c_int32],
        "tierstore_dequantise": [pointer, pointer, count, pointer, pointer],
        "tierstore_compensate_bf16": [pointer, count, pointer],
        "tierstore_compensated_master_bf16": [pointer, pointer, count, pointer],
        "tierstore_adamw_int8_compensated": [*[pointer] * 5, count, count, pointer, count, *[pointer] * 5],
    }
    for name, arguments in signatures.items():
        function = getattr(native, name)
        function.argtypes, function.restype = arguments, None
    native.tierstore_adamw_int8_compensated.restype = ctypes.c_int
    return native


def _native_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The CPU kernels where every one of ``tensors`` is a contiguous CPU tensor, else None (torch
    operations: the device path, where each already streams at the device's memory bandwidth)."""
    if all(t.is_cpu and t.is_contiguous() for t in tensors):
        return _native()
    return None


PARALLEL_MIN_NUMEL = 1 << 16
"""Elements from which the C++ kernels share a row among torch's intra-op threads
(``torch.get_num_threads()``, as torch's own CPU kernels do), each thread whole blocks of at least
this many elements."""


@functools.cache
def _threads() -> ThreadPoolExecutor:
    """The threads the C++ kernels share rows among besides the caller's (they release the GIL)."""
    return ThreadPoolExecutor(thread_name_prefix="tierstore-state-kernels")


def _in_parallel(count: int, run: Callable[[int, int], object]) -> None:
    """``run(start, stop)`` over ``[0, count)``, cut at multiples of [`BLOCK`][] into a part per
    intra-op thread (at most one per [`PARALLEL_MIN_NUMEL`][] elements); the caller runs the first."""
    parts = min(torch.get_num_threads(), count // PARALLEL_MIN_NUMEL)
    if parts <= 1:
        run(0, count)
        return
    length = -(-count // parts // BLOCK) * BLOCK
    bounds = [(start, min(start + length, count)) for start in range(0, count, length)]
    others = [_threads().submit(run, start, stop) for start, stop in bounds[1:]]
    try:
        run(*bounds[0])
    finally:
        for other in others:
            other.result()


def quantise_blockwise(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """8-bit blockwise quantisation of a row: per [`BLOCK`][] elements (the last block may be
    shorter) the largest magnitude into ``absmax``, and each value divided by it rounded to the
    nearest entry of [`dynamic_map`][] (its index into ``codes``; a value half-way between two
    entries takes the one of smaller magnitude).

    Args:
        values: the fp32 row.
        codes: uint8, as many as ``values``.
        absmax: fp32, one per block (``ceil(len(values) / BLOCK)``).
        signed: the signed map (a moment of either sign) or the non-negative one.
    """
    table, flip = _bucket_table(signed, values.device), _sign_flip(signed)
    native = _native_for(values, codes, absmax)
    if native is not None:
        _in_parallel(
            values.numel(),
            lambda start, stop: native.tierstore_quantise(
                values.data_ptr() + 4 * start,
                stop - start,
                codes.data_ptr() + start,
                absmax.data_ptr() + 4 * (start // BLOCK),
                table.data_ptr(),
                int(flip),
            ),
        )
        return
    full = values.numel() // BLOCK
    chunk = QUANTISE_CHUNK // BLOCK
    for first in range(0, full, chunk):
        last = min(first + chunk, full)
        window = slice(first * BLOCK, last * BLOCK)
        blocks = values[window].view(-1, BLOCK)
        _quantise_blocks(blocks, codes[window].view(-1, BLOCK), absmax[first:last], table=table, flip=flip)
    if full * BLOCK < values.numel():  # the short last block, zero-padded
        short = torch.empty(1, BLOCK, dtype=torch.uint8, device=codes.device)
        _quantise_blocks(_padded(values[full * BLOCK :]), short, absmax[full:], table=table, flip=flip)
        codes[full * BLOCK :].copy_(short.view(-1)[: values.numel() - full * BLOCK])


def dequantise_blockwise(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, signed: bool) -> None:
    """The inverse of [`quantise_blockwise`][]: each code's map entry times its block's absmax, into
    the fp32 row ``out``."""
    table = _on(_dequantisation_table(signed), out.device)
    native = _native_for(codes, absmax, out)
    if native is not None:
        _in_parallel(
            out.numel(),
            lambda start, stop: native.tierstore_dequantise(
                codes.data_ptr() + start,
                absmax.data_ptr() + 4 * (start // BLOCK),
                stop - start,
                table.data_ptr(),
                out.data_ptr() + 4 * start,
            ),
        )
        return
    full = out.numel() // BLOCK * BLOCK
    index = torch.empty(min(QUANTISE_CHUNK, out.numel()), dtype=torch.int32, device=out.device)
    for start in range(0, out.numel(), QUANTISE_CHUNK):
        part = out[start : start + QUANTISE_CHUNK]
        size = part.numel()
        index[:size].copy_(codes[start : start + size])
        torch.index_select(table, 0, index[:size], out=part)
        blocks = min(size, full - start) // BLOCK
        if blocks:
            part[: blocks * BLOCK].view(blocks, BLOCK).mul_(
                absmax[start // BLOCK : start // BLOCK + blocks].unsqueeze(1)
            )
        if blocks * BLOCK < size:  # the short last block
            part[blocks * BLOCK :].mul_(absmax[full // BLOCK])


def compensate(master: torch.Tensor, param_dtype: torch.dtype, compensation: torch.Tensor) -> None:
    """The compensation term of fp32 ``master`` weights whose parameter holds them rounded to
    ``param_dtype``: ``master - rounded``, rounded to bf16 (at most half the parameter's resolution:
    ``param + compensation`` rounds back to the parameter, or lies exactly half-way, which
    [`settled_master`][] resolves)."""
    native = _native_for(master, compensation) if param_dtype == torch.bfloat16 else None
    if native is not None:
        _in_parallel(
            master.numel(),
            lambda start, stop: native.tierstore_compensate_bf16(
                master.data_ptr() + 4 * start, stop - start, compensation.data_ptr() + 2 * start
            ),
        )
        return
    compensation.copy_(master - master.to(param_dtype).float())


def compensated_master(param: torch.Tensor, compensation: torch.Tensor, master: torch.Tensor) -> None:
    """The fp32 ``master`` weights of a low-precision ``param``: ``param + compensation``."""
    native = _native_for(param, compensation, master) if param.dtype == torch.bfloat16 else None
    if native is not None:
        _in_parallel(
            master.numel(),
            lambda start, stop: native.tierstore_compensated_master_bf16(
                param.data_ptr() + 2 * start,
                compensation.data_ptr() + 2 * start,
                stop - start,
                master.data_ptr() + 4 * start,
            ),
        )
        return
    master.copy_(param)
    master.add_(compensation)


def settled_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """``master`` (``param + compensation``) moved one fp32 step towards the parameter where it lies
    exactly half-way to the parameter's neighbour, so that the parameter rounds from it: the master
    weights handed out (state dicts, `master_params`) are ones their parameter rounds from."""
    ties = master.to(param.dtype) != param
    master.copy_(torch.where(ties, torch.nextafter(master, param.float()), master))


class _AdamW(ctypes.Structure):
    """The kernel's hyper-parameters (``AdamW`` in [`NATIVE_SOURCE`][]), as torch's kernel rounds
    them to fp32."""

    _fields_ = [
        ("decay", ctypes.c_float),
        ("lerp_weight", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("square_weight", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("coefficient", ctypes.c_float),
        ("scale", ctypes.c_int32),
        ("maximize", ctypes.c_int32),
    ]


class _PieceStep(ctypes.Structure):
    """A parameter's elements in the sub-group (``PieceStep`` in [`NATIVE_SOURCE`][])."""

    _fields_ = [
        ("offset", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("body", ctypes.c_int64),
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("step_size", ctypes.c_float),
        ("correction2_sqrt", ctypes.c_float),
    ]


TORCH_VECTOR = {"AVX2": 8}
"""fp32 elements per vector of torch's fused AdamW, by torch's CPU kernel build
(``torch.backends.cpu.get_cpu_capability()``): where [`adamw_int8_compensated`][] gives its bits."""


def adamw_int8_compensated(
    moments: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    compensation: torch.Tensor,
    pieces: Sequence[tuple[int, torch.Tensor, torch.Tensor | None, int]],
    group: dict[str, Any],
    coefficient: float,
) -> bool:
    """One AdamW step of a sub-group stored in 8-bit moments and a compensated bf16 master, in one
    pass over it (C++, a block at a time in the CPU's cache), with the bits of the kernels run one
    by one: unpacking, ``torch._fused_adamw_`` (torch's own CPU kernel, its vector body and its
    scalar tail each reproduced), the parameter's rounding, the compensation and packing.

    Args:
        moments: the codes and block maxima of ``exp_avg`` and of ``exp_avg_sq``, written.
        compensation: the master's compensation terms (bf16, one per element), written.
        pieces: each parameter's elements in the sub-group, in order: their offset, the
            parameter's elements (bf16, contiguous; updated), its gradient's (bf16, contiguous;
            None: no update) and its step count.
        group: the parameter group (``lr``, ``betas``, ``eps``, ``weight_decay``, ``maximize``);
            AdamW's decoupled weight decay, no ``amsgrad``.
        coefficient: the step's unscaling and clipping factor, applied to the gradients.

    Returns:
        Whether it ran: not where the C++ kernels are not built, torch's AdamW kernel is not one
        whose bits it reproduces ([`TORCH_VECTOR`][]) or the CPU lacks AVX2 and FMA; then nothing is
        written.
    """
    native = _native_for(compensation, *(t for pair in moments for t in pair))
    vector = TORCH_VECTOR.get(torch.backends.cpu.get_cpu_capability())
    if native is None or vector is None:
        return False
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    steps = (_PieceStep * len(pieces))()
    for entry, (offset, param, grad, count) in zip(steps, pieces, strict=True):
        entry.offset, entry.length = offset, param.numel()
        entry.body = param.numel() - param.numel() % vector
        entry.param, entry.grad = param.data_ptr(), None if grad is None else grad.data_ptr()
        if grad is not None:  # torch's bias corrections, in double
            entry.step_size = lr / (1 - beta1 ** float(count))
            entry.correction2_sqrt = math.sqrt(1 - beta2 ** float(count))
    hyper = _AdamW(
        1 - lr * group["weight_decay"],
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        coefficient,
        coefficient != 1.0,
        bool(group["maximize"]),
    )
    tables = [_dequantisation_table(True), _dequantisation_table(False)]
    buckets = [_bucket_table(True, compensation.device), _bucket_table(False, compensation.device)]
    (codes_m, absmax_m), (codes_v, absmax_v) = moments
    ran: list[int] = []
    _in_parallel(  # whole blocks per thread: each thread's blocks and their pieces are its own
        compensation.numel(),
        lambda start, stop: ran.append(
            native.tierstore_adamw_int8_compensated(
                codes_m.data_ptr(),
                absmax_m.data_ptr(),
                codes_v.data_ptr(),
                absmax_v.data_ptr(),
                compensation.data_ptr(),
                start,
                stop,
                ctypes.cast(steps, ctypes.c_void_p),
                len(pieces),
                ctypes.addressof(hyper),
                *(t.data_ptr() for t in tables),
                *(t.data_ptr() for t in buckets),
            )
        ),
    )
    return all(ran)
