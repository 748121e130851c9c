"""How ZeRO-3 cuts parameters into sub-groups: pure arithmetic, no tensors.

The parameters of one parameter group are laid end to end in a flat fp32 space, which is cut into
sub-groups of at most ``sub_group_size`` elements; a parameter may straddle two sub-groups. Each
sub-group is the unit of offloading: its fp32 master weights and Adam moments are one object in
the store, read, updated and written back together.

A parameter is cut only `KERNEL_ALIGNMENT` elements from its start or a multiple of that
(`cut_length`), so a sub-group may hold slightly fewer than ``sub_group_size`` elements.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

KERNEL_ALIGNMENT = 64
"""Elements: where a parameter may be cut, counted from its start. A vectorised element-wise
kernel (torch's fused AdamW) run over a piece then gives each element the vector lane it gets over
the whole parameter, and so the same bits: cut elsewhere, the lanes and the scalar tail shift and
the results can differ in the last bit. A multiple of every CPU's fp32 vector width, unrolled."""


def cut_length(start: int, length: int, room: int, alignment: int) -> int:
    """How many of a parameter's elements from ``start`` go into a piece.

    Args:
        start: the piece's first element, counted from the parameter's start (a multiple of
            ``alignment``).
        length: the parameter's elements from ``start`` on.
        room: the most the piece may hold.
        alignment: the parameter is cut only at multiples of this from its start.

    Returns:
        ``length`` if it fits ``room``, else the most that ends on a multiple of ``alignment``
        (0 if ``room`` holds no such end).
    """
    if length <= room:
        return length
    return max(0, (start + room) // alignment * alignment - start)


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_offset, param_offset + length)`` of parameter ``param`` (an index into
    the optimizer's flat parameter list), at ``offset`` within its sub-group."""

    param: int
    param_offset: int
    offset: int
    length: int


@dataclass(frozen=True)
class SubGroup:
    index: int
    group: int
    """Parameter group (hyper-parameters) the sub-group belongs to."""
    numel: int
    pieces: tuple[Piece, ...]


def partition(groups: Sequence[Sequence[tuple[int, int]]], sub_group_size: int) -> list[SubGroup]:
    """Sub-groups of every parameter group; ``groups`` lists (param index, numel) per group."""
    cut = _Cutter(sub_group_size)
    alignment = KERNEL_ALIGNMENT if sub_group_size >= KERNEL_ALIGNMENT else 1
    for param, numel in cut.walk(groups):
        done = 0
        while done < numel:
            length = cut_length(done, numel - done, cut.room, alignment)
            if length == 0:  # no aligned cut fits the rest of this sub-group
                cut.close()
                continue
            cut.add(param, done, length)
            done += length
            if cut.room == 0:
                cut.close()
    return cut.subgroups


def partition_whole(groups: Sequence[Sequence[tuple[int, int]]], sub_group_size: int) -> list[SubGroup]:
    """As [`partition`][], but a parameter is never cut: it joins the current sub-group while that
    stays within ``sub_group_size``, else starts the next one (alone, if it is larger). For
    optimizers that need whole matrices (APOLLO projects each one)."""
    cut = _Cutter(sub_group_size)
    for param, numel in cut.walk(groups):
        if cut.pieces and numel > cut.room:
            cut.close()
        cut.add(param, 0, numel)
    return cut.subgroups


class _Cutter:
    """The sub-groups cut so far and the one being filled, in one parameter group at a time."""

    def __init__(self, sub_group_size: int) -> None:
        if sub_group_size < 1:
            raise ValueError(f"sub_group_size must be >= 1, got {sub_group_size}")
        self.size = sub_group_size
        self.subgroups: list[SubGroup] = []
        self.group = 0
        self.pieces: list[Piece] = []
        self.filled = 0

    @property
    def room(self) -> int:
        """Elements the current sub-group takes before it is full (negative past a whole
        parameter larger than a sub-group)."""
        return self.size - self.filled

    def add(self, param: int, param_offset: int, length: int) -> None:
        self.pieces.append(Piece(param, param_offset, self.filled, length))
        self.filled += length

    def close(self) -> None:
        """End the current sub-group, if it holds anything."""
        if self.pieces:
            self.subgroups.append(SubGroup(len(self.subgroups), self.group, self.filled, tuple(self.pieces)))
            self.pieces, self.filled = [], 0

    def walk(self, groups: Sequence[Sequence[tuple[int, int]]]) -> Iterator[tuple[int, int]]:
        """Each (param index, numel) of ``groups`` in order, closing the current sub-group where a
        parameter group ends (sub-groups never span two) and after the last."""
        for group, params in enumerate(groups):
            self.close()
            self.group = group
            yield from params
        self.close()
