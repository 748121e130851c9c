"""The state of a staged optimizer as torch's optimizers hand it over: state dicts, snapshots and
master weights.

`SavedState` is the base of [`StagedOptimizer`][]: it reads and writes the sub-groups' state objects
in the store for `state_dict`, `load_state_dict`, `master_params` and the HDF5 snapshots, in the
layout the optimizer supplies (`state_numel`, `_fill`, `_master_views`, `_state_entries`), with the
master-weight and layout checks of `tierstore.optimizer.masters`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..buffers import aligned_tensor
from ..errors import BufferMismatchError, ConfigError, StoreClosedError
from ..snapshot import export_hdf5, open_snapshot
from ..store import TierStore
from .gradients import GRADIENT_CHUNK
from .masters import check_layouts, check_own_masters, rounds_from, stale_entries, stale_masters_error
from .partition import Piece, SubGroup
from .state_precision import (
    COMPENSATION_ENTRY,
    FP32_STATE,
    PackedLayout,
    RowKind,
    StatePrecision,
    spans,
    state_precision,
)
from .subgroup_stager import SubGroupStager


class SavedState(torch.optim.Optimizer):
    """The state dicts, snapshots and master weights of an optimizer whose state is staged through a
    store, sub-group by sub-group: what [`StagedOptimizer`][] sets up, and what the optimizer built
    on it lays out."""

    store: TierStore
    """The store holding the state."""
    stager: SubGroupStager
    """The sub-groups' staging through DRAM (and the device on the device path)."""
    params: list[torch.Tensor]
    """The parameters, the groups' in order."""
    subgroups: list[SubGroup]
    """The sub-groups, each one state object in the store."""
    step_count: int
    """Steps taken (overflow-skipped ones excluded)."""
    param_steps: list[int]
    """Per parameter, the steps on which it had a gradient."""
    skipped_steps: int
    """Steps skipped for an overflow."""
    _own_masters: list[bool]
    """Per parameter, whether it is fp32 and so its own master weights (none in the state)."""
    _layouts: list[dict[str, Any]]
    """Per group, the group keys its state is laid out by, as they were when it was added."""
    device: torch.device | None
    """The GPU the parameters are on (the device path), or None for parameters in host memory."""
    precision: StatePrecision = FP32_STATE
    """The format the state is stored in ([`tierstore.optimizer.state_precision`][])."""
    _scratch: torch.Tensor = torch.empty(0)
    """Host memory a compressed sub-group is unpacked into for its update (the largest's fp32
    state), counted as the stager's reserved bytes."""

    COMPRESSED_STATE: ClassVar[str | None] = "its state is not rows of parameter elements"
    """Why this optimizer stores its state in fp32 only (``state_precision`` other than ``"fp32"``
    is refused, saying so), or None where `_row_parts` lays it out for compression."""

    PACKED_STATE_DICT: ClassVar[bool] = True
    """Whether a compressed state's `state_dict` carries the stored bytes (``packed_state``), or,
    False, each parameter's state decoded (moments and ``master_param`` in fp32, and a compensated
    master's stored terms, [`COMPENSATION_ENTRY`][tierstore.optimizer.state_precision.COMPENSATION_ENTRY]):
    entries a checkpoint can shard like the parameters, which encode back to the stored bytes on
    the same sub-groups."""

    IMPLEMENTATION_KEYS: ClassVar[tuple[str, ...]] = ()
    """Group keys that name the kernel rather than the training (torch's ``foreach``, ``fused``...):
    a loaded state dict or snapshot describes its saver's kernel with them, so their values are not
    taken from it; each group keeps this optimizer's own."""

    @abstractmethod
    def state_numel(self, sg: SubGroup) -> int:
        """fp32 values of the sub-group's state object (master weights included)."""

    @abstractmethod
    def _fill(self, sg: SubGroup, state: torch.Tensor, *, saved: dict[Any, Any] | None) -> None:
        """Lay out a sub-group's state from ``saved`` (a state dict's per-parameter entries) or
        fresh (master weights = the parameters, everything else zero)."""

    @abstractmethod
    def _master_views(self, sg: SubGroup, state: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """The master weights of each piece: views into ``state``, or into the parameter itself
        (`_window`) for a parameter that is its own master."""

    @abstractmethod
    def _state_entries(self) -> list[dict[str, Any]]:
        """Per parameter, its state as a state dict holds it (``step`` aside), read from DRAM or
        the store."""

    @abstractmethod
    def _check_entries(self, entries: list[dict[str, Any] | None]) -> None:
        """Refuse a state dict's per-parameter entries (None: the parameter has none) that do not
        fit this optimizer's parameters (their shapes), with a [`BufferMismatchError`][], before
        anything is restored."""

    def _restore_entries(self, entries: list[dict[str, Any] | None]) -> None:
        """Take back what a state dict's entries hold beside the state objects and step counts."""

    def _row_parts(self, sg: SubGroup) -> tuple[tuple[str, RowKind], ...]:
        """The rows of the sub-group's fp32 state, each ``sg.numel`` values, in order: their names
        in a state dict and what they hold (for optimizers whose `COMPRESSED_STATE` is None)."""
        raise NotImplementedError(f"{type(self).__name__} stores its state in fp32 only")

    # -- public -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, in ``torch.optim``'s format.

        Sub-groups kept in DRAM are written to the store first, so the store holds the same state
        as the dict.

        Returns:
            ``state``: per parameter index its ``step`` (its own count) and its state as whole fp32
            tensors of its shape (``master_param`` only for a low-precision parameter: an fp32 one
            is its own master); ``param_groups``: the groups' hyper-parameters with their
            parameters' indices; ``step_count`` and ``skipped_steps``: the optimizer's counts. In a
            compressed `precision`, ``state`` holds the steps only and ``packed_state`` the stored
            bytes ([`fp32_state_dict`][tierstore.optimizer.state_precision.fp32_state_dict] makes
            torch's format of it), unless `PACKED_STATE_DICT` is False.

        Raises:
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        self.stager.flush()
        if self.precision.compressed and self.PACKED_STATE_DICT:
            return {
                "state": {
                    i: {"step": torch.tensor(float(steps))} for i, steps in enumerate(self.param_steps)
                },
                "param_groups": self._state_dict_groups(),
                "step_count": self.step_count,
                "skipped_steps": self.skipped_steps,
                "packed_state": self._packed_state(),
            }
        entries = self._state_entries()
        return {
            "state": {
                i: {"step": torch.tensor(float(steps)), **entry}
                for i, (steps, entry) in enumerate(zip(self.param_steps, entries, strict=True))
            },
            "param_groups": self._state_dict_groups(),
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict`; the state in the store is rewritten.

        Each parameter's ``step`` is its own count (a parameter without an entry has taken none, as
        in torch); dicts saved before per-parameter counts hold the global count in every entry. The
        model's weights are the parameters' weights: an fp32 parameter is its own master (a
        ``master_param`` in its entry is not used), and a low-precision one takes its entry's
        ``master_param`` only if the parameter rounds from it (else a `StaleMasterWeightsError`),
        or, without one, its own weights as master weights. So load the model's weights first, as
        for torch's optimizers. The groups take the dict's hyper-parameters, except the
        `IMPLEMENTATION_KEYS`.

        Args:
            state_dict: a state dict of an optimizer with the same parameters and state layout
                (this optimizer's, or torch's AdamW's).

        A compressed state dict (``packed_state``) is loaded as saved, byte for byte, into an
        optimizer of its `precision` and sub-groups; an fp32 one (torch's format) into a compressed
        optimizer is compressed as it is written.

        Raises:
            BufferMismatchError: the dict's groups, parameters or state shapes do not match this
                optimizer's, a group's `LAYOUT_KEYS` differ, or its ``packed_state`` is of another
                precision or sub-groups; nothing is restored.
            StaleMasterWeightsError: a low-precision parameter does not round from its entry's
                ``master_param``; nothing is restored.
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        state = state_dict["state"]
        entries = [state.get(i, state.get(str(i))) for i in range(len(self.params))]
        self._check_groups(state_dict["param_groups"])
        packed = state_dict.get("packed_state")
        if packed is not None:
            self._check_packed(packed)
        else:
            self._check_entries(entries)
            self._check_masters(entries)
        self._take_groups(state_dict["param_groups"])
        self.param_steps = [0 if entry is None else int(entry.get("step", 0)) for entry in entries]
        self._restore_entries(entries)
        self.step_count = int(state_dict.get("step_count", max(self.param_steps, default=0)))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.stager.drop_resident()
        if packed is None:
            self._write_all(state)
            return
        for sg, saved in zip(self.subgroups, packed["subgroups"], strict=True):
            self.stager.write(sg.index, self._stored_numel(sg), functools.partial(_copy_bytes, saved["data"]))
        self.stager.wait_writes()

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master weights.

        Returns:
            One fp32 tensor per parameter, of its shape (read from DRAM or the store; a copy of
            the parameter for an fp32 one, its own master).

        Raises:
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        masters = [torch.empty(self._local(p).shape, dtype=torch.float32) for p in self.params]
        for sg in self.subgroups:
            for piece, values in self._master_views(sg, self._read_rows(sg)):
                masters[piece.param].view(-1)[piece.param_offset : piece.param_offset + piece.length].copy_(
                    values
                )
        return masters

    def save_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Checkpoint the fp32 state (sub-groups kept in DRAM included) and step counts into one
        portable HDF5 file ([`tierstore.export_hdf5`][]), without gathering it in memory.

        Args:
            path: the HDF5 file to write.

        Raises:
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        self.stager.flush()
        metadata = {
            "step_count": self.step_count,
            "param_steps": self.param_steps,
            "skipped_steps": self.skipped_steps,
            "subgroups": [sg.numel for sg in self.subgroups],
            "own_masters": self._own_masters,
            "param_groups": self._saved_groups(),
            "state_precision": dataclasses.asdict(self.precision),
            **self._snapshot_metadata(),
        }
        export_hdf5(self.store, path, [self.stager.key(sg.index) for sg in self.subgroups], metadata)

    def load_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Restore a `save_snapshot`, and copy the restored master weights of low-precision
        parameters into the model. An fp32 parameter is its own master: the snapshot holds none of
        its weights, which are the model's to restore (``model.load_state_dict``).

        A snapshot from before per-parameter step counts gives every parameter the global count.

        Args:
            path: an HDF5 file written by `save_snapshot` of an optimizer with the same parameters
                (of the same dtypes), ``sub_group_size`` and namespace.

        Raises:
            BufferMismatchError: the snapshot's sub-groups, layout (fp32 master weights held for
                parameters that are fp32 here, or none for ones that are not), step counts or keys
                do not match this optimizer's; nothing is restored.
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        with open_snapshot(path) as snapshot:
            metadata = snapshot.metadata
            if metadata.get("subgroups") != [sg.numel for sg in self.subgroups]:
                raise BufferMismatchError(f"{path}: its sub-groups differ from this optimizer's")
            self._check_precision_of(metadata.get("state_precision", {}), str(path))
            # A snapshot without the entry holds master weights for every parameter.
            check_own_masters(
                metadata.get("own_masters", [False] * len(self.params)), self._own_masters, path
            )
            check_layouts(
                metadata["param_groups"], self._layouts, f"{path}: param_groups", BufferMismatchError
            )
            step_count = int(metadata["step_count"])
            param_steps = [int(n) for n in metadata.get("param_steps", [step_count] * len(self.params))]
            if len(param_steps) != len(self.params):
                raise BufferMismatchError(
                    f"{path}: it counts steps for {len(param_steps)} parameters, this optimizer has "
                    f"{len(self.params)}"
                )
            mine = {self.stager.key(sg.index) for sg in self.subgroups}
            foreign = sorted(set(snapshot.keys()) - mine)
            if foreign:  # keys another workload on the store may own
                raise BufferMismatchError(
                    f"{path}: holds {foreign[0]!r}, not a key of this optimizer's namespace "
                    f"{self.stager.namespace!r}: load a snapshot into an optimizer of the namespace that "
                    "saved it"
                )
            self.stager.drop_resident()
            for key, tensor in snapshot.items():
                self.store.put(key, tensor).result()
        self._take_groups(
            [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in metadata["param_groups"]]
        )
        self.step_count = step_count
        self.param_steps = param_steps
        self.skipped_steps = int(metadata["skipped_steps"])
        self._restore_snapshot_metadata(path, metadata)
        for sg in self.subgroups:  # the model follows the restored master weights
            for piece, values in self._master_views(sg, self._read_rows(sg)):
                if not self._own_masters[piece.param]:
                    self._copy_to_model(piece, values)

    # -- for the optimizers -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.stager.closed:
            raise StoreClosedError(f"this {type(self).__name__} is closed")

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a parameter (or of a tensor shaped like one) the optimizer steps: the whole
        tensor here."""
        return tensor

    def _window(self, piece: Piece) -> torch.Tensor:
        """The piece's elements of its parameter, flat (a view: writes update the model)."""
        flat = self._local(self.params[piece.param].data).view(-1)
        return flat[piece.param_offset : piece.param_offset + piece.length]

    def _copy_to_model(self, piece: Piece, master: torch.Tensor) -> None:
        """A piece's new master weights into the model's (low-precision) parameter."""
        self._window(piece).copy_(master)

    def _write_all(self, saved: dict[Any, Any] | None, subgroups: list[SubGroup] | None = None) -> None:
        """Write the state of ``subgroups`` (default: every sub-group), from ``saved`` or fresh, to
        the store, in `precision`."""
        for sg in self.subgroups if subgroups is None else subgroups:
            self.stager.write(
                sg.index, self._stored_numel(sg), functools.partial(self._write_saved, sg, saved=saved)
            )
        self.stager.wait_writes()

    def _write_saved(self, sg: SubGroup, stored: torch.Tensor, *, saved: dict[Any, Any] | None) -> None:
        """Lay out the sub-group's state object from ``saved`` or fresh (`_fill`), in `precision`:
        with the compensation terms ``saved`` holds ([`COMPENSATION_ENTRY`][tierstore.optimizer.
        state_precision.COMPENSATION_ENTRY]) as they are, rather than derived from its master
        weights (fp32 cannot hold every parameter-plus-compensation sum)."""
        self._in_precision(sg, stored, functools.partial(self._fill, saved=saved), unpack=False)
        compensation = self._packed_layout(sg).compensation(stored) if self.precision.compressed else None
        if compensation is None or saved is None:
            return
        for piece in sg.pieces:
            entry = saved.get(piece.param, saved.get(str(piece.param)))
            if entry is not None and COMPENSATION_ENTRY in entry and not self._own_masters[piece.param]:
                terms = self._local(entry[COMPENSATION_ENTRY]).detach().reshape(-1)
                compensation[piece.offset : piece.offset + piece.length].copy_(
                    terms[piece.param_offset : piece.param_offset + piece.length]
                )

    def _compensations(self, sg: SubGroup, stored: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """Each low-precision piece's compensation terms in ``stored`` (the sub-group's stored
        object; bf16, host memory) in a compensated `precision`; none otherwise."""
        if not self.precision.compressed:
            return []
        compensation = self._packed_layout(sg).compensation(stored)
        if compensation is None:
            return []
        return [
            (piece, compensation[piece.offset : piece.offset + piece.length].cpu())
            for piece in sg.pieces
            if not self._own_masters[piece.param]
        ]

    # -- the stored format --------------------------------------------------------------------------

    def _set_precision(self, value: object) -> None:
        """Take ``value`` (``state_precision``) as `precision`, before anything is staged.

        Raises:
            ConfigError: not a format, or a compressed one for an optimizer that stores fp32 only.
        """
        self.precision = state_precision(value)
        if self.precision.compressed and self.COMPRESSED_STATE is not None:
            raise ConfigError(
                f"state_precision: {type(self).__name__} stores its state in fp32 only "
                f"({self.COMPRESSED_STATE}); use 'fp32'"
            )

    def _packed_layout(self, sg: SubGroup) -> PackedLayout:
        """The sub-group's packed layout in `precision`."""
        return PackedLayout(tuple(kind for _, kind in self._row_parts(sg)), sg.numel, self.precision)

    def _stored_numel(self, sg: SubGroup) -> int:
        """fp32 words of the sub-group's stored object: its state in `precision`."""
        return self._packed_layout(sg).words if self.precision.compressed else self.state_numel(sg)

    def _scratch_numel(self, subgroups: list[SubGroup], *, whole: bool = False) -> int:
        """fp32 values of the buffer a compressed sub-group of ``subgroups`` is unpacked into (0
        for fp32 state, updated where it is staged): a span of it at a time on the CPU path
        ([`spans`][tierstore.optimizer.state_precision.spans]), all of it with ``whole`` (the
        device path's)."""
        if not self.precision.compressed:
            return 0
        if whole:
            return max((self.state_numel(sg) for sg in subgroups), default=0)
        return max(
            (
                self.state_numel(sg) // sg.numel * part.numel
                for sg in subgroups
                for _, part in spans(sg, GRADIENT_CHUNK)
            ),
            default=0,
        )

    def _in_precision(
        self,
        sg: SubGroup,
        stored: torch.Tensor,
        work: Callable[..., object],
        *args: Any,
        unpack: bool = True,
    ) -> None:
        """Run ``work(sg, state, *args)`` on the sub-group's fp32 state: ``stored`` itself in fp32,
        else unpacked into a buffer on its device (not unpacked for ``work`` that writes all of
        it: ``unpack`` False) and packed back into ``stored`` afterwards; on the CPU path a span
        at a time ([`spans`][tierstore.optimizer.state_precision.spans]: ``work`` runs on each
        span's part of the sub-group), whose fp32 state stays in the CPU's cache."""
        if not self.precision.compressed:
            work(sg, stored, *args)
            return
        rows_per_element = self.state_numel(sg) // sg.numel
        if stored.device.type == "cpu" and self.device is None:
            parts = spans(sg, GRADIENT_CHUNK)
            numel = max(rows_per_element * part.numel for _, part in parts)
            if self._scratch.numel() < numel:
                self._scratch = aligned_tensor(self._scratch_numel(self.subgroups))
            scratch = self._scratch
        else:  # the device path's: memory of the caller's stream
            parts = ((0, sg),)
            scratch = torch.empty(self.state_numel(sg), dtype=torch.float32, device=stored.device)
        layout = self._packed_layout(sg)
        windows = self._compensated_windows(sg)
        dtypes = [(offset, window.numel(), window.dtype) for offset, window in windows]
        for start, part in parts:
            rows = scratch[: rows_per_element * part.numel]
            span = (start, start + part.numel)
            if unpack:
                layout.decode(stored, rows, windows, span=span)
            work(part, rows, *args)
            layout.encode(rows, stored, dtypes, span=span)

    def _compensated_windows(self, sg: SubGroup) -> list[tuple[int, torch.Tensor]]:
        """The sub-group's low-precision pieces (offset and parameter elements): where a
        compensated master is the parameter plus its compensation."""
        return [
            (piece.offset, self._window(piece)) for piece in sg.pieces if not self._own_masters[piece.param]
        ]

    def _read_rows(self, sg: SubGroup) -> torch.Tensor:
        """The sub-group's fp32 state (read from DRAM or the store; unpacked into new host memory in
        a compressed `precision`)."""
        return self._unpacked(sg, self.stager.read(sg.index))

    def _unpacked(self, sg: SubGroup, stored: torch.Tensor) -> torch.Tensor:
        """The sub-group's fp32 state from its stored object: ``stored`` itself, or unpacked into new
        host memory in a compressed `precision`."""
        if not self.precision.compressed:
            return stored
        rows = torch.empty(self.state_numel(sg), dtype=torch.float32)
        windows = [(offset, window.cpu()) for offset, window in self._compensated_windows(sg)]
        self._packed_layout(sg).decode(stored, rows, windows, settle=True)
        return rows

    def _packed_state(self) -> dict[str, Any]:
        """The stored bytes of every sub-group and what
        [`fp32_state_dict`][tierstore.optimizer.state_precision.fp32_state_dict] needs to unpack
        them: the precision and each sub-group's rows and pieces."""
        subgroups = []
        for sg in self.subgroups:
            stored = self.stager.read(sg.index)[: self._stored_numel(sg)]
            subgroups.append(
                {
                    "numel": sg.numel,
                    "rows": [list(part) for part in self._row_parts(sg)],
                    "pieces": [[p.param, p.param_offset, p.offset, p.length] for p in sg.pieces],
                    "data": stored.view(torch.uint8).cpu().clone(),
                }
            )
        return {"precision": dataclasses.asdict(self.precision), "subgroups": subgroups}

    def _check_precision_of(self, saved: dict[str, Any], source: str) -> None:
        """A [`BufferMismatchError`][] if ``saved`` (a precision as a dict; empty for fp32) is not
        `precision`."""
        theirs = StatePrecision(**saved)
        if theirs != self.precision:
            raise BufferMismatchError(
                f"{source}: the state is stored in state_precision {theirs.name!r}, this optimizer's in "
                f"{self.precision.name!r}: load it into an optimizer of its precision, or convert it to "
                "fp32 first (tierstore.optimizer.state_precision.fp32_state_dict)"
            )

    def _check_packed(self, packed: dict[str, Any]) -> None:
        """Refuse a state dict's ``packed_state`` of another precision or other sub-groups."""
        self._check_precision_of(packed["precision"], "the state dict")
        theirs = [(sg["numel"], [tuple(p) for p in sg["pieces"]]) for sg in packed["subgroups"]]
        mine = [
            (sg.numel, [(p.param, p.param_offset, p.offset, p.length) for p in sg.pieces])
            for sg in self.subgroups
        ]
        if theirs != mine:
            raise BufferMismatchError(
                "the state dict's packed_state is cut into other sub-groups than this optimizer's (another "
                "sub_group_size or other parameters)"
            )

    def _snapshot_metadata(self) -> dict[str, Any]:
        """Optimizer-specific metadata a snapshot carries (JSON-serialisable)."""
        return {}

    def _restore_snapshot_metadata(self, path: str | os.PathLike[str], metadata: dict[str, Any]) -> None:
        """Take back what `_snapshot_metadata` saved."""

    def _saved_groups(self) -> list[dict[str, Any]]:
        """The groups' hyper-parameters (no parameters), as checkpoints carry them."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def _check_groups(self, groups: list[dict[str, Any]]) -> None:
        """Refuse a state dict's groups that do not match this optimizer's (their number, their
        parameters' counts, their `LAYOUT_KEYS`) with a [`BufferMismatchError`][]."""
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups, strict=True)
        ):
            raise BufferMismatchError("the state dict's parameter groups do not match this optimizer's")
        check_layouts(groups, self._layouts, "the state dict's param_groups", BufferMismatchError)

    def _restore_groups(self, groups: list[dict[str, Any]]) -> None:
        """Take back a state dict's groups, which must match this optimizer's."""
        self._check_groups(groups)
        self._take_groups(groups)

    def _take_groups(self, groups: list[dict[str, Any]]) -> None:
        """The groups' hyper-parameters from saved ones (a state dict's or a snapshot's), except
        their ``params`` and `IMPLEMENTATION_KEYS`."""
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update(
                {k: v for k, v in saved.items() if k != "params" and k not in self.IMPLEMENTATION_KEYS}
            )

    def _state_dict_groups(self) -> list[dict[str, Any]]:
        """``torch.optim``'s ``param_groups`` entry: hyper-parameters and parameter indices."""
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
            groups[-1]["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
        return groups

    def _check_masters(self, entries: list[dict[str, Any] | None]) -> None:
        """A `StaleMasterWeightsError` for a low-precision parameter that does not round from its
        entry's ``master_param`` (an fp32 parameter's is not used, so not checked)."""
        masters = [
            None if entry is None or "master_param" not in entry else self._local(entry["master_param"])
            for entry in entries
        ]
        stale = stale_entries([self._local(p) for p in self.params], self._own_masters, masters)
        if stale:
            raise stale_masters_error("the state dict", stale, [tuple(self.params[n].shape) for n in stale])

    def _stale_masters(self) -> list[int]:
        """The low-precision parameters that do not round from their master weights in the state
        (read from DRAM or the store)."""
        stale: set[int] = set()
        for sg in self.subgroups:
            if all(self._own_masters[piece.param] for piece in sg.pieces):
                continue  # no master weights in its state: nothing to read
            for piece, values in self._master_views(sg, self._read_rows(sg)):
                if not self._own_masters[piece.param] and not rounds_from(values, self._window(piece)):
                    stale.add(piece.param)
        return sorted(stale)


def _copy_bytes(data: torch.Tensor, out: torch.Tensor) -> None:
    """``data`` (bytes) into the start of ``out``."""
    out.view(torch.uint8)[: data.numel()].copy_(data)
