"""Every point where tierstore plugs into DeepSpeed ZeRO-3 (0.19.x), in one module.

Nothing here edits DeepSpeed; each seam is an override or a scoped substitution, checked by
:func:`check_seams` before use (a DeepSpeed that renamed one fails with a clear error, not silently):

1. ``engine._configure_zero_optimizer`` imports ``stage3.DeepSpeedZeroOptimizer_Stage3`` when it
   runs: :func:`substituted_optimizer` swaps in :class:`TierStoreZeroOptimizer` for the duration of
   ``deepspeed.initialize`` and restores it after.
2. ``_configure_tensor_swapping``: builds a :class:`TierStoreSwapper` (state in a TierStore through
   a :class:`~tierstore.optimizer.staging.SubGroupStager`) instead of DeepSpeed's aio swappers.
3. ``_offload_grad_partition_at_boundary``: records the gradient norm (and that the parameter's
   sub-group has had a gradient) only. Gradients stay in the low-precision
   ``grad_partitions_flat_buffer``; no fp32 gradient is ever written to storage.
4. ``_optimizer_states_and_gradient_swap_in``: after the state is in, converts the sub-group's
   low-precision gradient slice into one reused fp32 buffer (delayed, in place) as ``.grad``;
   ``unscale_and_clip_grads`` passes over a sub-group left without one (see below).
5. ``step``: visits sub-groups forward, then in reverse on the next step (cache-friendly order),
   and tells the swapper the order so it reads ahead and keeps the end of the pass in DRAM.
6. ``engine.forward``: with ``tierstore.activations`` in the section, :func:`offload_activations`
   wraps the engine's forward (an instance attribute over the method) in an
   :class:`~tierstore.activations.ActivationOffload` on the swapper's store.
7. Checkpoints: ``_rigid_state_dict`` (save) copies every sub-group's state object into a
   persistent store of the checkpoint's own, ``<tag>/tierstore/rank<NN>/`` beside the engine's
   files (:meth:`TierStore.copy_to`: hard links where the store and the checkpoint share a file
   system, so no byte moves and the save takes a few metadata operations), then writes its index
   (Adam step counts, loss scaler), the checkpoint's commit. ``reset_swap_buffers`` (load) copies
   them back the same way, or imports a checkpoint of DeepSpeed's own NVMe offload (its ZeRO
   checkpoint file and the swap files the engine copied into ``swap_folder``), which
   ``checkpoint_event_epilogue`` removes again.
8. ``engine.save_checkpoint``/``load_checkpoint``: :func:`tierstore_checkpoints` wraps them (instance
   attributes) to tell the optimizer the checkpoint's folder, so that stock DeepSpeed refuses a
   tierstore checkpoint loudly instead of silently restarting from fresh optimizer state, and so
   that an import finds DeepSpeed's ZeRO file.

Parameters without a gradient on a step (a module unused on that step), as stock DeepSpeed 0.19.8
ZeRO-3 with its optimizer on NVMe does it (checked by running it; the integration's tests compare):

* Adam's step count (``DeepSpeedCPUAdam``) is kept per optimizer tensor, which in ZeRO-3 is a whole
  sub-group's flat fp32 partition; it advances on every step on which that partition has a
  ``.grad``. So bias correction is per sub-group, not per parameter as in ``torch.optim.AdamW``
  (or :class:`~tierstore.optimizer.OffloadedAdamW`): every sub-group that has had a gradient
  counts every (not overflowed) step. tierstore keeps exactly these counts.
* A missing gradient is not zeros: DeepSpeed never clears ``grad_partitions_flat_buffer`` between
  steps, so the parameter's slot still holds its last gradient, and stock's swapper reads back
  the last gradient file it wrote for it (large, aligned pieces): the stale gradient, unscaled
  and clipped with the current step's coefficient, goes through Adam with weight decay, like the
  rest of the sub-group. tierstore converts the same buffer slot, so it uses that same stale
  gradient. Stock keeps small or misaligned pieces (below the aio block size) in memory instead,
  drops them after each step and then reads whatever its reused swap buffer holds there (zeros
  or another tensor's bytes): that is not reproducible, and tierstore uses the stale gradient
  there too.
* A sub-group none of whose parameters has had a gradient yet has no ``.grad`` in stock, whose
  ``unscale_and_clip_grads`` then fails (``AttributeError``). tierstore leaves such a sub-group
  without ``.grad`` as well, skips its unscaling, and ``DeepSpeedCPUAdam`` passes it over as it
  does any tensor without a gradient: no update, no weight decay, its step count starting with
  its first gradient.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import deepspeed.runtime.zero.stage3 as stage3
import torch
from deepspeed import comm as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from pydantic import ByteSize
from tierstore.activations import ActivationOffload
from tierstore.optimizer.staging import FP32, SubGroupStager

from tierstore.buffers import aligned_tensor
from tierstore.config import CacheConfig, StoreConfig, TierConfig
from tierstore.dtypes import dtype_from_name, dtype_name
from tierstore.errors import BufferMismatchError, CapacityError, ConfigError, UnsupportedVersionError
from tierstore.store import TierStore

from .config import SECTION, ActivationsSection, TierstoreSection, parse_section

_BaseOptimizer: Any = stage3.DeepSpeedZeroOptimizer_Stage3
MAX_STATE_TENSORS = 2  # Adam/AdamW: exp_avg, exp_avg_sq
CHECKPOINT_FORMAT = 3
CHECKPOINT_INDEX = "tierstore-checkpoint.json"
"""A checkpoint's index, written last: its format, each sub-group's size, state tensors and
scalars, and the optimizer's own counters."""
_RELIED_ON = (
    "_configure_tensor_swapping",
    "backward_prologue",
    "_offload_grad_partition_at_boundary",
    "_optimizer_states_and_gradient_swap_in",
    "_rigid_state_dict",
    "reset_swap_buffers",
    "checkpoint_event_epilogue",
    "destroy",
    "_pre_step",
    "_partition_all_parameters",
    "_overflow_check_and_loss_scale_update",
    "_loss_scale_update_and_overflow_cleanup",
    "_prepare_sub_group",
    "unscale_and_clip_grads",
    "_optimizer_step",
    "_reassign_or_swap_out_partitioned_parameters",
    "_release_sub_group",
    "_post_step",
)


