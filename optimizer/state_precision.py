"""Compressed optimizer state: the formats a sub-group's state is stored in, and their kernels.

An offloaded AdamW moves its whole state through the store every step: fp32 master weights and two
fp32 moments, 12 bytes per parameter each way (8 for an fp32 parameter, its own master). A
[`StatePrecision`][] stores fewer:

* **moments** (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``): ``"fp32"``; ``"bf16"`` (rounded to
  nearest, 2 bytes); ``"int8"``, 8-bit blockwise quantisation (1 byte, and a 4-byte absmax per
  [`BLOCK`][] elements): each block of a row is divided by its largest magnitude and each value
  rounded to the nearest entry of a dynamic-tree map ([`dynamic_map`][]: a decimal exponent and a
  linear fraction, more fraction steps for larger magnitudes; the signed map for ``exp_avg``, the
  non-negative one for the second moments, as 8-bit Adam quantises them);
* **master** weights of low-precision (bf16, fp16) parameters: ``"fp32"``, or
  ``"bf16-compensated"``: the parameter itself plus a bf16 compensation term (Kahan), the rounding
  error the parameter lost, 2 bytes. The master is ``param + compensation`` in fp32; after the
  update the parameter takes it rounded and the compensation what rounding left, so updates
  smaller than the parameter's resolution accumulate instead of vanishing. An fp32 parameter is
  its own master in every format.

Each sub-group is dequantised into fp32, updated by the optimizer's own fp32 kernel and quantised
back, so blocks never straddle sub-groups (each row's blocks start at the sub-group's start); the
CPU path does so a span of it at a time ([`spans`][]), while the span's fp32 state is in the CPU's
cache. The kernels are torch operations over whole rows (no Python loop per block) and run
wherever the tensors are: the CPU path and the device path share them. On a CPU, rows of
[`FUSED_MIN_NUMEL`][] elements or more run them compiled by ``torch.compile``, each kernel one
loop over memory, with the eager kernels' bits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, cast

import torch

from ..errors import ConfigError
from .partition import KERNEL_ALIGNMENT, Piece, SubGroup

BLOCK = 256
"""Elements per quantisation block of an ``int8`` row (one fp32 absmax each)."""

QUANTISE_CHUNK = 1 << 18
"""Elements quantised at a time (a multiple of [`BLOCK`][]): bounds the kernels' temporaries."""

_Result = TypeVar("_Result")

ALIGNMENT = 64
"""Bytes: every segment of a packed sub-group starts at a multiple of this."""

MomentFormat = Literal["fp32", "bf16", "int8"]
MasterFormat = Literal["fp32", "bf16-compensated"]
RowKind = Literal["master", "signed", "nonnegative"]
"""What a row of a sub-group's state holds: master weights, a signed moment (``exp_avg``) or a
non-negative one (``exp_avg_sq``, ``max_exp_avg_sq``)."""


@dataclasses.dataclass(frozen=True)
class StatePrecision:
    """How a sub-group's state is stored.

    Attributes:
        moments: the moments' format: ``"fp32"``, ``"bf16"`` or ``"int8"`` (blockwise, dynamic-tree).
        master: low-precision parameters' master weights: ``"fp32"`` or ``"bf16-compensated"``
            (the parameter plus a bf16 compensation term).
    """

    moments: MomentFormat = "fp32"
    master: MasterFormat = "fp32"

    @property
    def name(self) -> str:
        """The preset's name ([`PRESETS`][]) if it is one, else ``moments/master``."""
        for name, preset in PRESETS.items():
            if preset == self:
                return name
        return f"{self.moments}/{self.master}"

    @property
    def compressed(self) -> bool:
        """Whether anything is stored in less than fp32."""
        return self != FP32_STATE


FP32_STATE = StatePrecision()
PRESETS: dict[str, StatePrecision] = {
    "fp32": FP32_STATE,
    "bf16": StatePrecision("bf16"),
    "int8": StatePrecision("int8"),
    "int8-compensated": StatePrecision("int8", "bf16-compensated"),
}
"""The named formats: fp32 (the default, exact), bf16 moments, 8-bit moments, and 8-bit moments
with a compensated bf16 master."""


