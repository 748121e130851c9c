"""Compressed optimizer state: the formats a sub-group's state is stored in, and their kernels.

An offloaded AdamW moves its whole state through the store every step: fp32 master weights and two
fp32 moments, 12 bytes per parameter each way (8 for an fp32 parameter, its own master). A
[`StatePrecision`][] stores fewer:

* **moments** (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``): ``"fp32"``; ``"bf16"`` (rounded to
  nearest, 2 bytes); ``"int8"``, 8-bit blockwise quantisation (1 byte, and a 4-byte absmax per
  [`BLOCK`][] elements): each block of a row is divided by its largest magnitude and each value
  rounded to the nearest entry of a dynamic-tree map
  ([`dynamic_map`][tierstore.optimizer.state_kernels.dynamic_map]: a decimal exponent and a linear
  fraction, more fraction steps for larger magnitudes; the signed map for ``exp_avg``, the
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
cache, or, for ``"int8-compensated"`` bf16 parameters under AdamW, a block at a time in one pass
([`adamw_int8_compensated`][tierstore.optimizer.state_kernels.adamw_int8_compensated], the same
bits). The kernels are in [`tierstore.optimizer.state_kernels`][].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ..errors import ConfigError
from .partition import KERNEL_ALIGNMENT, Piece, SubGroup
from .state_kernels import (
    BLOCK,
    compensate,
    compensated_master,
    dequantise_blockwise,
    quantise_blockwise,
    settled_master,
)

COMPENSATION_ENTRY = "master_compensation"
"""A state dict entry of a compensated master's parameter, where the state dict holds each
parameter's state (FSDP): its compensation terms as stored (bf16, the parameter's shape), so that
loading it restores the stored bytes rather than deriving them from ``master_param``."""

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
                overlaps = [
                    (offset, window, max(offset, start), min(offset + window.numel(), stop))
                    for offset, window in windows
                ]
                if sum(max(end - first, 0) for _, _, first, end in overlaps) < length:
                    row.zero_()  # elements outside every window (the windows never overlap)
                for offset, window, first, end in overlaps:
                    if first >= end:
                        continue
                    part = row[first - start : end - start]
                    param = window[first - offset : end - offset]
                    compensated_master(param, compensation[first:end], part)
                    if settle:
                        settled_master(part, param)

    def compensation(self, packed: torch.Tensor) -> torch.Tensor | None:
        """The compensation terms of a ``bf16-compensated`` master in ``packed`` (bf16, a view, one
        per element), or None where the master is not compensated."""
        for segment in self.segments:
            if segment.format == "bf16-compensated":
                return self._view(packed, segment.offset, self.numel, torch.bfloat16)
        return None

    def quantised(self, packed: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An ``int8`` row's codes and block maxima in ``packed`` (views)."""
        return self._quantised(packed, self.segments[row], 0, self.numel)

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
        if stop == self.numel:  # the padding, once per object: with its rows' last span
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