_ENGINE_RELIED_ON = ("save_checkpoint", "load_checkpoint", "_get_zero_ckpt_name")


def check_seams() -> None:
    """Fail clearly if this DeepSpeed lacks a method the overrides rely on."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    missing = [name for name in _RELIED_ON if not callable(getattr(_BaseOptimizer, name, None))]
    missing += [name for name in _ENGINE_RELIED_ON if not callable(getattr(DeepSpeedEngine, name, None))]
    if missing:
        raise UnsupportedVersionError(
            "this DeepSpeed's ZeRO-3 optimizer or engine lacks "
            + ", ".join(missing)
            + "; tierstore cannot plug in"
        )


@contextmanager
def substituted_optimizer() -> Iterator[None]:
    """Make the engine build :class:`TierStoreZeroOptimizer` (process-wide, so only while inside)."""
    check_seams()
    stage3.DeepSpeedZeroOptimizer_Stage3 = TierStoreZeroOptimizer
    try:
        yield
    finally:
        stage3.DeepSpeedZeroOptimizer_Stage3 = _BaseOptimizer


def offload_activations(engine: Any, settings: ActivationsSection) -> ActivationOffload:
    """Spill what the engine's forward saves for backward through the optimizer's store (one store,
    one set of tiers and limits for both workloads); ``engine.tierstore_activations`` holds it."""
    store = engine.optimizer.optimizer_swapper.store
    offload = ActivationOffload(
        store, budget=settings.budget, min_bytes=settings.min_bytes, plan=settings.plan
    )
    forward = engine.forward

    @functools.wraps(forward)
    def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
        with offload:
            return forward(*args, **kwargs)

    engine.forward = offloaded_forward
    engine.tierstore_activations = offload
    weakref.finalize(engine, offload.close)
    return offload


_loading_with_tierstore: ContextVar[bool] = ContextVar("tierstore_loading", default=False)


def tierstore_checkpoints(engine: Any) -> None:
    """Seam 8: wrap the engine's ``save_checkpoint`` (instance attributes over the methods, which
    ``Trainer`` reaches through ``model_wrapped``) to put a :class:`TierstoreCheckpointMark` into the
    engine's model-states file, and ``load_checkpoint`` to accept it and to tell the optimizer
    which ZeRO checkpoint file the load reads (the engine skips that file with NVMe offload)."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(
        save_dir: str, tag: Any = None, client_state: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)  # as DeepSpeed names it
        client_state = {**(client_state or {}), CHECKPOINT_MARK: TierstoreCheckpointMark()}
        engine.optimizer.tierstore_checkpoint_dir = checkpoint_folder(save_dir, tag)
        try:
            return save(save_dir, tag, client_state, *args, **kwargs)
        finally:
            engine.optimizer.tierstore_checkpoint_dir = None

    @functools.wraps(load)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        latest = os.path.join(load_dir, "latest")
        if tag is None and os.path.isfile(latest):
            with open(latest) as source:
                tag = source.read().strip()
        if tag is not None:
            engine.optimizer.tierstore_checkpoint_file = engine._get_zero_ckpt_name(load_dir, tag)
            engine.optimizer.tierstore_checkpoint_dir = checkpoint_folder(load_dir, str(tag))
        token = _loading_with_tierstore.set(True)
        try:
            return load(load_dir, tag, *args, **kwargs)
        finally:
            _loading_with_tierstore.reset(token)
            engine.optimizer.tierstore_checkpoint_file = None
            engine.optimizer.tierstore_checkpoint_dir = None

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