def state_precision(value: object, where: str = "state_precision") -> StatePrecision:
    """``value`` as a [`StatePrecision`][]: a preset's name ([`PRESETS`][]), a [`StatePrecision`][],
    or a mapping with ``moments`` and ``master``.

    Raises:
        ConfigError: anything else, naming ``where`` and the accepted values.
    """
    if isinstance(value, str) and value in PRESETS:
        return PRESETS[value]
    if isinstance(value, dict) and set(value) <= {"moments", "master"}:
        value = StatePrecision(**value)
    if (
        isinstance(value, StatePrecision)
        and value.moments in ("fp32", "bf16", "int8")
        and value.master in ("fp32", "bf16-compensated")
    ):
        return value
    raise ConfigError(
        f"{where}: must be one of {', '.join(repr(name) for name in PRESETS)} or a StatePrecision"
        f"(moments='fp32'|'bf16'|'int8', master='fp32'|'bf16-compensated'), not {value!r}"
    )


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
    blocks: torch.Tensor, table: torch.Tensor, signed: bool, codes: torch.Tensor, absmax: torch.Tensor
) -> None:
    """The kernel of [`quantise_blockwise`][]: fp32 ``blocks`` (``n x BLOCK``) as uint8 ``codes``
    (``n x BLOCK``) and their largest magnitudes ``absmax`` (``n``), by ``table``
    ([`_bucket_table`][])."""
    peak = blocks.abs().amax(dim=1)
    peak = torch.where(peak.isnan(), math.nan, peak)  # one NaN's bits, however the maximum is taken
    normalised = blocks / torch.where(peak > 0, peak, 1.0).unsqueeze(1)
    bits = normalised.view(torch.int32)
    entry = (table[(bits >> _BUCKET_SHIFT) & (table.numel() - 1)] + (bits & _LOW_BITS)) >> _BUCKET_SHIFT
    if signed:  # inverted for a negative value
        entry = entry ^ (bits >> 31)
    codes.copy_(entry)
    absmax.copy_(peak)


def _dequantise_blocks(
    codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, out: torch.Tensor
) -> None:
    """The kernel of [`dequantise_blockwise`][]: uint8 ``codes`` (``n x BLOCK``) as fp32 ``out``,
    each code's ``table`` entry (256 of them) times its block's ``absmax`` (``n``)."""
    out.copy_(table[codes.int()] * absmax.unsqueeze(1))


def _compensate(master: torch.Tensor, param_dtype: torch.dtype, compensation: torch.Tensor) -> None:
    """The kernel of [`compensate`][]: ``master`` less its rounding to ``param_dtype``, in fp32,
    rounded to bf16 into ``compensation``."""
    compensation.copy_(master - master.to(param_dtype).float())


FUSED_MIN_NUMEL = 1 << 16
"""Elements from which a CPU runs the kernels above compiled (``torch.compile``: each one loop that
reads its inputs once and writes its outputs once, instead of an operation at a time) rather than
eagerly; fewer are not worth a compilation, the first in a process (seconds, each kernel's
machine code then cached on disk by torch's inductor for later processes). Both give the same
bits: the same fp32 operations in the same order, with no contraction into fused multiply-adds.
The device path runs them eagerly, where each operation already streams at the device's memory
bandwidth."""

_unfused_reason: list[str] = []
"""Why the CPU kernels are not compiled in this process (empty while they are): the compiler's
failure, once, after which every kernel runs eagerly."""


@functools.cache
def _compiled(kernel: Callable[..., Any]) -> Callable[..., Any]:
    # The first call's sizes compiled, then every size the second call changes (a row's length):
    # one recompilation. Indices need no bound checks: they are masked or one byte, into tables of
    # 2^17 and 256 entries. Roundings to bf16 stay in: inductor would otherwise keep fp32 values
    # across a cast to bf16 and back, and lose the compensation.
    return torch.compile(
        kernel, fullgraph=True, options={"assert_indirect_indexing": False, "emulate_precision_casts": True}
    )


