"""AdamW with its fp32 state offloaded to a TierStore, staged sub-group by sub-group.

The model keeps its low-precision (bf16/fp16) parameters and gradients in memory. Each sub-group's
fp32 master weights and both Adam moments live in the store as one object (``3 x numel`` fp32:
master | exp_avg | exp_avg_sq). A step:

1. measures the global gradient norm from the low-precision gradients (fp32 accumulation, no fp32
   copy), detects overflow (a non-finite norm skips the step, leaving all state untouched, as
   loss scaling expects) and derives one coefficient for unscaling and clipping;
   as ``torch.optim.AdamW``, each parameter counts its own steps (bias correction), and only
   steps on which it has a gradient count: a parameter without one is left untouched;
2. visits the sub-groups forward on odd steps and in reverse on even ones (MLP-Offload's
   cache-friendly order), reading ahead into a ring of page-aligned buffers while the current
   sub-group is updated, and writing finished ones back in the background;
3. per sub-group, converts its gradients into one reused fp32 buffer (delayed, in place),
   multiplies in the coefficient, runs one fused AdamW kernel on the views (each piece with its
   parameter's step count, so pieces of parameters with different counts share the call), and
   copies the new master weights into the model's parameters. No fp32 gradient is ever written
   to storage;
4. keeps the sub-groups at the end of the pass in DRAM (the I/O performance model chooses which;
   the next, reversed pass starts with them), so they skip both their write now and their read
   next step.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from ..buffers import aligned_tensor
from ..errors import BufferMismatchError, ConfigError
from ..snapshot import export_hdf5, import_hdf5
from ..store import TierStore
from .partition import Piece, SubGroup, partition
from .staging import FP32, CachePolicy, SubGroupStager, _is_integer

STATE_PARTS = 3  # master weights, exp_avg, exp_avg_sq


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) over a :class:`TierStore`.

    ``dram_budget`` bounds the fp32 state this optimizer holds in DRAM: the ring of
    ``prefetch_depth`` read-ahead buffers, the fp32 gradient buffer, and the sub-groups kept
    cached between steps (``cache_policy``: ``"model"`` asks :func:`tierstore.model.plan_pass`,
    ``"static"`` keeps the last K that fit as MLP-Offload does, ``"none"`` keeps nothing).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        store: TierStore,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        sub_group_size: int = 100_000_000,
        max_grad_norm: float | None = None,
        dram_budget: int | None = None,
        prefetch_depth: int = 2,
        cache_policy: CachePolicy = "model",
        namespace: str = "adamw",
    ) -> None:
        hyperparameters = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        _check_hyperparameters(hyperparameters, "")
        if not _is_integer(sub_group_size) or sub_group_size < 1:
            raise ConfigError(f"sub_group_size: must be a positive integer, got {sub_group_size!r}")
        if max_grad_norm is not None and not (_is_real(max_grad_norm) and max_grad_norm > 0.0):
            raise ConfigError(f"max_grad_norm: must be None or a positive number, got {max_grad_norm!r}")
        super().__init__(params, hyperparameters)
        for number, group in enumerate(self.param_groups):
            _check_hyperparameters(group, f"param_groups.{number}.")
        self.store = store
        self.max_grad_norm = max_grad_norm
        self.params = [p for group in self.param_groups for p in group["params"]]
        for param in self.params:
            if not param.is_contiguous() or param.device.type != "cpu":
                raise BufferMismatchError("OffloadedAdamW needs contiguous CPU parameters")
        index = {id(p): i for i, p in enumerate(self.params)}
        self.subgroups = partition(
            [[(index[id(p)], p.numel()) for p in group["params"]] for group in self.param_groups],
            sub_group_size,
        )
        largest = max((sg.numel for sg in self.subgroups), default=1)
        self.stager = SubGroupStager(
            store,
            namespace,
            slot_elements=STATE_PARTS * largest,
            dram_budget=dram_budget,
            prefetch_depth=prefetch_depth,
            cache_policy=cache_policy,
            reserved_bytes=FP32 * largest,  # the fp32 gradient buffer
        )
        self.step_count = 0
        """Steps taken (overflow-skipped ones excluded); the sub-group order alternates with it."""
        self.param_steps = [0] * len(self.params)
        """Per parameter, the steps on which it had a gradient: its bias correction, as in torch."""
        self.skipped_steps = 0
        self._grad = aligned_tensor(largest)
        self._write_all(None)

    # -- public -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scale: float = 1.0) -> Any:
        """One AdamW step; gradients are divided by ``grad_scale`` (loss scaling). A step whose
        gradients overflow is skipped (``skipped_steps`` counts them) and changes nothing."""
        if not grad_scale > 0.0:
            raise ConfigError(f"grad_scale must be a positive number, got {grad_scale}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coefficient = self._gradient_coefficient(grad_scale)
        if coefficient is None:
            self.skipped_steps += 1
            return loss
        self.step_count += 1
        for number, param in enumerate(self.params):
            if param.grad is not None:
                self.param_steps[number] += 1
        order = [sg.index for sg in self.subgroups]
        if self.step_count % 2 == 0:
            order.reverse()
        self._pass(order, coefficient)
        return loss

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master weights, one tensor per parameter (read from DRAM or the store)."""
        return self._gather()[0]

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` format, plus each parameter's fp32 ``master_param``. Sub-groups cached in
        DRAM are written to the store first, so the store holds the same state as the dict."""
        self.stager.flush()
        masters, exp_avgs, exp_avg_sqs = self._gather()
        state = {
            i: {"step": torch.tensor(float(steps)), "exp_avg": m, "exp_avg_sq": v, "master_param": w}
            for i, (steps, w, m, v) in enumerate(
                zip(self.param_steps, masters, exp_avgs, exp_avg_sqs, strict=True)
            )
        }
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
            groups[-1]["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
        return {
            "state": state,
            "param_groups": groups,
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (same parameter shapes); the store is rewritten. Each
        parameter's ``step`` is its own count (a parameter without an entry has taken none, as in
        torch); dicts saved before per-parameter counts hold the global count in every entry."""
        groups, state = state_dict["param_groups"], state_dict["state"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups, strict=True)
        ):
            raise BufferMismatchError("the state dict's parameter groups do not match this optimizer's")
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        entries = [state.get(i, state.get(str(i))) for i in range(len(self.params))]
        param_steps = [0 if entry is None else int(entry.get("step", 0)) for entry in entries]
        self.step_count = int(state_dict.get("step_count", max(param_steps, default=0)))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        for i, (param, entry) in enumerate(zip(self.params, entries, strict=True)):
            for name in ("exp_avg", "exp_avg_sq", "master_param"):
                if entry is not None and name in entry and entry[name].shape != param.shape:
                    raise BufferMismatchError(
                        f"state of parameter {i}: {name} has shape {tuple(entry[name].shape)}, "
                        f"the parameter {tuple(param.shape)}"
                    )
        self.param_steps = param_steps
        self.stager.drop_resident()
        self._write_all(state)

    def save_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Checkpoint the fp32 state (sub-groups kept in DRAM included) and step counts into one
        portable HDF5 file (:func:`tierstore.export_hdf5`), without gathering it in memory."""
        self.stager.flush()
        metadata = {
            "step_count": self.step_count,
            "param_steps": self.param_steps,
            "skipped_steps": self.skipped_steps,
            "subgroups": [sg.numel for sg in self.subgroups],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }
        export_hdf5(self.store, path, [self.stager.key(sg.index) for sg in self.subgroups], metadata)

    def load_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Restore a :meth:`save_snapshot` (same parameters and ``sub_group_size``, same namespace).
        A snapshot from before per-parameter step counts gives every parameter the global count."""
        self.stager.drop_resident()
        metadata = import_hdf5(path, self.store)
        if metadata.get("subgroups") != [sg.numel for sg in self.subgroups]:
            raise BufferMismatchError(f"{path}: its sub-groups differ from this optimizer's")
        for group, saved in zip(self.param_groups, metadata["param_groups"], strict=True):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self.step_count = int(metadata["step_count"])
        param_steps = [int(n) for n in metadata.get("param_steps", [self.step_count] * len(self.params))]
        if len(param_steps) != len(self.params):
            raise BufferMismatchError(
                f"{path}: it counts steps for {len(param_steps)} parameters, this optimizer has "
                f"{len(self.params)}"
            )
        self.param_steps = param_steps
        self.skipped_steps = int(metadata["skipped_steps"])
        for sg in self.subgroups:  # the model follows the restored master weights
            self._copy_to_model(sg.pieces, self.stager.read(sg.index).view(STATE_PARTS, sg.numel)[0])

    # -- the pass ---------------------------------------------------------------------------------
    def _pass(self, order: list[int], coefficient: float) -> None:
        self.stager.begin_pass(order, {sg.index: STATE_PARTS * sg.numel for sg in self.subgroups})
        try:
            for index in order:
                state = self.stager.acquire(index)
                self._update(self.subgroups[index], state, coefficient)
                self.stager.release(index)
        finally:
            self.stager.end_pass()

    def _update(self, sg: SubGroup, state: torch.Tensor, coefficient: float) -> None:
        """Delayed in-place gradient conversion, then one fused AdamW call over the sub-group."""
        group = self.param_groups[sg.group]
        master, exp_avg, exp_avg_sq = state.view(STATE_PARTS, sg.numel)
        params, grads, ms, vs, steps = [], [], [], [], []
        for piece in sg.pieces:
            grad = self.params[piece.param].grad
            if grad is None:
                continue  # as torch.optim.AdamW: no gradient, no update, no weight decay
            window = slice(piece.offset, piece.offset + piece.length)
            converted = self._grad[window]
            converted.copy_(grad.view(-1)[piece.param_offset : piece.param_offset + piece.length])
            grads.append(converted)
            params.append(master[window])
            ms.append(exp_avg[window])
            vs.append(exp_avg_sq[window])
            steps.append(torch.tensor(float(self.param_steps[piece.param])))  # its own bias correction
        if not params:
            return
        if coefficient != 1.0:
            self._grad[: sg.numel].mul_(coefficient)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(  # torch.optim.AdamW(fused=True)'s arithmetic; a step count per tensor
            params,
            grads,
            ms,
            vs,
            [],
            steps,
            amsgrad=False,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )
        self._copy_to_model([p for p in sg.pieces if self.params[p.param].grad is not None], master)

    def _copy_to_model(self, pieces: Iterable[Piece], master: torch.Tensor) -> None:
        """The new master weights into the model's (low-precision) parameters."""
        for piece in pieces:
            target = self.params[piece.param].data.view(-1)
            target[piece.param_offset : piece.param_offset + piece.length].copy_(
                master[piece.offset : piece.offset + piece.length]
            )

    def _gradient_coefficient(self, grad_scale: float) -> float | None:
        """1/grad_scale times the clipping factor, or None if the gradients overflowed."""
        norms = [
            torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in self.params if p.grad is not None
        ]
        if not norms:
            return 1.0 / grad_scale
        total = float(torch.linalg.vector_norm(torch.stack(norms))) / grad_scale
        if not torch.isfinite(torch.tensor(total)):
            return None
        coefficient = 1.0 / grad_scale
        if self.max_grad_norm is not None:
            coefficient *= min(1.0, self.max_grad_norm / (total + 1e-6))  # as clip_grad_norm_
        return coefficient

    # -- state plumbing -----------------------------------------------------------------------------
    def _fill(self, sg: SubGroup, state: torch.Tensor, *, saved: dict[Any, Any] | None) -> None:
        """Lay out a sub-group's state from per-parameter tensors (or fresh: master = parameter)."""
        master, exp_avg, exp_avg_sq = state.view(STATE_PARTS, sg.numel)
        for piece in sg.pieces:
            window = slice(piece.offset, piece.offset + piece.length)
            source = slice(piece.param_offset, piece.param_offset + piece.length)
            entry = None if saved is None else saved.get(piece.param, saved.get(str(piece.param)))
            weights = (
                self.params[piece.param]
                if entry is None or "master_param" not in entry
                else entry["master_param"]
            )
            master[window].copy_(weights.detach().reshape(-1)[source])
            for part, name in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
                if entry is not None and name in entry:
                    part[window].copy_(entry[name].reshape(-1)[source])
                else:
                    part[window].zero_()

    def _write_all(self, saved: dict[Any, Any] | None) -> None:
        """Write every sub-group's state (from ``saved``, or fresh) to the store."""
        for sg in self.subgroups:
            self.stager.write(
                sg.index, STATE_PARTS * sg.numel, functools.partial(self._fill, sg, saved=saved)
            )
        self.stager.wait_writes()

    def _gather(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        parts = [[torch.empty(p.shape, dtype=torch.float32) for p in self.params] for _ in range(STATE_PARTS)]
        for sg in self.subgroups:
            rows = self.stager.read(sg.index).view(STATE_PARTS, sg.numel)
            for piece in sg.pieces:
                for part, row in zip(parts, rows, strict=True):
                    part[piece.param].view(-1)[piece.param_offset : piece.param_offset + piece.length].copy_(
                        row[piece.offset : piece.offset + piece.length]
                    )
        return parts[0], parts[1], parts[2]


def _is_real(value: object) -> bool:
    """A finite int or float (bool excluded): what the fused kernel takes as a hyper-parameter."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    """AdamW's hyper-parameters (the defaults, or a parameter group's): a :class:`ConfigError`
    naming the field, rather than a wrong update or a failure deep inside the first step."""
    for name in ("lr", "eps", "weight_decay"):
        if not _is_real(group[name]) or group[name] < 0.0:
            raise ConfigError(f"{where}{name}: must be a finite number >= 0, got {group[name]!r}")
    betas = group["betas"]
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(_is_real(beta) and 0.0 <= beta < 1.0 for beta in betas)
    ):
        raise ConfigError(f"{where}betas: must be two numbers in [0, 1), got {betas!r}")
