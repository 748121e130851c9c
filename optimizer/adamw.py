"""AdamW with its fp32 state offloaded to a TierStore, staged sub-group by sub-group.

The model keeps its low-precision (bf16/fp16) parameters and gradients in memory. Each sub-group's
fp32 master weights and both Adam moments live in the store as one object (``3 x numel`` fp32:
master | exp_avg | exp_avg_sq), and sub-groups cut parameters as ZeRO-3 does. The step's schedule
(overflow and clipping, alternating order, read-ahead, write-back, kept sub-groups, delayed gradient
conversion) is :class:`~tierstore.optimizer.engine.StagedOptimizer`'s; this module supplies the
layout and one fused AdamW kernel per sub-group (each piece with its parameter's step count, so
pieces of parameters with different counts share the call).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..errors import BufferMismatchError, ConfigError
from ..store import TierStore
from .engine import StagedOptimizer, is_real
from .partition import Piece, SubGroup
from .staging import CachePolicy

STATE_PARTS = 3  # master weights, exp_avg, exp_avg_sq


class OffloadedAdamW(StagedOptimizer):
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
        compute_threads: int | None = None,
    ) -> None:
        hyperparameters = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        _check_hyperparameters(hyperparameters, "")
        super().__init__(
            params,
            store,
            hyperparameters,
            sub_group_size=sub_group_size,
            max_grad_norm=max_grad_norm,
            dram_budget=dram_budget,
            prefetch_depth=prefetch_depth,
            cache_policy=cache_policy,
            namespace=namespace,
            compute_threads=compute_threads,
            whole_params=False,
        )
        self._write_all(None)

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
        return {
            "state": state,
            "param_groups": self._state_dict_groups(),
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (same parameter shapes); the store is rewritten. Each
        parameter's ``step`` is its own count (a parameter without an entry has taken none, as in
        torch); dicts saved before per-parameter counts hold the global count in every entry."""
        state = state_dict["state"]
        self._restore_groups(state_dict["param_groups"])
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

    # -- the layout and the kernel ---------------------------------------------------------------------
    def _check_group(self, group: dict[str, Any], where: str) -> None:
        _check_hyperparameters(group, where)

    def state_numel(self, sg: SubGroup) -> int:
        return STATE_PARTS * sg.numel

    def _master_views(self, sg: SubGroup, state: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        master = state.view(STATE_PARTS, sg.numel)[0]
        return [(piece, master[piece.offset : piece.offset + piece.length]) for piece in sg.pieces]

    def _update(self, sg: SubGroup, state: torch.Tensor, coefficient: float) -> None:
        """One fused AdamW call per cache-sized chunk of the sub-group's pieces that have gradients."""
        for grads in self._gradient_chunks(sg, coefficient):
            self._adamw(sg, state, grads)

    def _adamw(self, sg: SubGroup, state: torch.Tensor, grads: list[tuple[Piece, torch.Tensor]]) -> None:
        group = self.param_groups[sg.group]
        master, exp_avg, exp_avg_sq = state.view(STATE_PARTS, sg.numel)
        params, ms, vs, steps = [], [], [], []
        for piece, _ in grads:
            window = slice(piece.offset, piece.offset + piece.length)
            params.append(master[window])
            ms.append(exp_avg[window])
            vs.append(exp_avg_sq[window])
            steps.append(torch.tensor(float(self.param_steps[piece.param])))  # its own bias correction
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(  # torch.optim.AdamW(fused=True)'s arithmetic; a step count per tensor
            params,
            [grad for _, grad in grads],
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
        for (piece, _), weights in zip(grads, params, strict=True):
            self._copy_to_model(piece, weights)

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


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    """AdamW's hyper-parameters (the defaults, or a parameter group's): a :class:`ConfigError`
    naming the field, rather than a wrong update or a failure deep inside the first step."""
    for name in ("lr", "eps", "weight_decay"):
        if not is_real(group[name]) or group[name] < 0.0:
            raise ConfigError(f"{where}{name}: must be a finite number >= 0, got {group[name]!r}")
    betas = group["betas"]
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(is_real(beta) and 0.0 <= beta < 1.0 for beta in betas)
    ):
        raise ConfigError(f"{where}betas: must be two numbers in [0, 1), got {betas!r}")