CHECKPOINT_MARK = "tierstore"


def checkpoint_folder(directory: str, tag: str) -> Path:
    """Where this rank's optimizer state goes in the engine's checkpoint ``directory``/``tag``."""
    return Path(directory) / tag / "tierstore" / f"rank{dist.get_rank():02d}"


def checkpoint_store(folder: Path) -> TierStore:
    """The persistent store of a checkpoint's optimizer state (objects and manifest in ``folder``)."""
    return TierStore.from_config(
        StoreConfig(
            cache=CacheConfig(budget=ByteSize(0)),
            tiers=[TierConfig(name="checkpoint", backend={"type": "nvme", "path": str(folder / "objects")})],
            manifest=str(folder / "manifest"),
        )
    )


class TierstoreCheckpointMark:
    """Pickled into a tierstore checkpoint's model-states file, which every DeepSpeed load reads:
    unpickling it outside a tierstore load fails, so stock DeepSpeed (whose NVMe-offload load
    would ignore tierstore's state and silently go on from its own fresh swap files) stops."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_check_tierstore_load, (CHECKPOINT_FORMAT,))


def _check_tierstore_load(checkpoint_format: int) -> dict[str, int]:
    if not _loading_with_tierstore.get():
        raise ConfigError(
            f"{SECTION}: this checkpoint's optimizer state was written by tierstore; load it with a "
            f"'{SECTION}' section in the DeepSpeed config and tierstore enabled "
            "(TIERSTORE_DEEPSPEED=1 or tierstore.integrations.deepspeed.enable()): stock DeepSpeed "
            "would restart from its own initial optimizer state"
        )
    return {"checkpoint_format": checkpoint_format}


class TierStoreSwapper:
    """DeepSpeed's optimizer-swapper surface over a TierStore.

    Each fp32 sub-group partition (DeepSpeed's ``fp32_partitioned_groups_flat[i]``, named by its
    ``ds_id``) is one store object laid out ``[master | state tensors...]``. The state tensors are
    whatever the optimizer keeps per element (Adam: ``exp_avg``, ``exp_avg_sq``), discovered when
    it first creates them; between swap-in and swap-out they are views into the staging buffer.
    """

    def __init__(
        self,
        store: TierStore,
        section: TierstoreSection,
        swap_folder: Path,
        optimizer: torch.optim.Optimizer,
        largest_numel: int,
        namespace: str,
    ) -> None:
        self.store = store
        self.optimizer = optimizer
        self.swap_folder = str(swap_folder)
        os.makedirs(self.swap_folder, mode=0o700, exist_ok=True)
        self.stager = SubGroupStager(
            store,
            namespace,
            slot_elements=(1 + MAX_STATE_TENSORS) * largest_numel,
            dram_budget=None if section.dram_budget is None else int(section.dram_budget),
            prefetch_depth=section.prefetch_depth,
            cache_policy=section.cache_policy,
            reserved_bytes=FP32 * largest_numel,
            owner=type(self).__name__,
        )
        self.gradient = aligned_tensor(largest_numel)
        """The one fp32 gradient buffer sub-groups are converted into during the update."""
        self._parameters: dict[str, torch.Tensor] = {}
        self._numels: dict[str, int] = {}
        self._state_names: dict[str, tuple[str, ...]] = {}
        self._closer = weakref.finalize(self, store.close)

    # -- DeepSpeed's swapper surface ------------------------------------------------------------
    def is_swappable_tensor(self, tensor: torch.Tensor | None = None, numel: int | None = None) -> bool:
        """Every sub-group goes through the store, so every one takes the low-precision path."""
        return True

    def initialize_parameters(
        self, parameters: Sequence[torch.Tensor], src_tensors: Sequence[torch.Tensor]
    ) -> None:
        for parameter, source in zip(parameters, src_tensors, strict=True):
            name = self._register(parameter, source.numel())
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
        (read-ahead follows the pass order given to :meth:`begin_pass`, not ``async_parameter``)."""
        name = self._name(parameter)
        numel = self._numels[name]
        names = self._state_names[name]
        state = self.stager.acquire(name, (1 + len(names)) * numel)
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
        state = self.stager.resize(name, 3 * numel)
        state[numel:].zero_()
        parameter.data = state[:numel]
        entry["step"] = 0
        entry["exp_avg"], entry["exp_avg_sq"] = state[numel : 2 * numel], state[2 * numel :]
        self._state_names[name] = ("exp_avg", "exp_avg_sq")

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
        state = self.stager.resize(name, (1 + len(tensors)) * numel)
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
        self.stager.begin_pass(names, {n: (1 + len(self._state_names[n])) * self._numels[n] for n in names})

    def end_pass(self) -> None:
        self.stager.end_pass()

    def export_checkpoint(self, folder: Path, extra: dict[str, Any]) -> None:
        """Copy every sub-group's state into the checkpoint's store in ``folder``
        (:func:`checkpoint_store`; hard links where they share a file system), then write the
        index with the optimizer's per-sub-group scalars (step counts) and ``extra``: the commit,
        so an interrupted save leaves no checkpoint that looks whole."""
        self.stager.flush()  # the sub-groups kept in DRAM: their current state to the store
        with checkpoint_store(folder) as saved:
            self.store.copy_to(saved, [self.stager.key(name) for name in self._parameters])
        subgroups = {
            name: {
                "numel": self._numels[name],
                "states": list(self._state_names[name]),
                "scalars": _encode_scalars(self.optimizer.state.get(parameter, {}), name),
            }
            for name, parameter in self._parameters.items()
        }
        index = folder / CHECKPOINT_INDEX
        temporary = index.with_name(f".{index.name}.tmp")
        temporary.write_text(
            json.dumps({"format": CHECKPOINT_FORMAT, "subgroups": subgroups, "extra": extra})
        )
        os.replace(temporary, index)

    def restore_checkpoint(self, folder: Path) -> dict[str, Any]:
        """Copy the sub-groups' state back from the checkpoint's store in ``folder`` into this
        store (hard links where they share a file system) and their scalars into the optimizer;
        returns the index's ``extra``. The model's sub-groups must match the saved ones (same
        model, sub_group_size and world size)."""
        index = folder / CHECKPOINT_INDEX
        try:
            saved = json.loads(index.read_text())
        except (OSError, ValueError) as error:
            raise BufferMismatchError(
                f"{index}: not a readable tierstore checkpoint index ({error})"
            ) from None
        if saved.get("format") != CHECKPOINT_FORMAT:
            raise BufferMismatchError(f"{index}: format {saved.get('format')!r}, not {CHECKPOINT_FORMAT}")
        subgroups = saved["subgroups"]
        if {name: entry["numel"] for name, entry in subgroups.items()} != self._numels:
            raise BufferMismatchError(
                f"{folder}: the checkpoint's sub-groups differ from this model's (model, sub_group_size "
                "and world size must match the run that saved it)"
            )
        self.stager.drop_resident()
        with checkpoint_store(folder) as checkpoint:
            checkpoint.copy_to(self.store, [self.stager.key(name) for name in subgroups])
        for name, entry in subgroups.items():
            states = tuple(entry["states"])
            if len(states) > MAX_STATE_TENSORS:
                raise BufferMismatchError(f"{folder}: sub-group {name} keeps {len(states)} state tensors")
            self.stager.restored(name, (1 + len(states)) * entry["numel"])
            self._set_state(name, states, _decode_scalars(entry["scalars"], f"{index}: {name}"))
        extra: dict[str, Any] = saved["extra"]
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
        its files, which the engine copied into ``swap_folder``."""
        self.stager.drop_resident()
        for parameter, master, entry in zip(parameters, masters, saved, strict=True):
            name = self._name(parameter)
            numel = self._numels[name]
            states = tuple(key for key, value in entry.items() if torch.is_tensor(value) and value.dim() == 1)
            if len(states) > MAX_STATE_TENSORS:
                raise BufferMismatchError(f"sub-group {name}: {len(states)} optimizer state tensors")
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
                    _read_prefix(os.path.join(self.swap_folder, file), target)
            self._restore(name, state, states, {k: v for k, v in entry.items() if k not in states})
        self.stager.wait_writes()

    def clear_imported(self) -> None:
        """Remove the DeepSpeed swap files an import read from ``swap_folder``."""
        for entry in os.scandir(self.swap_folder):
            if entry.name.endswith(".tensor.swp"):
                os.unlink(entry.path)

    def close(self) -> None:
        """Close the store (its objects are scratch: a checkpoint's store is the durable copy)."""
        self._closer()

    # -- internals ------------------------------------------------------------------------------
    @staticmethod
    def _name(parameter: torch.Tensor) -> str:
        return str(parameter.ds_id)  # type: ignore[attr-defined]

    def _restore(
        self, name: str, state: torch.Tensor, states: tuple[str, ...], scalars: dict[str, Any]
    ) -> None:
        """Write a sub-group's ``[master | states...]`` to the store, and :meth:`_set_state`."""
        self.stager.write(name, state.numel(), lambda buffer: buffer.copy_(state))
        self._set_state(name, states, scalars)

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


def _encode_scalars(entry: dict[str, Any], name: str) -> dict[str, Any]:
    """The optimizer's non-tensor state of a sub-group (Adam: ``step``), JSON-ready."""
    encoded: dict[str, Any] = {}
    for key, value in entry.items():
        if torch.is_tensor(value) and value.dim() == 0:
            encoded[key] = {"tensor": value.item(), "dtype": dtype_name(value.dtype)}
        elif isinstance(value, (bool, int, float)):
            encoded[key] = value
        elif not torch.is_tensor(value):
            raise BufferMismatchError(
                f"sub-group {name}: optimizer state {key!r} ({type(value).__name__}) cannot be saved"
            )
    return encoded


def _decode_scalars(encoded: dict[str, Any], where: str) -> dict[str, Any]:
    return {
        key: torch.tensor(value["tensor"], dtype=dtype_from_name(value["dtype"], f"{where}: {key}"))
        if isinstance(value, dict)
        else value
        for key, value in encoded.items()
    }


def _read_prefix(file: str, target: torch.Tensor) -> None:
    """Fill ``target`` from the start of ``file``, which must hold at least that many bytes."""
    try:
        with open(file, "rb") as source:
            got = source.readinto(target.numpy().data.cast("B"))
    except FileNotFoundError:
        raise BufferMismatchError(f"{file}: missing from the checkpoint's offloaded tensors") from None
    if got != target.numel() * target.element_size():
        raise BufferMismatchError(f"{file}: holds {got} bytes, the sub-group needs {target.nbytes}")


class TierStoreZeroOptimizer(_BaseOptimizer):  # type: ignore[misc]
    """DeepSpeed's ZeRO-3 optimizer with its optimizer-state offload going through tierstore."""

    def __init__(self, *args: Any, ds_config: Any, **kwargs: Any) -> None:
        self.tierstore_section = parse_section(ds_config)
        self._tierstore_ready = False
        self._tierstore_passes = 0
        self._trained_subgroups: set[int] = set()
        """Sub-groups with a parameter that has had a gradient: the others get no ``.grad``."""
        self.tierstore_checkpoint_file: str | None = None
        """While the engine loads a checkpoint: its ZeRO checkpoint file (seam 8)."""
        self.tierstore_checkpoint_dir: Path | None = None
        """While the engine saves or loads a checkpoint: this rank's folder in it (seam 8)."""
        super().__init__(*args, ds_config=ds_config, **kwargs)
        self._grad_offsets = [0, *itertools.accumulate(self.fp16_partitioned_groups_flat_numel)]
        self._tierstore_ready = True

    # seam 2
    def _configure_tensor_swapping(self, offload_optimizer_config: Any, aio_config: Any) -> None:
        rank = dist.get_rank()
        nvme_path = Path(offload_optimizer_config.nvme_path)
        store = TierStore.from_config(self.tierstore_section.store_config(nvme_path, rank))
        self.optimizer_swapper = TierStoreSwapper(
            store,
            self.tierstore_section,
            nvme_path / "zero_stage_3" / "tierstore" / f"rank{rank}",
            self.optimizer,
            largest_numel=max(self.fp16_partitioned_groups_flat_numel),
            namespace=f"rank{rank}",
        )

    # seam 3
    def _offload_grad_partition_at_boundary(
        self, param: Any, grad_buffer: torch.Tensor, offload_fp32_gradients: Any, offload_fp32_offsets: Any
    ) -> None:
        param_id = self.get_param_id(param)
        self.norm_for_param_grads[param_id] = self._constant_buffered_norm2(grad_buffer)
        self._trained_subgroups.add(self.grad_position[param_id][0])

    # seam 4
    def _optimizer_states_and_gradient_swap_in(self, sub_group_id: int, timer_names: Any = None) -> None:
        super()._optimizer_states_and_gradient_swap_in(sub_group_id, timer_names)
        if not self._tierstore_ready:  # construction: the gradient buffer does not exist yet
            return
        if sub_group_id not in self._trained_subgroups:  # as stock: no gradient yet, no .grad
            return
        start, end = self._grad_offsets[sub_group_id], self._grad_offsets[sub_group_id + 1]
        gradient = self.optimizer_swapper.gradient[: end - start]
        gradient.copy_(self.grad_partitions_flat_buffer[start:end])
        parameter = self.fp32_partitioned_groups_flat[sub_group_id]
        parameter.grad = gradient
        if isinstance(self.optimizer, DeepSpeedCPUAdam):
            self.optimizer_swapper.create_adam_state(parameter)

    def unscale_and_clip_grads(self, sub_group_id: int, total_norm: Any) -> None:
        """Stock fails on a sub-group without ``.grad``; there is nothing to scale."""
        if self.fp32_partitioned_groups_flat[sub_group_id].grad is not None:
            super().unscale_and_clip_grads(sub_group_id, total_norm)

    # seam 5: stock step() with the sub-group order made explicit (DeepSpeed 0.19.8, stage3.py)
    def step(self, closure: Any = None) -> None:
        self._pre_step()
        self._partition_all_parameters()
        self._overflow_check_and_loss_scale_update(update_scale=False)
        scaled_global_grad_norm = None
        if not self.overflow:  # type: ignore[has-type]
            norm_groups = self._get_norm_groups()
            scaled_global_grad_norm = combine_grad_norm_groups(norm_groups)
            if is_invalid_grad_norm(scaled_global_grad_norm):
                self.overflow = True
        if self._loss_scale_update_and_overflow_cleanup():
            return
        self._global_grad_norm = scaled_global_grad_norm / self.loss_scale
        timer_names = {stage3.OPTIMIZER_STEP_TIMER}
        self.timers(stage3.OPTIMIZER_STEP_TIMER).start()
        order = self._begin_pass()
        self._tierstore_passes += 1
        try:
            for sub_group_id in order:
                self._prepare_sub_group(sub_group_id, timer_names)
                self.unscale_and_clip_grads(sub_group_id, scaled_global_grad_norm)
                self._optimizer_step(sub_group_id)
                self._reassign_or_swap_out_partitioned_parameters(sub_group_id)
                self._release_sub_group(sub_group_id, timer_names)
        finally:
            self.optimizer_swapper.end_pass()
        self.timers(stage3.OPTIMIZER_STEP_TIMER).stop()
        self._post_step(timer_names)

    def backward_prologue(self) -> None:
        """Before backward: the next update's pass begins, so its first sub-groups are read while
        backward runs (the staging ring is free then)."""
        super().backward_prologue()
        if self._tierstore_ready:
            self._begin_pass()

    def _begin_pass(self) -> list[int]:
        """Begin (or confirm) the next update's pass over the sub-groups; its order: forward, and
        every second update in reverse (cache-friendly) unless the section says otherwise."""
        order = list(range(len(self.fp16_groups)))
        if self.tierstore_section.order == "alternate" and (self._tierstore_passes + 1) % 2 == 0:
            order.reverse()
        self.optimizer_swapper.begin_pass([self.fp32_partitioned_groups_flat[i] for i in order])
        return order

    # seam 7
    def _rigid_state_dict(self) -> dict[str, Any]:
        if self.tierstore_checkpoint_dir is None:
            raise ConfigError(
                f"{SECTION}: the optimizer state lives in tierstore and is saved by the engine's "
                "save_checkpoint (which tells it where); its state_dict() cannot hold it"
            )
        state: dict[str, Any] = super()._rigid_state_dict()
        scaler = {k: v for k, v in vars(self.loss_scaler).items() if isinstance(v, (bool, int, float))}
        self.optimizer_swapper.export_checkpoint(
            self.tierstore_checkpoint_dir,
            {
                "loss_scaler": scaler,
                "passes": self._tierstore_passes,
                "trained_subgroups": sorted(self._trained_subgroups),
            },
        )
        return state

    def reset_swap_buffers(self) -> None:
        """The engine is loading a checkpoint: tierstore's (copied back from its store), or
        DeepSpeed's own (its swap files the engine copied into ``swap_folder``: a checkpoint from
        before tierstore was enabled). The optimizer's hyperparameters (the learning rate a
        scheduler set...) come from the ZeRO checkpoint file, which DeepSpeed's NVMe-offload load
        skips."""
        saved = None
        if self.tierstore_checkpoint_file is not None:
            zero = torch.load(self.tierstore_checkpoint_file, map_location="cpu", weights_only=False)
            saved = zero["optimizer_state_dict"]
        folder = self.tierstore_checkpoint_dir
        if folder is not None and (folder / CHECKPOINT_INDEX).exists():
            extra = self.optimizer_swapper.restore_checkpoint(folder)
            for key, value in extra["loss_scaler"].items():
                setattr(self.loss_scaler, key, value)
            self._tierstore_passes = int(extra["passes"])
            self._trained_subgroups = set(extra["trained_subgroups"])
        elif saved is not None:
            self._import_deepspeed_state(saved)
        else:
            raise BufferMismatchError(f"{folder}: the checkpoint holds no tierstore optimizer state")
        if saved is not None:
            for group, saved_group in zip(
                self.optimizer.param_groups, saved["optimizer_state_dict"]["param_groups"], strict=True
            ):
                group.update({key: value for key, value in saved_group.items() if key != "params"})
        self._replay_adam_steps()
        super().reset_swap_buffers()  # fp32 masters -> the model's low-precision partitions

    def _replay_adam_steps(self) -> None:
        """``DeepSpeedCPUAdam``'s kernel keeps beta1**step and beta2**step (its bias corrections)
        as running products, one multiplication per step, and computes them with ``pow`` after a
        jump, as the first update after a load would: the two differ in the last bits, and the
        resumed run would drift from the uninterrupted one. Replaying steps 1..N on a one-element
        tensor rebuilds the same products (N: the restored step count, the same for every
        sub-group that has had a gradient)."""
        if not isinstance(self.optimizer, DeepSpeedCPUAdam):
            return
        steps = max((int(entry.get("step", 0)) for entry in self.optimizer.state.values()), default=0)
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        scratch = [torch.zeros(1) for _ in range(4)]  # weight, gradient, exp_avg, exp_avg_sq
        for step in range(1, steps + 1):
            self.optimizer.ds_opt_adam.adam_update(
                self.optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                group["weight_decay"], group["bias_correction"], *scratch,
            )  # fmt: skip

    def _import_deepspeed_state(self, saved: dict[str, Any]) -> None:
        """From DeepSpeed's own ZeRO checkpoint (``saved``): step counts, loss scaler and the
        sub-groups it kept in memory; from its swap files, the rest."""
        state = saved["optimizer_state_dict"]["state"]
        order = [  # the order DeepSpeed's _set_fp32_optimizer_param_groups gave its optimizer
            sub_group
            for group in range(len(self.optimizer.param_groups))
            for sub_group in range(len(self.fp16_groups))
            if self.sub_group_to_group_id[sub_group] == group
        ]
        by_sub_group = {sub_group: state.get(index, {}) for index, sub_group in enumerate(order)}
        entries = [by_sub_group[i] for i in range(len(self.fp16_groups))]
        self.optimizer_swapper.import_deepspeed_state(
            self.fp32_partitioned_groups_flat, saved["fp32_flat_groups"], entries
        )
        for key, value in vars(saved["loss_scaler"]).items():
            if isinstance(value, (bool, int, float)):
                setattr(self.loss_scaler, key, value)
        self._trained_subgroups = {i for i, entry in enumerate(entries) if entry.get("step", 0)}
        self._tierstore_passes = 0

    def checkpoint_event_epilogue(self) -> None:
        super().checkpoint_event_epilogue()
        self.optimizer_swapper.clear_imported()

    def destroy(self) -> None:
        super().destroy()
        self.optimizer_swapper.close()


def _copy_flat(source: torch.Tensor, state: torch.Tensor) -> None:
    """Fill a sub-group's master weights from DeepSpeed's partition (any shape)."""
    state.copy_(source.reshape(-1))
