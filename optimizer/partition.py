"""How ZeRO-3 cuts parameters into sub-groups: pure arithmetic, no tensors.

The parameters of one parameter group are laid end to end in a flat fp32 space, which is cut into
sub-groups of at most ``sub_group_size`` elements; a parameter may straddle two sub-groups. Each
sub-group is the unit of offloading: its fp32 master weights and Adam moments are one object in
the store, read, updated and written back together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    if sub_group_size < 1:
        raise ValueError(f"sub_group_size must be >= 1, got {sub_group_size}")
    subgroups: list[SubGroup] = []
    for group, params in enumerate(groups):
        pieces: list[Piece] = []
        filled = 0
        for param, numel in params:
            done = 0
            while done < numel:
                length = min(numel - done, sub_group_size - filled)
                pieces.append(Piece(param, done, filled, length))
                done += length
                filled += length
                if filled == sub_group_size:
                    subgroups.append(SubGroup(len(subgroups), group, filled, tuple(pieces)))
                    pieces, filled = [], 0
        if pieces:
            subgroups.append(SubGroup(len(subgroups), group, filled, tuple(pieces)))
    return subgroups


def partition_whole(groups: Sequence[Sequence[tuple[int, int]]], sub_group_size: int) -> list[SubGroup]:
    """As :func:`partition`, but a parameter is never cut: it joins the current sub-group while that
    stays within ``sub_group_size``, else starts the next one (alone, if it is larger). For
    optimizers that need whole matrices (APOLLO projects each one)."""
    if sub_group_size < 1:
        raise ValueError(f"sub_group_size must be >= 1, got {sub_group_size}")
    subgroups: list[SubGroup] = []
    for group, params in enumerate(groups):
        pieces: list[Piece] = []
        filled = 0
        for param, numel in params:
            if pieces and filled + numel > sub_group_size:
                subgroups.append(SubGroup(len(subgroups), group, filled, tuple(pieces)))
                pieces, filled = [], 0
            pieces.append(Piece(param, 0, filled, numel))
            filled += numel
        if pieces:
            subgroups.append(SubGroup(len(subgroups), group, filled, tuple(pieces)))
    return subgroups
