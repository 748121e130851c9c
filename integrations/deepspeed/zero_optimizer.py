"""DeepSpeed's ZeRO-3 optimizer with its optimizer-state offload going through tierstore.

`TierStoreZeroOptimizer` subclasses ``DeepSpeedZeroOptimizer_Stage3`` and overrides only the methods
listed in `RELIED_ON` (checked by `check_seams`):

* ``_configure_tensor_swapping`` (seam 2): a `TierStoreSwapper` instead of DeepSpeed's aio swappers.
* ``_offload_grad_partition_at_boundary`` (seam 3): records the gradient norm (and that the
  parameter's sub-group has had a gradient) only. Gradients stay in the low-precision
  ``grad_partitions_flat_buffer``; no fp32 gradient is ever written to storage.
* ``_optimizer_states_and_gradient_swap_in`` (seam 4): after the state is in, converts the
  sub-group's low-precision gradient slice into one reused fp32 buffer (delayed, in place) as
  ``.grad``; ``unscale_and_clip_grads`` passes over a sub-group left without one (see below).
* ``step`` (seam 5): visits sub-groups in `pass_order` (forward, then in reverse on the next step:
  cache-friendly), and tells the swapper the order so it reads ahead and keeps the end of the pass
  in DRAM; ``backward_prologue`` begins that pass early, so its first reads run while backward does.
* ``_rigid_state_dict``, ``reset_swap_buffers``, ``checkpoint_event_epilogue`` (seam 7): the
  optimizer state goes into and comes back from the checkpoint through tierstore (`checkpoints`), or
  is imported from a checkpoint of DeepSpeed's own NVMe offload.

With a compressed ``tierstore.state_precision`` the swapper stores each sub-group packed, unpacks
it into fp32 for DeepSpeed's optimizer at swap-in and packs it at swap-out. A ``bf16-compensated``
master is the model's low-precision partition (``fp16_partitioned_groups_flat[i]``, bf16 or fp16)
plus a stored compensation, so it needs that partition in memory: refused with parameters
offloaded to NVMe. Stock's step copies the new fp32 master into that partition
(``_reassign_or_swap_out_partitioned_parameters``, ``copy_``: rounding to nearest) before it swaps
the sub-group out (``_release_sub_group``), so the compensation is computed from the rounding the
partition holds.

Parameters without a gradient on a step (a module unused on that step), as stock DeepSpeed 0.19.8
ZeRO-3 with its optimizer on NVMe does it (checked by running it; the integration's tests compare):

* Adam's step count (``DeepSpeedCPUAdam``) is kept per optimizer tensor, which in ZeRO-3 is a whole
  sub-group's flat fp32 partition; it advances on every step on which that partition has a
  ``.grad``. So bias correction is per sub-group, not per parameter as in ``torch.optim.AdamW`` (or
  [`OffloadedAdamW`][tierstore.optimizer.OffloadedAdamW]): every sub-group that has had a gradient
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import deepspeed.runtime.zero.stage3 as stage3
import torch
from deepspeed import comm as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from tierstore.optimizer.subgroup_stager import pass_order

from tierstore._directories import missing_directories
from tierstore.errors import BufferMismatchError, ConfigError
from tierstore.store import TierStore

from .checkpoints import CHECKPOINT_INDEX, replay_adam_steps
from .config import SECTION, parse_section
from .swapper import TierStoreSwapper

StockZeroOptimizer: Any = stage3.DeepSpeedZeroOptimizer_Stage3
"""DeepSpeed's own ZeRO-3 optimizer, as imported before `substituted_optimizer` swaps the subclass
in."""
RELIED_ON = (
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
"""The methods of `StockZeroOptimizer` the subclass overrides or calls."""


class TierStoreZeroOptimizer(StockZeroOptimizer):  # type: ignore[misc]
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
        precision = self.tierstore_section.state_precision
        if precision.master == "bf16-compensated" and any(
            partition is None for partition in self.fp16_partitioned_groups_flat
        ):
            raise ConfigError(
                f"{SECTION}.state_precision: {precision.name!r} keeps the master weights as the model's "
                "partitions plus a compensation, and zero_optimization.offload_param keeps partitions on "
                "NVMe; use a precision with an fp32 master ('int8', 'bf16')"
            )
        rank = dist.get_rank()
        nvme_path = Path(offload_optimizer_config.nvme_path)
        default_tier = self.tierstore_section.default_tier_path(nvme_path, rank)
        made = [] if default_tier is None else missing_directories(default_tier)
        store = TierStore.from_config(self.tierstore_section.store_config(nvme_path, rank))
        self.optimizer_swapper = TierStoreSwapper(
            store,
            self.tierstore_section,
            nvme_path / "zero_stage_3" / "tierstore" / f"rank{rank}",
            self.optimizer,
            largest_numel=max(self.fp16_partitioned_groups_flat_numel),
            namespace=f"rank{rank}",
            low_precision=functools.partial(
                _low_precision_partition, self.fp32_partitioned_groups_flat, self.fp16_partitioned_groups_flat
            ),
            store_directories=made,
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
        every second update in reverse (cache-friendly) unless the section says ``ascending``."""
        order = pass_order(
            len(self.fp16_groups),
            self._tierstore_passes + 1,
            alternate=self.tierstore_section.order == "alternate",
        )
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
        replay_adam_steps(self.optimizer)
        super().reset_swap_buffers()  # fp32 masters -> the model's low-precision partitions

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


def _low_precision_partition(
    fp32_partitions: Sequence[torch.Tensor],
    partitions: Sequence[torch.Tensor | None],
    parameter: torch.Tensor,
) -> torch.Tensor | None:
    """The model's low-precision partition (``fp16_partitioned_groups_flat[i]``; None on NVMe) of the
    sub-group whose fp32 partition (``fp32_partitioned_groups_flat[i]``) is ``parameter``."""
    for fp32, partition in zip(fp32_partitions, partitions, strict=False):  # fp32's list grows at init
        if fp32 is parameter:
            return partition
    raise KeyError(f"sub-group {getattr(parameter, 'ds_id', '?')} is not one of this optimizer's")
