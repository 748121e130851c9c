"""The optimizer-state swapper DeepSpeed's ZeRO-3 optimizer calls (seam 2), over a TierStore.

DeepSpeed swaps each fp32 sub-group partition in before its update and out after it through an
"optimizer swapper"; `TierStoreSwapper` is that surface, staging the state through a
`SubGroupStager` (read-ahead in the pass order it is told, the end of a pass kept in DRAM,
background write-back) instead of DeepSpeed's aio swap files. It also moves its sub-groups into and
out of a checkpoint (`checkpoints`).

In a compressed ``state_precision`` ([`tierstore.optimizer.state_precision`][]) the store, the
staging ring and the sub-groups kept in DRAM hold each sub-group packed; swap-in unpacks it into
one fp32 buffer, where DeepSpeed's optimizer updates it in place, and swap-out packs it back.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tierstore.optimizer.state_precision import PackedLayout
from tierstore.optimizer.subgroup_stager import FP32, SubGroupStager

from tierstore._directories import missing_directories, remove_empty
from tierstore.buffers import aligned_tensor
from tierstore.errors import BufferMismatchError, CapacityError, ConfigError
from tierstore.store import TierStore

from .checkpoints import (
    ADAM_STATES,
    PACKED_ROWS,
    PARTITION_SUFFIX,
    SavedSubGroup,
    checkpoint_store,
    read_index,
    read_swap_file,
    write_index,
)
from .config import SECTION, TierstoreSection

MAX_STATE_TENSORS = 2  # Adam/AdamW: exp_avg, exp_avg_sq


class TierStoreSwapper:
    """DeepSpeed's optimizer-swapper surface over a TierStore.

    Each fp32 sub-group partition (DeepSpeed's ``fp32_partitioned_groups_flat[i]``, named by its
    ``ds_id``) is one store object laid out ``[master | state tensors...]``. The state tensors are
    whatever the optimizer keeps per element (Adam: ``exp_avg``, ``exp_avg_sq``), discovered when
    it first creates them; between swap-in and swap-out they are views into the staging buffer.

    In a compressed ``state_precision`` the object is the three rows ``[master | exp_avg |
    exp_avg_sq]`` packed ([`PackedLayout`][tierstore.optimizer.state_precision.PackedLayout]), and
    the views are into one fp32 buffer it is unpacked into, so one sub-group is swapped in at a
    time (as DeepSpeed's step, initialisation and checkpoint load swap them); a swap-out packs the
    buffer back. Packing what was unpacked gives the same bytes, so a swap-out without an update
    (DeepSpeed's checkpoint load swaps every sub-group in and out) leaves them as they were.

    ``swap_folder`` (where DeepSpeed's engine copies its swap files in and out of a checkpoint) is
    created here, and ``store_directories`` are those created for the store's tier (from
    `missing_directories`); `close` removes both once the store is closed, as far as they are empty,
    so that a run leaves no empty trees behind.

    Args:
        store: the rank's store of the sub-groups' state.
        section: the DeepSpeed config's ``tierstore`` section: the staging options and the
            ``state_precision``.
        swap_folder: where DeepSpeed's engine copies its swap files in and out of a checkpoint.
        optimizer: DeepSpeed's optimizer, whose ``state`` gets the views.
        largest_numel: elements of the largest sub-group (the staging buffers hold its state).
        namespace: the prefix of the sub-groups' store keys.
        low_precision: the model's low-precision partition of the sub-group whose fp32 partition
            it is given (None where DeepSpeed keeps it on NVMe): what a ``bf16-compensated``
            master is compensated against.
        store_directories: the directories made for the store's tier.
    """

    def __init__(
        self,
        store: TierStore,
        section: TierstoreSection,
        swap_folder: Path,
        optimizer: torch.optim.Optimizer,
        largest_numel: int,
        namespace: str,
        low_precision: Callable[[torch.Tensor], torch.Tensor | None],
        store_directories: Sequence[Path] = (),
    ) -> None:
        self.store = store
        self.optimizer = optimizer
        self.precision = section.state_precision
        """The format the sub-groups are stored in."""
        self._low_precision = low_precision
        self.swap_folder = str(swap_folder)
        made = missing_directories(swap_folder)
        os.makedirs(self.swap_folder, mode=0o700, exist_ok=True)
        unpacked = len(PACKED_ROWS) * largest_numel if self.precision.compressed else 0
        self.stager = SubGroupStager(
            store,
            namespace,
            slot_elements=self._stored_numel(largest_numel, ADAM_STATES),
            dram_budget=None if section.dram_budget is None else int(section.dram_budget),
            prefetch_depth=section.prefetch_depth,
            cache_policy=section.cache_policy,
            reserved_bytes=FP32 * (largest_numel + unpacked),
            owner=type(self).__name__,
        )
        self.gradient = aligned_tensor(largest_numel)
        """The one fp32 gradient buffer sub-groups are converted into during the update."""
        self._rows = torch.empty(unpacked, dtype=torch.float32)
        """The fp32 state a compressed sub-group is unpacked into while it is swapped in (none for
        fp32 state, which is updated in its staging buffer); counted in ``dram_budget``."""
        self._swapped_in: tuple[str, torch.Tensor] | None = None
        """The compressed sub-group unpacked into `_rows`, and its packed object in DRAM."""
        self._parameters: dict[str, torch.Tensor] = {}
        self._numels: dict[str, int] = {}
        self._state_names: dict[str, tuple[str, ...]] = {}
        self._closer = weakref.finalize(self, _close, store, [made, list(store_directories)])

    # -- DeepSpeed's swapper surface ------------------------------------------------------------
    def is_swappable_tensor(self, tensor: torch.Tensor | None = None, numel: int | None = None) -> bool:
        """Every sub-group goes through the store, so every one takes the low-precision path."""
        return True

    def initialize_parameters(
        self, parameters: Sequence[torch.Tensor], src_tensors: Sequence[torch.Tensor]
    ) -> None:
        for parameter, source in zip(parameters, src_tensors, strict=True):
            name = self._register(parameter, source.numel())
            if self.precision.compressed:
                rows = self._unpacked_rows(source.numel())
                rows[: source.numel()].copy_(source.reshape(-1))
                rows[source.numel() :].zero_()
                self._write_packed(name, rows)
            else:
                self.stager.write(name, source.numel(), functools.partial(_copy_flat, source))
        self.stager.wait_writes()

    def initialize_from_swapped_fp16_params(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            "zero_optimization.offload_optimizer.fast_init: not supported with tierstore when parameters "
            "are offloaded to NVMe; set it to false"
        )

    def swap_in_optimizer_state(
        self, parameter: torch.Tensor, async_parameter: torch.Tensor | None = None
    ) -> None:
        """Point the master weights and the optimizer's state tensors into the staged buffer
        (read-ahead follows the pass order given to `begin_pass`, not ``async_parameter``)."""
        name = self._name(parameter)
        numel = self._numels[name]
        names = self._state_names[name]
        state = self._unpacked(name, self.stager.acquire(name, self._stored_numel(numel, names)))
        parameter.data = state[:numel]
        entry = self.optimizer.state[parameter]
        for slot, key in enumerate(names, start=1):
            view = state[slot * numel : (slot + 1) * numel]
            if torch.is_tensor(entry.get(key)):
                entry[key].data = view
            else:
                entry[key] = view

    def create_adam_state(self, parameter: torch.Tensor) -> None:
        """Before a sub-group's first update: its Adam moments, zeros in the staging buffer beside
        its master weights, and its step count at 0, as ``DeepSpeedCPUAdam`` initialises them;
        it then uses these instead of allocating two more tensors of the sub-group's size."""
        entry = self.optimizer.state[parameter]
        name = self._name(parameter)
        if entry or self._state_names[name]:
            return
        numel = self._numels[name]
        state = self._held_state(name, 3 * numel)
        state[numel:].zero_()
        parameter.data = state[:numel]
        entry["step"] = 0
        entry["exp_avg"], entry["exp_avg_sq"] = state[numel : 2 * numel], state[2 * numel :]
        self._state_names[name] = ADAM_STATES

    def swap_out_optimizer_state(self, parameter: torch.Tensor, async_swap: bool = False) -> None:
        """Lay the state tensors out in the buffer (copying any the optimizer created anew), then
        keep the sub-group in DRAM or write it back, as the stager's plan says."""
        name = self._name(parameter)
        numel = self._numels[name]
        tensors = [
            (key, value)
            for key, value in self.optimizer.state.get(parameter, {}).items()
            if torch.is_tensor(value) and value.shape == (numel,)
        ]
        if len(tensors) > MAX_STATE_TENSORS:
            raise CapacityError(
                f"the optimizer keeps {len(tensors)} state tensors per element; tierstore stages at most "
                f"{MAX_STATE_TENSORS} (Adam/AdamW)"
            )
        self._check_packable(tuple(key for key, _ in tensors), f"sub-group {name}")
        state = self._held_state(name, (1 + len(tensors)) * numel)
        targets = [state[slot * numel : (slot + 1) * numel] for slot in range(1, len(tensors) + 1)]
        sources = [
            value if value.data_ptr() == target.data_ptr() else value.clone()
            for (_, value), target in zip(tensors, targets, strict=True)
        ]
        for source, target in zip(sources, targets, strict=True):
            if source.data_ptr() != target.data_ptr():
                target.copy_(source)
        for _, value in tensors:
            value.data = torch.empty(0, dtype=value.dtype)
        parameter.data = torch.empty(0, dtype=parameter.dtype)
        self._state_names[name] = tuple(key for key, _ in tensors)
        self._pack(name)
        self.stager.release(name)

    def release_swap_buffers(self, parameter: torch.Tensor) -> None:
        """DeepSpeed releases without writing when it did not change the state; the staged copy
        may still be the only current one (kept in DRAM), so it is released the normal way."""
        self.swap_out_optimizer_state(parameter)

    def writeback_optimizer_state_and_gradients(
        self, parameter: torch.Tensor, write_opt_state: bool, write_gradients: bool
    ) -> None:
        self.swap_out_optimizer_state(parameter)

    def swap_out_gradients(
        self, parameter: torch.Tensor, gradient_offsets: Any, gradient_tensors: Any
    ) -> None:
        raise RuntimeError("tierstore keeps gradients in low precision in memory; none is ever swapped out")

    def purge_state(self) -> None:
        """DeepSpeed replaced the optimizer's state tensors (a state-dict load): stage the masters
        only, and lay the new tensors out at the next swap-out."""
        self._state_names = dict.fromkeys(self._state_names, ())

    def init_timers(self) -> None:
        """Timing lives in the store's telemetry (``store.stats()``)."""

    def log_timers(self) -> None:
        """Timing lives in the store's telemetry (``store.log_stats()``)."""

    def pre_backward(self) -> None:
        """Nothing to prepare: gradients never go through the store."""

    def post_backward(self) -> None:
        """Nothing to finish: gradients never go through the store."""

    # -- tierstore's additions ------------------------------------------------------------------
    def begin_pass(self, parameters: Sequence[torch.Tensor]) -> None:
        """A step will visit these sub-groups in this order."""
        names = [self._name(p) for p in parameters]
        self.stager.begin_pass(
            names, {n: self._stored_numel(self._numels[n], self._state_names[n]) for n in names}
        )

    def end_pass(self) -> None:
        self.stager.end_pass()

    def export_checkpoint(self, folder: Path, extra: dict[str, Any]) -> None:
        """Copy every sub-group's state into the checkpoint's store in ``folder``
        (`checkpoint_store`; hard links where they share a file system), then commit the index with
        the optimizer's per-sub-group scalars (step counts), the ``state_precision`` and ``extra``,
        so an interrupted save leaves no checkpoint that looks whole. A compensated master's
        low-precision partitions are saved beside the state (``<sub-group>.low-precision``): the
        master is each partition plus its stored compensation."""
        self.stager.flush()  # the sub-groups kept in DRAM: their current state to the store
        with checkpoint_store(folder) as saved:
            self.store.copy_to(saved, [self.stager.key(name) for name in self._parameters])
            writes = [
                saved.put(self._partition_key(name), window, cache=False)
                for name in self._parameters
                for _, window in self._compensated_windows(name)
            ]
            for write in writes:
                write.result()
        subgroups = {
            name: SavedSubGroup(
                self._numels[name], self._state_names[name], self.optimizer.state.get(parameter, {})
            )
            for name, parameter in self._parameters.items()
        }
        write_index(folder, subgroups, extra, self.precision)

    def restore_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Copy the sub-groups' state back from the checkpoint's store in ``folder`` into this
        store (hard links where they share a file system) and their scalars into the optimizer;
        returns the index's ``extra``. The stored bytes come back as they were saved, and a
        compensated master's low-precision partitions into the model's. The model's sub-groups
        must match the saved ones (same model, sub_group_size and world size), and so must the
        ``state_precision``; a checkpoint that does not fit changes nothing."""
        subgroups, extra, precision = read_index(folder)
        if {name: saved.numel for name, saved in subgroups.items()} != self._numels:
            raise BufferMismatchError(
                f"{folder}: the checkpoint's sub-groups differ from this model's (model, sub_group_size "
                "and world size must match the run that saved it)"
            )
        if precision != self.precision:
            raise BufferMismatchError(
                f"{folder}: the optimizer state is stored in state_precision {precision.name!r}, this "
                f"engine's in {self.precision.name!r}: load it with {SECTION}.state_precision "
                f"{precision.name!r}"
            )
        for name, saved in subgroups.items():
            if len(saved.states) > MAX_STATE_TENSORS:
                raise BufferMismatchError(
                    f"{folder}: sub-group {name} keeps {len(saved.states)} state tensors"
                )
            self._check_packable(saved.states, f"{folder}: sub-group {name}", BufferMismatchError)
        with checkpoint_store(folder) as checkpoint:
            partitions = [
                (self._partition_key(name), window)
                for name in subgroups
                for _, window in self._compensated_windows(name)
            ]
            for key, window in partitions:
                _check_saved_partition(checkpoint, key, window, folder)
            self.stager.drop_resident()
            checkpoint.copy_to(self.store, [self.stager.key(name) for name in subgroups])
            for key, window in partitions:
                checkpoint.get(key, out=window, cache=False).result()
        for name, saved in subgroups.items():
            self.stager.restored(name, self._stored_numel(saved.numel, saved.states))
            self._set_state(name, saved.states, dict(saved.scalars))
        return extra

    def import_deepspeed_state(
        self,
        parameters: Sequence[torch.Tensor],
        masters: Sequence[torch.Tensor],
        saved: Sequence[dict[str, Any]],
    ) -> None:
        """Take the sub-groups' state from a checkpoint of DeepSpeed's own NVMe offload: per
        sub-group (``parameters``, the live fp32 partitions), the master and optimizer state it kept
        in its ZeRO checkpoint (``masters``, ``saved``), and for what it had swapped (empty there)
        its files, which the engine copied into ``swap_folder``. A compressed ``state_precision``
        packs it as it is written (and gives a compensated master's low-precision partition the
        master rounded, which the compensation is what rounding left of)."""
        self.stager.drop_resident()
        for parameter, master, entry in zip(parameters, masters, saved, strict=True):
            name = self._name(parameter)
            numel = self._numels[name]
            states = tuple(key for key, value in entry.items() if torch.is_tensor(value) and value.dim() == 1)
            if len(states) > MAX_STATE_TENSORS:
                raise BufferMismatchError(f"sub-group {name}: {len(states)} optimizer state tensors")
            self._check_packable(states, f"sub-group {name}", BufferMismatchError)
            if self.precision.compressed:
                state = self._unpacked_rows(numel)
                state[numel:].zero_()  # the moments of a sub-group not yet updated
            else:
                state = torch.empty((1 + len(states)) * numel, dtype=torch.float32)
            sources = [
                (f"{name}.tensor.swp", master),
                *((f"{k}-{name}.tensor.swp", entry[k]) for k in states),
            ]
            for slot, (file, value) in enumerate(sources):
                target = state[slot * numel : (slot + 1) * numel]
                if value.numel() == numel:
                    target.copy_(value)
                else:  # DeepSpeed had swapped it: its file holds it (padded to its alignment)
                    read_swap_file(os.path.join(self.swap_folder, file), target)
            self._restore(name, state, states, {k: v for k, v in entry.items() if k not in states})
        self.stager.wait_writes()

    def clear_imported(self) -> None:
        """Remove the DeepSpeed swap files an import read from ``swap_folder``."""
        for entry in os.scandir(self.swap_folder):
            if entry.name.endswith(".tensor.swp"):
                os.unlink(entry.path)

    def close(self) -> None:
        """Close the store (its objects are scratch: a checkpoint's store is the durable copy), and
        remove the directories made for it and for ``swap_folder`` that it leaves empty."""
        self._closer()

    # -- internals ------------------------------------------------------------------------------
    @staticmethod
    def _name(parameter: torch.Tensor) -> str:
        return str(parameter.ds_id)  # type: ignore[attr-defined]

    def _restore(
        self, name: str, state: torch.Tensor, states: tuple[str, ...], scalars: dict[str, Any]
    ) -> None:
        """Write a sub-group's ``[master | states...]`` to the store (packed in a compressed
        ``state_precision``), and `_set_state`."""
        if self.precision.compressed:
            master = state[: self._numels[name]]
            for _, window in self._compensated_windows(name):
                window.copy_(master)  # rounded to nearest, as DeepSpeed copies its masters
            self._write_packed(name, state)
        else:
            self.stager.write(name, state.numel(), lambda buffer: buffer.copy_(state))
        self._set_state(name, states, scalars)

    # -- compressed state -----------------------------------------------------------------------
    def _layout(self, numel: int) -> PackedLayout:
        """A compressed sub-group of ``numel`` elements as stored."""
        return PackedLayout(PACKED_ROWS, numel, self.precision)

    def _stored_numel(self, numel: int, states: tuple[str, ...]) -> int:
        """fp32 words of a sub-group's store object: ``[master | states...]`` in fp32, or all three
        rows packed in a compressed ``state_precision``."""
        if self.precision.compressed:
            return self._layout(numel).words
        return (1 + len(states)) * numel

    def _check_packable(
        self, states: tuple[str, ...], where: str, error: type[Exception] = ConfigError
    ) -> None:
        """Refuse (``error``) state tensors other than `ADAM_STATES` in a compressed precision."""
        if self.precision.compressed and states not in ((), ADAM_STATES):
            raise error(
                f"{where}: {SECTION}.state_precision {self.precision.name!r} stores Adam's "
                f"{' and '.join(ADAM_STATES)}, not the state tensors {list(states)}"
            )

    def _unpacked_rows(self, numel: int) -> torch.Tensor:
        """`_rows` for a sub-group of ``numel`` elements, while no sub-group is swapped in."""
        if self._swapped_in is not None:
            raise CapacityError(
                f"sub-group {self._swapped_in[0]} is swapped in: a compressed state_precision unpacks "
                "one sub-group at a time"
            )
        return self._rows[: len(PACKED_ROWS) * numel]

    def _unpacked(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """The fp32 state of a sub-group just acquired: ``stored`` itself, or unpacked into `_rows`.

        A compensated master is handed to DeepSpeed settled: moved one fp32 step towards the
        partition where ``partition + compensation`` lies exactly half-way to the partition's
        neighbour. DeepSpeed copies the fp32 partition into the low-precision one (rounding to
        nearest) before every swap-out, whether its optimizer stepped the sub-group or not (its
        checkpoint load swaps every sub-group in and out); from a settled master that copy gives
        the partition its own value back, so the stored compensation stays the one of the
        partition's rounding."""
        if not self.precision.compressed:
            return stored
        rows = self._unpacked_rows(self._numels[name])
        self._layout(self._numels[name]).decode(stored, rows, self._compensated_windows(name), settle=True)
        self._swapped_in = (name, stored)
        return rows

    def _held_state(self, name: str, elements: int) -> torch.Tensor:
        """The fp32 state of the sub-group swapped in, ``elements`` values of it: its staging
        buffer grown or shrunk to them, or the unpacked rows (all three, whatever it holds)."""
        if not self.precision.compressed:
            return self.stager.resize(name, elements)
        return self._rows[:elements]

    def _pack(self, name: str) -> None:
        """At a compressed sub-group's swap-out, after DeepSpeed has copied its fp32 master into
        the low-precision partition (stage3's ``_reassign_or_swap_out_partitioned_parameters``
        runs before ``_release_sub_group``): pack the rows into its object, the compensation being
        what rounding to nearest, as that copy rounds, left of the master."""
        if self._swapped_in is None or self._swapped_in[0] != name:
            return
        _, stored = self._swapped_in
        self._swapped_in = None
        rows = self._rows[: len(PACKED_ROWS) * self._numels[name]]
        self._layout(self._numels[name]).encode(rows, stored, self._compensated_dtypes(name))

    def _write_packed(self, name: str, rows: torch.Tensor) -> None:
        """Write a sub-group's fp32 ``[master | exp_avg | exp_avg_sq]`` to the store, packed."""
        layout = self._layout(self._numels[name])
        self.stager.write(
            name, layout.words, functools.partial(layout.encode, rows, dtypes=self._compensated_dtypes(name))
        )

    def _compensated_windows(self, name: str) -> list[tuple[int, torch.Tensor]]:
        """For a ``bf16-compensated`` master, the sub-group's low-precision partition (at offset 0,
        all of it), which the master is compensated against; none otherwise. An fp32 model's
        partition is its own master: its compensation stays zero."""
        if self.precision.master != "bf16-compensated":
            return []
        partition = self._low_precision(self._parameters[name])
        if partition is None:
            raise ConfigError(
                f"{SECTION}.state_precision: a bf16-compensated master needs the model's partition of "
                f"sub-group {name} in memory, which DeepSpeed keeps on NVMe (offload_param)"
            )
        return [(0, partition.view(-1))]

    def _compensated_dtypes(self, name: str) -> list[tuple[int, int, torch.dtype]]:
        """`_compensated_windows` as packing takes them: offset, length and dtype."""
        return [(offset, window.numel(), window.dtype) for offset, window in self._compensated_windows(name)]

    def _partition_key(self, name: str) -> str:
        """The checkpoint store's key of a sub-group's low-precision partition."""
        return self.stager.key(name) + PARTITION_SUFFIX

    def _set_state(self, name: str, states: tuple[str, ...], scalars: dict[str, Any]) -> None:
        """A sub-group's state tensor names and its scalars (Adam's step) into the optimizer's
        state, the tensors to be laid out at the next swap-in."""
        self._state_names[name] = states
        entry = self.optimizer.state[self._parameters[name]]
        for key in states:
            entry.setdefault(key, torch.empty(0))
        entry.update(scalars)

    def _register(self, parameter: torch.Tensor, numel: int) -> str:
        name = self._name(parameter)
        self._parameters[name] = parameter
        self._numels[name] = numel
        self._state_names[name] = ()
        return name


def _copy_flat(source: torch.Tensor, state: torch.Tensor) -> None:
    """Fill a sub-group's master weights from DeepSpeed's partition (any shape)."""
    state.copy_(source.reshape(-1))


def _check_saved_partition(checkpoint: TierStore, key: str, window: torch.Tensor, folder: Path) -> None:
    """A [`BufferMismatchError`][] unless ``checkpoint`` holds ``key`` shaped and typed as
    ``window`` (the model's low-precision partition it is loaded into)."""
    if not checkpoint.contains(key):
        raise BufferMismatchError(f"{folder}: holds no {key!r}, the partition a compensated master needs")
    info = checkpoint.info(key)
    if (info.shape, info.dtype) != (tuple(window.shape), window.dtype):
        raise BufferMismatchError(
            f"{folder}: {key!r} is {info.dtype} {list(info.shape)}, the model's partition "
            f"{window.dtype} {list(window.shape)}"
        )


def _close(store: TierStore, made: list[list[Path]]) -> None:
    """Close ``store``, then remove each list of directories made for this run (deepest first) as
    far as they are empty: the swap folder's first, for the store's may include the ``nvme_path``
    that holds both."""
    store.close()
    for directories in made:
        remove_empty(directories)
