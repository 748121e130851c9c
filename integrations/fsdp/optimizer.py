"""AdamW over FSDP2-sharded parameters, each rank staging its own local shards through a TierStore.

``torch.distributed.fsdp.fully_shard`` turns every parameter into a ``DTensor`` sharded by rows
(``Shard(0)``) over a 1-D device mesh: each rank holds a contiguous block of rows, its *local
shard*. [`FSDPOffloadedAdamW`][] is [`OffloadedAdamW`][] whose sub-groups are cut from those local
shards, so a rank reads and writes the state of its own shards only, under its own namespace
(``rank<N>/adamw`` by default). The layouts are [`OffloadedAdamW`][]'s, by the shards' dtype:

* low-precision shards (a model built in bf16 before ``fully_shard``): each sub-group's object is
  ``fp32 master | exp_avg | exp_avg_sq``, 12 bytes per parameter in the store; the shard keeps its
  2 bytes per parameter in memory and receives the new master weights after each step;
* fp32 shards (the usual ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` setup, whose sharded
  parameters stay fp32): the shard itself is the master, so the object is ``exp_avg | exp_avg_sq``,
  8 bytes per parameter in the store, and the kernel updates the shard in place.

Parameters that are not ``DTensor``s (modules left out of ``fully_shard``) are replicated: every rank
stages their whole state, and gradient clipping counts them once (their squared norm averaged over
the ranks). Gradient clipping (``max_grad_norm``) takes one all-reduce of the squared norm; torch's
``clip_grad_norm_`` on the ``DTensor`` gradients works as well.

Shards on GPUs (the usual FSDP2 setup, NCCL process groups) take the engine's device path
([`tierstore.optimizer.device`][]): each rank streams its shards' state between its store and its
GPU and updates it there, ``gpu_budget`` bytes of it kept on the GPU; the squared norm is summed on
the GPU and all-reduced there, and the host reads it once per step. Shards in host memory (gloo)
step on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Unpack

import torch
import torch.distributed as dist
from tierstore.optimizer import OffloadedAdamW
from tierstore.optimizer.adamw import STATE_PARTS, AdamWKeywords
from tierstore.optimizer.state_precision import COMPENSATION_ENTRY
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tierstore.errors import BufferMismatchError, ConfigError
from tierstore.store import TierStore


class FSDPSetupError(ConfigError):
    """A model or optimizer setup that the FSDP2 integration cannot step exactly (the message names
    the parameter or policy and what to do instead)."""


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """The part of ``param`` this rank holds.

    Args:
        param: a parameter, a ``DTensor`` or a plain tensor.

    Returns:
        A ``DTensor``'s local tensor (sharing its memory, so writes into it update the parameter),
        or a plain tensor itself.
    """
    if isinstance(param, DTensor):
        with torch.no_grad():  # the local tensor itself, not an autograd view of it
            return param.to_local()
    return param


def check_fsdp_model(model: nn.Module) -> None:
    """Refuse an FSDP2 setup this integration does not support.

    ``CPUOffloadPolicy`` moves the sharded parameters and their gradients to host memory and leaves
    the optimizer step to run there on FSDP's copies; tierstore offloads the optimizer state only
    (beyond RAM) and needs the parameters where FSDP computes with them.

    Args:
        model: the module ``fully_shard`` was applied to (any of its sub-modules may be sharded
            too).

    Raises:
        FSDPSetupError: a module is sharded with ``fully_shard(offload_policy=CPUOffloadPolicy())``;
            the message names it.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and isinstance(group.offload_policy, CPUOffloadPolicy):
            raise FSDPSetupError(
                f"module {name or '<root>'!r} is sharded with "
                "fully_shard(offload_policy=CPUOffloadPolicy()): "
                "FSDP2 then keeps the sharded parameters and gradients in host memory for a CPU "
                "optimizer step on its own copies; tierstore offloads the optimizer state (beyond RAM) "
                "and leaves the parameters to FSDP: call fully_shard without offload_policy"
            )