def _kernel(kernel: Callable[..., _Result], like: torch.Tensor) -> Callable[..., _Result]:
    """``kernel`` as it runs on tensors like ``like``: compiled on a CPU from [`FUSED_MIN_NUMEL`][]
    elements on (unless compiling failed in this process: then, with a warning, eagerly), else
    eagerly."""
    if like.device.type != "cpu" or like.numel() < FUSED_MIN_NUMEL or _unfused_reason:
        return kernel
    compiled = _compiled(kernel)

    def run(*args: Any) -> _Result:
        try:
            return cast(_Result, compiled(*args))
        except torch._dynamo.exc.BackendCompilerFailed as error:
            _unfused_reason.append(f"{type(error.inner_exception).__name__}: {error.inner_exception}")
            warnings.warn(
                f"tierstore: compressed optimizer state runs its CPU kernels eagerly (slower, the "
                f"same bits): torch.compile failed ({_unfused_reason[0][:300]})",
                RuntimeWarning,
                stacklevel=3,
            )
            return kernel(*args)

    return run


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
    table = _bucket_table(signed, values.device)
    full = values.numel() // BLOCK
    kernel = _kernel(_quantise_blocks, values)
    for first in range(0, full, QUANTISE_CHUNK // BLOCK):
        last = min(first + QUANTISE_CHUNK // BLOCK, full)
        window = slice(first * BLOCK, last * BLOCK)
        kernel(
            values[window].view(-1, BLOCK), table, signed, codes[window].view(-1, BLOCK), absmax[first:last]
        )
    if full * BLOCK < values.numel():  # the short last block, zero-padded
        short = torch.empty(1, BLOCK, dtype=torch.uint8, device=codes.device)
        _quantise_blocks(_padded(values[full * BLOCK :]), table, signed, short, absmax[full:])
        codes[full * BLOCK :].copy_(short.view(-1)[: values.numel() - full * BLOCK])


def dequantise_blockwise(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, signed: bool) -> None:
    """The inverse of [`quantise_blockwise`][]: each code's map entry times its block's absmax, into
    the fp32 row ``out``."""
    table = _on(_dequantisation_table(signed), out.device)
    full = out.numel() // BLOCK
    kernel = _kernel(_dequantise_blocks, out)
    for first in range(0, full, QUANTISE_CHUNK // BLOCK):
        last = min(first + QUANTISE_CHUNK // BLOCK, full)
        window = slice(first * BLOCK, last * BLOCK)
        kernel(codes[window].view(-1, BLOCK), absmax[first:last], table, out[window].view(-1, BLOCK))
    if full * BLOCK < out.numel():  # the short last block
        out[full * BLOCK :].copy_(table[codes[full * BLOCK :].int()] * absmax[full])


def compensate(master: torch.Tensor, param_dtype: torch.dtype, compensation: torch.Tensor) -> None:
    """The compensation term of fp32 ``master`` weights whose parameter holds them rounded to
    ``param_dtype``: ``master - rounded``, rounded to bf16 (at most half the parameter's resolution:
    ``param + compensation`` rounds back to the parameter, or lies exactly half-way, which
    [`settled_master`][] resolves)."""
    _kernel(_compensate, master)(master, param_dtype, compensation)


def settled_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """``master`` (``param + compensation``) moved one fp32 step towards the parameter where it lies
    exactly half-way to the parameter's neighbour, so that the parameter rounds from it: the master
    weights handed out (state dicts, `master_params`) are ones their parameter rounds from."""
    ties = master.to(param.dtype) != param
    master.copy_(torch.where(ties, torch.nextafter(master, param.float()), master))


@dataclasses.dataclass(frozen=True)
class Segment:
    """A row's bytes in a packed sub-group: its values and, for ``int8``, its block maxima."""

    kind: RowKind
    format: str
    """``"fp32"``, ``"bf16"``, ``"int8"`` or ``"bf16-compensated"``."""
    offset: int
    nbytes: int
    absmax_offset: int = 0


_WIDTHS = {"fp32": 4, "bf16": 2, "int8": 1, "bf16-compensated": 2}
"""Bytes per element of each format."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """A sub-group's state rows (each ``numel`` values) as stored in ``precision``: the byte
    segments of one packed object, a whole number of fp32 words.

    Args:
        kinds: what each row holds, in the state's order.
        numel: the sub-group's elements (each row's length).
        precision: the format.
    """

    kinds: tuple[RowKind, ...]
    numel: int
    precision: StatePrecision

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """Each row's segment, in row order."""
        return self._packing[0]

    @property
    def words(self) -> int:
        """fp32 words of the packed object."""
        return self._packing[1] // 4

    @functools.cached_property
    def _packing(self) -> tuple[tuple[Segment, ...], int]:
        segments, offset = [], 0
        blocks = -(-self.numel // BLOCK)
        for kind in self.kinds:
            fmt = self.precision.master if kind == "master" else self.precision.moments
            nbytes = _aligned(_WIDTHS[fmt] * self.numel)
            segments.append(Segment(kind, fmt, offset, nbytes, offset + nbytes))
            offset += nbytes + (_aligned(4 * blocks) if fmt == "int8" else 0)
        return tuple(segments), offset

    @functools.cached_property
    def _padding(self) -> tuple[tuple[int, int], ...]:
        """The byte ranges between the segments' values, written as zeros (a packed object's bytes
        are all determined by its state)."""
        ranges, blocks = [], -(-self.numel // BLOCK)
        for segment in self.segments:
            ranges.append(
                (segment.offset + _WIDTHS[segment.format] * self.numel, segment.offset + segment.nbytes)
            )
            if segment.format == "int8":
                ranges.append(
                    (segment.absmax_offset + 4 * blocks, segment.absmax_offset + _aligned(4 * blocks))
                )
        return tuple((start, end) for start, end in ranges if end > start)

    def _view(self, packed: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` values of ``dtype`` from byte ``offset`` of ``packed``."""
        return packed.view(torch.uint8)[offset : offset + count * dtype.itemsize].view(dtype)

    def decode(
        self,
        packed: torch.Tensor,
        rows: torch.Tensor,
        windows: Sequence[tuple[int, torch.Tensor]] = (),
        *,
        settle: bool = False,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Unpack into fp32 ``rows`` (``len(kinds) x numel``, or the span's length).

        Args:
            packed: the packed object (fp32 words).
            rows: the fp32 state, filled.
            windows: for a compensated master, each low-precision piece's offset in the sub-group
                and its parameter's elements; the master is ``param + compensation`` there and
                zero elsewhere.
            settle: hand out a compensated master its parameter rounds from ([`settled_master`][]),
                rather than the one the update continues from.
            span: the elements ``[start, stop)`` of each row only (``start`` a multiple of
                [`BLOCK`][]); all of them if None.
        """
        start, stop = (0, self.numel) if span is None else span
        length = stop - start
        for segment, row in zip(self.segments, rows.view(len(self.kinds), length), strict=True):
            if segment.format == "fp32":
                row.copy_(self._view(packed, segment.offset, self.numel, torch.float32)[start:stop])
            elif segment.format == "bf16":
                row.copy_(self._view(packed, segment.offset, self.numel, torch.bfloat16)[start:stop])
            elif segment.format == "int8":
                codes, absmax = self._quantised(packed, segment, start, stop)
                dequantise_blockwise(codes, absmax, row, segment.kind == "signed")
            else:
                compensation = self._view(packed, segment.offset, self.numel, torch.bfloat16)
                row.zero_()
                for offset, window in windows:
                    first, end = max(offset, start), min(offset + window.numel(), stop)
                    if first >= end:
                        continue
                    part = row[first - start : end - start]
                    param = window[first - offset : end - offset]
                    part.copy_(param)
                    part.add_(compensation[first:end])
                    if settle:
                        settled_master(part, param)

    def _quantised(
        self, packed: torch.Tensor, segment: Segment, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An ``int8`` segment's codes of elements ``[start, stop)`` and their blocks' maxima."""
        codes = packed.view(torch.uint8)[segment.offset + start : segment.offset + stop]
        absmax = self._view(packed, segment.absmax_offset, -(-self.numel // BLOCK), torch.float32)
        return codes, absmax[start // BLOCK : -(-stop // BLOCK)]

    def encode(
        self,
        rows: torch.Tensor,
        packed: torch.Tensor,
        dtypes: Sequence[tuple[int, int, torch.dtype]] = (),
        *,
        span: tuple[int, int] | None = None,
    ) -> None:
        """Pack fp32 ``rows`` into ``packed``.

        Args:
            rows: the fp32 state (``len(kinds) x numel``, or the span's length).
            packed: the packed object (fp32 words), written.
            dtypes: for a compensated master, each low-precision piece's offset, length and
                parameter dtype; the compensation is zero elsewhere.
            span: the elements ``[start, stop)`` of each row only (``start`` a multiple of
                [`BLOCK`][], ``stop`` too or the row's end); all of them if None.
        """
        start, stop = (0, self.numel) if span is None else span
        raw = packed.view(torch.uint8)
        for first, end in self._padding:
            raw[first:end].zero_()
        for segment, row in zip(self.segments, rows.view(len(self.kinds), stop - start), strict=True):
            if segment.format == "fp32":
                self._view(packed, segment.offset, self.numel, torch.float32)[start:stop].copy_(row)
            elif segment.format == "bf16":
                self._view(packed, segment.offset, self.numel, torch.bfloat16)[start:stop].copy_(row)
            elif segment.format == "int8":
                codes, absmax = self._quantised(packed, segment, start, stop)
                quantise_blockwise(row, codes, absmax, segment.kind == "signed")
            else:
                compensation = self._view(packed, segment.offset, self.numel, torch.bfloat16)[start:stop]
                compensation.zero_()
                for offset, length, dtype in dtypes:
                    first, end = max(offset, start) - start, min(offset + length, stop) - start
                    if first < end:
                        compensate(row[first:end], dtype, compensation[first:end])


@functools.lru_cache(maxsize=4096)
def spans(sg: SubGroup, length: int) -> tuple[tuple[int, SubGroup], ...]:
    """The sub-group cut into spans of about ``length`` elements (a multiple of [`BLOCK`][]), to
    be unpacked, updated and packed one at a time while they are in the CPU's cache: each span's
    start and its part of the sub-group (its pieces, cut and counted from the span's start).

    A span starts at a multiple of [`BLOCK`][] (its blocks are the sub-group's) and cuts a piece
    only at a multiple of ``KERNEL_ALIGNMENT`` from its parameter's start (the update gives each
    element the bits it gets over the whole sub-group); where no such cut lies near ``length``, a
    span is longer.
    """
    cuts = [0]
    for piece in sg.pieces:
        end = piece.offset + piece.length
        aligned = (piece.param_offset - piece.offset) % KERNEL_ALIGNMENT == 0
        first = -(-piece.offset // BLOCK) * BLOCK  # the piece's first multiple of BLOCK
        while end - cuts[-1] > length and first < end:
            cut = max(first, (cuts[-1] + length) // BLOCK * BLOCK) if aligned else piece.offset
            if cut <= cuts[-1] or (cut != first and not aligned):
                break
            cuts.append(cut)
    parts = []
    for start, stop in zip(cuts, [*cuts[1:], sg.numel], strict=True):
        pieces = tuple(
            Piece(
                piece.param,
                piece.param_offset + max(start - piece.offset, 0),
                max(piece.offset - start, 0),
                min(piece.offset + piece.length, stop) - max(piece.offset, start),
            )
            for piece in sg.pieces
            if piece.offset < stop and piece.offset + piece.length > start
        )
        parts.append((start, SubGroup(sg.index, sg.group, stop - start, pieces)))
    return tuple(parts)


def bytes_per_element(kinds: Sequence[RowKind], precision: StatePrecision) -> float:
    """Bytes stored per parameter element for rows ``kinds`` (block maxima included, alignment
    padding of a sub-group excluded)."""
    total = 0.0
    for kind in kinds:
        fmt = precision.master if kind == "master" else precision.moments
        total += _WIDTHS[fmt] + (4 / BLOCK if fmt == "int8" else 0)
    return total


def fp32_state_dict(state_dict: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """A compressed offloaded optimizer's state dict in torch's fp32 format, which
    ``torch.optim.AdamW`` (and an offloaded AdamW of any precision) loads: each parameter's moments
    dequantised, and a low-precision parameter's ``master_param`` (its fp32 master weights, or the
    parameter plus its compensation).

    Args:
        state_dict: a ``state_dict()`` with ``packed_state`` (one without is returned as it is).
        params: the optimizer's parameters, in its order (its groups' in turn), holding the
            weights the state belongs to: their shapes place the state, and a compensated master
            is the parameter plus its compensation.

    Returns:
        A new state dict without ``packed_state``; its groups and counts are the given dict's.
    """
    packed = state_dict.get("packed_state")
    if packed is None:
        return state_dict
    precision = StatePrecision(**packed["precision"])
    state: dict[Any, dict[str, Any]] = {key: dict(entry) for key, entry in state_dict["state"].items()}
    for saved in packed["subgroups"]:
        names = [name for name, _ in saved["rows"]]
        layout = PackedLayout(tuple(kind for _, kind in saved["rows"]), saved["numel"], precision)
        words = torch.empty(layout.words, dtype=torch.float32)
        words.view(torch.uint8)[: saved["data"].numel()].copy_(saved["data"])
        pieces = [tuple(piece) for piece in saved["pieces"]]
        windows = [
            (offset, params[param].detach().reshape(-1)[start : start + length].cpu())
            for param, start, offset, length in pieces
            if params[param].dtype != torch.float32
        ]
        rows = torch.empty(len(names), layout.numel, dtype=torch.float32)
        layout.decode(words, rows, windows, settle=True)
        for name, row in zip(names, rows, strict=True):
            for param, start, offset, length in pieces:
                if name == "master_param" and params[param].dtype == torch.float32:
                    continue  # its own master
                entry = state.setdefault(param, {})
                whole = entry.setdefault(name, torch.zeros(params[param].shape, dtype=torch.float32))
                whole.view(-1)[start : start + length].copy_(row[offset : offset + length])
    return {**{k: v for k, v in state_dict.items() if k != "packed_state"}, "state": state}