class FSDPOffloadedAdamW(OffloadedAdamW):
    """AdamW over the local shards of an FSDP2 model's ``DTensor`` parameters (see the module).

    Args:
        params: the model itself (its parameters, and [`check_fsdp_model`][] runs on it), or its
            parameters or parameter groups as for ``torch.optim.AdamW``; call ``fully_shard`` first.
        store: this rank's store (each rank opens its own, e.g. on its own directory).
        namespace: the state's key prefix, claimed on the store; None for ``rank<N>/adamw`` with
            this rank's number, so ranks sharing one store never meet.
        process_group: the group the gradient norm is summed over; None for the parameters'
            mesh's.
        **options: [`OffloadedAdamW`][]'s hyper-parameters and staging options (`AdamWKeywords`), as
            it takes them; here ``sub_group_size`` counts this rank's local elements,
            ``dram_budget`` and ``gpu_budget`` (shards on GPUs only) are this rank's memory, and
            ``max_grad_norm`` clips the norm over all ranks.

    Raises:
        FSDPSetupError: no parameter is a ``DTensor`` (the model is not sharded); ``DTensor``
            parameters sharded otherwise than by rows over a 1-D mesh (HSDP, tensor
            parallelism) or on different meshes; parameters of mixed dtypes (some shards fp32,
            some not); or a ``CPUOffloadPolicy`` model.
        ConfigError: a hyper-parameter or staging argument of the wrong type or out of range, or
            asking for a kernel other than torch's fused AdamW (the message names it), a
            parameter listed twice, or a ``gpu_budget`` for shards in host memory.
        BufferMismatchError: shards on different devices (some in host memory, some on a GPU);
            the message names the parameter.
        CapacityError: ``dram_budget`` is below the working set, or does not fit beside the
            store's other reservations.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
    """

    SHARDED_PARAMETERS = None
    PACKED_STATE_DICT = False

    def __init__(
        self,
        params: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        store: TierStore,
        *,
        namespace: str | None = None,
        process_group: dist.ProcessGroup | None = None,
        **options: Unpack[AdamWKeywords],
    ) -> None:
        if isinstance(params, nn.Module):
            check_fsdp_model(params)
            params = params.parameters()
        listed = list(params)
        groups: list[dict[str, Any]] = (
            [dict(group) for group in listed]  # type: ignore[call-overload]
            if listed and isinstance(listed[0], dict)
            else [{"params": listed}]
        )
        tensors: list[torch.Tensor] = []
        for group in groups:
            members = group["params"]
            group["params"] = [members] if isinstance(members, torch.Tensor) else list(members)
            tensors.extend(group["params"])
        self.mesh = _common_mesh(tensors)
        if self.mesh is None:
            raise FSDPSetupError(
                f"none of the {len(tensors)} parameters is a DTensor: the model is not sharded. Apply "
                "torch.distributed.fsdp.fully_shard to it (and to its blocks) before building the "
                "optimizer, or use tierstore.optimizer.OffloadedAdamW for an unsharded model"
            )
        _shard_layout(tensors)
        self.process_group = self.mesh.get_group() if process_group is None else process_group
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        super().__init__(
            groups, store, namespace=f"rank{rank}/adamw" if namespace is None else namespace, **options
        )
        self._params_added(len(self.params))

    def _params_added(self, count: int) -> None:
        # torch.distributed.checkpoint.state_dict takes an optimizer without per-parameter state
        # for one never stepped and "initialises" it with a zero-gradient step (which would count
        # a step); this one's state lives in the store from the start, which the entry says.
        for param in self.params[len(self.params) - count :]:
            self.state[param] = {"in_store": self.stager.namespace}

    @property
    def fp32_shards(self) -> bool:
        """Whether the shards are fp32 and their own master weights.

        True: only the moments are staged; False: the store holds fp32 masters for low-precision
        shards.
        """
        return all(self._own_masters)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As [`add_param_group`][tierstore.optimizer.StagedOptimizer.add_param_group], for
        parameters sharded like the others.

        Args:
            param_group: ``params`` and the group's hyper-parameters; keys it leaves out take the
                constructor's values.

        Raises:
            FSDPSetupError: the group's parameters are on another mesh, or their shards' dtype
                (fp32 or not) differs from the others'.
            ConfigError: a parameter listed twice, or an invalid hyper-parameter.
            CapacityError: a given ``dram_budget`` cannot hold the new sub-groups.
            StoreClosedError: the optimizer is closed.
        """
        if hasattr(self, "stager"):
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group["params"] = params
            mesh = _common_mesh([*self.params, *params])
            if _shard_layout([*self.params, *params]) != self.fp32_shards or (
                self.mesh is not None and mesh != self.mesh
            ):
                raise FSDPSetupError("the added group's parameters are sharded or typed unlike the others")
        super().add_param_group(param_group)

    # -- the engine's view of a parameter: its local shard ------------------------------------------
    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's local shard of a parameter, or of a tensor sharded like one (a view)."""
        return local_shard(tensor)

    def _gradient_coefficient(self, grad_scale: float) -> float | None:
        """As the engine's, with the squared norm summed over the ranks in one all-reduce: sharded
        gradients count their local rows, replicated ones their squares averaged over the ranks."""
        sharded, replicated = 0.0, 0.0
        for param in self.params:
            if param.grad is None:
                continue
            squares = self._squares(local_shard(param.grad))
            if _is_sharded(param):
                sharded += squares
            else:
                replicated += squares
        world = dist.get_world_size(self.process_group)
        squares = sharded + replicated
        if world > 1:  # one all-reduce; replicated squares averaged so that they count once
            total = torch.tensor([sharded + replicated / world], dtype=torch.float64)
            dist.all_reduce(total, group=self.process_group)
            squares = float(total[0])
        norm = squares**0.5 / grad_scale
        if not norm < float("inf"):  # inf or nan: skip the step on every rank alike
            return None
        coefficient = 1.0 / grad_scale
        if self.max_grad_norm is not None:
            coefficient *= min(1.0, self.max_grad_norm / (norm + 1e-6))  # as clip_grad_norm_
        return coefficient

    def _device_squares(self) -> torch.Tensor:
        """The device path's: the squared norm on this rank's GPU, sharded gradients counting
        their local rows and replicated ones their squares averaged over the ranks, all-reduced
        there (one collective on the caller's stream; the host waits for the sum only)."""
        sharded = [local_shard(p.grad) for p in self.params if p.grad is not None and _is_sharded(p)]
        replicated = [local_shard(p.grad) for p in self.params if p.grad is not None and not _is_sharded(p)]
        world = dist.get_world_size(self.process_group)
        total = torch.zeros((), dtype=torch.float32, device=self._local(self.params[0]).device)
        for grads, weight in ((sharded, 1.0), (replicated, 1.0 / world)):
            if grads:
                norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
                total.add_(torch.stack(norms).square().sum(), alpha=weight)
        if world > 1:
            dist.all_reduce(total, group=self.process_group)
        return total

    # -- state dicts: DTensors sharded like the parameters ------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As `load_state_dict`, for a dict keyed by whatever ids its groups list.

        Args:
            state_dict: keyed as ``torch.optim`` keys it, or by the fully-qualified names that
                ``torch.distributed.checkpoint.state_dict.set_state_dict`` passes (each group's
                ``params`` give the order, as ``torch.optim.Optimizer.load_state_dict`` takes
                them); its state parts are tensors, or ``DTensor``s, sharded like the parameters.

        Raises:
            BufferMismatchError: the dict's groups, parameters or local shard shapes do not match
                this optimizer's; nothing is restored.
            StoreClosedError: the optimizer is closed.
        """
        super().load_state_dict(by_position(state_dict))

    def _check_entries(self, entries: list[dict[str, Any] | None]) -> None:
        super()._check_entries(entries)
        for i, (param, entry) in enumerate(zip(self.params, entries, strict=True)):
            for name in (*STATE_PARTS, COMPENSATION_ENTRY):
                if entry is None or name not in entry:
                    continue
                mine, theirs = local_shard(param).shape, local_shard(entry[name]).shape
                if mine != theirs:
                    raise BufferMismatchError(
                        f"state of parameter {i}: {name}'s local shard has shape {tuple(theirs)}, the "
                        f"parameter's {tuple(mine)} (load a DCP checkpoint through get_state_dict/"
                        "set_state_dict, which reshards it)"
                    )

    def _state_entries(self) -> list[dict[str, Any]]:
        """Per parameter, its state parts as fp32 tensors sharded like the parameter (``DTensor``s
        over the same mesh and placements), gathered from the store: this rank's shards only."""
        return [
            {part: like_parameter(param, local) for part, local in entry.items()}
            for param, entry in zip(self.params, super()._state_entries(), strict=True)
        ]

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master weights of this rank's shards.

        Returns:
            One fp32 tensor per parameter, sharded like it (a ``DTensor`` for a sharded
            parameter).

        Raises:
            StoreClosedError: the optimizer is closed.
        """
        return [like_parameter(p, m) for p, m in zip(self.params, super().master_params(), strict=True)]


def by_position(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its per-parameter entries keyed 0, 1, ... in the order its groups list
    their parameters' ids (fully-qualified names from ``set_state_dict``, or indices)."""
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    state = state_dict["state"]
    return {
        **state_dict,
        "state": {number: state[pid] for number, pid in enumerate(ids) if pid in state},
        "param_groups": [
            {**group, "params": list(range(start, start + len(group["params"])))}
            for group, start in zip(
                state_dict["param_groups"],
                _starts([len(g["params"]) for g in state_dict["param_groups"]]),
                strict=True,
            )
        ],
    }


def _starts(counts: list[int]) -> list[int]:
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


def like_parameter(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A local tensor as a tensor sharded like a parameter.

    Args:
        param: the parameter whose sharding to take.
        local: this rank's part, of ``param``'s local shape.

    Returns:
        For a ``DTensor`` parameter, a ``DTensor`` over ``local`` with its mesh, placements,
        global shape and stride; else ``local`` itself.
    """
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _is_sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements)


def _common_mesh(params: list[torch.Tensor]) -> Any:
    """The one device mesh of the ``DTensor`` parameters (None if there are none); an
    [`FSDPSetupError`][] for placements this integration does not step exactly."""
    mesh = None
    for number, param in enumerate(params):
        if not isinstance(param, DTensor):
            continue
        where = f"parameter {number} (shape {tuple(param.shape)}, placements {param.placements})"
        if param.device_mesh.ndim != 1 or not all(
            isinstance(p, (Shard, Replicate)) for p in param.placements
        ):
            raise FSDPSetupError(
                f"{where}: only fully_shard's row sharding over a 1-D mesh (Shard(0)) or replication "
                "is supported, not HSDP or tensor-parallel placements"
            )
        if any(isinstance(p, Shard) and p.dim != 0 for p in param.placements):
            raise FSDPSetupError(f"{where}: sharded along a dimension other than 0 (fully_shard's rows)")
        if mesh is None:
            mesh = param.device_mesh
        elif param.device_mesh != mesh:
            raise FSDPSetupError(f"{where}: on another device mesh than the first DTensor parameter")
    return mesh


def _shard_layout(params: list[torch.Tensor]) -> bool:
    """True if every local shard is fp32 (its own master), False if none is; mixed is refused."""
    kinds = {local_shard(p).dtype == torch.float32 for p in params}
    if len(kinds) > 1:
        raise FSDPSetupError(
            "the parameters mix fp32 and low-precision shards: shard a model of one dtype (bf16 "
            "parameters get fp32 masters in the store; fp32 ones, as with "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16), are their own masters)"
        )
    return kinds != {False}
