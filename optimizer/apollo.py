"""APOLLO (SGD-like memory, AdamW-level performance) with its fp32 state offloaded to a TierStore.

APOLLO keeps Adam's moments in a low-rank space: each matrix's gradient ``G`` (m x n) is projected
by a random matrix ``P`` to ``R`` (m x r or r x n), the moments are of ``R``, and the update is
``G`` scaled by how much Adam would have rescaled ``R`` (per channel, or one factor per tensor),
with Fira's norm-growth limiter. ``P`` comes from a seed, refreshed every ``update_proj_gap`` steps,
so it is regenerated, never stored. Rank 1 with tensor scaling (APOLLO-Mini) keeps 2r + 1 values per
matrix beside the master weights: about 4 bytes per parameter to read and write per step for a
low-precision model, where AdamW moves 12. Parameters of groups without ``rank``, and any that is
not a matrix, get the reference's AdamW.

The arithmetic is ``apollo_torch.APOLLOAdamW``'s (PyPI ``apollo-torch``, the official
implementation), operation for operation, with its hyper-parameters, groups, seeds and refresh rule;
the tests hold this to it. Sub-groups hold whole parameters (APOLLO projects whole matrices), laid
out per parameter ``master | exp_avg | exp_avg_sq | scaled-gradient norm``; an fp32 parameter is its
own master weights, updated in place, and its state starts at ``exp_avg``.

Over parameters on a GPU the update runs there (the engine's device path), each projection drawn
by the GPU's generator as ``apollo_torch`` draws it there; the scalar factors (tensor scaling, the
norm-growth limiter) are read by the host, which so waits for the device once per matrix (the
copies of the next and last sub-groups go on meanwhile).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Unpack

import torch

from .._checks import is_integer
from ..errors import BufferMismatchError, ConfigError
from ..store import TierStore
from .adamw import _check_hyperparameters
from .engine import StagedOptimizer, is_real
from .options import StagingKeywords
from .partition import Piece, SubGroup

PROJECTION_DEFAULTS: dict[str, Any] = {
    "proj": "random",
    "scale_type": "tensor",
    "scale": 1.0,
    "update_proj_gap": 200,
    "proj_type": "std",
}
"""What a group with ``rank`` gets for the keys it leaves out (``apollo_torch`` requires them all)."""

APOLLO_MINI: dict[str, Any] = {
    "rank": 1,
    "proj": "random",
    "scale_type": "tensor",
    "scale": 128.0,
    "update_proj_gap": 200,
    "proj_type": "std",
}
"""APOLLO-Mini's group keys, as the paper and ``apollo_torch``'s README give them."""

SEED_ADVANCE = 0xF
"""``apollo_torch``'s ``next_seed``: the last of this many draws seeds the next projection."""


@dataclass(frozen=True)
class _Slot:
    """Where one parameter's state lies in its sub-group's object."""

    piece: Piece
    offset: int
    shape: torch.Size
    moment_shape: tuple[int, ...]
    """Low-rank ``R``'s shape for an APOLLO matrix, the parameter's for AdamW."""
    side: Literal["left", "right"] | None
    """Which side ``P`` multiplies ``G`` from; None: the parameter gets AdamW."""
    master: bool
    """Whether the state holds the parameter's fp32 master weights (False: the parameter is fp32,
    its own master)."""

    @property
    def master_numel(self) -> int:
        return self.piece.length if self.master else 0

    @property
    def moment_numel(self) -> int:
        return math.prod(self.moment_shape)

    @property
    def numel(self) -> int:
        return self.master_numel + 2 * self.moment_numel + (self.side is not None)


class OffloadedAPOLLO(StagedOptimizer):
    """``apollo_torch.APOLLOAdamW`` over a [`TierStore`][], staged as [`OffloadedAdamW`][] is.

    Groups take ``apollo_torch``'s keys: ``rank`` (a group without it gets AdamW), ``proj``
    (``"random"``), ``scale_type`` (``"tensor"`` or ``"channel"``), ``scale``, ``update_proj_gap``,
    ``proj_type`` (``"std"``, ``"reverse_std"``, ``"left"``, ``"right"``), and ``correct_bias``;
    ``scale_front`` and ``disable_nl`` are its constructor flags. APOLLO-Mini is
    ``rank=1, scale_type="tensor"`` (the paper uses ``scale=128``; [`APOLLO_MINI`][]).
    ``max_grad_norm``, ``grad_scale`` and overflow skipping are the engine's, as for AdamW.
    ``maximize`` and ``amsgrad``, which ``apollo_torch`` does not have, are refused as group keys;
    ``rank`` and ``proj_type`` lay a group's state out, so they cannot change after the group is
    added. As for [`OffloadedAdamW`][], an fp32 parameter is its own master weights (no
    ``master_param`` in its state) and a low-precision one has fp32 master weights in the state.

    Args:
        params: the parameters (contiguous tensors, each listed once, all in host memory or all
            on one GPU) or parameter groups with the keys above, as for
            ``apollo_torch.APOLLOAdamW``.
        store: the store holding the fp32 state (master weights, moments and limiter norms).
        lr: the learning rate.
        betas: the coefficients of the running averages of the (projected) gradient and its
            square, each in [0, 1).
        eps: added to the denominator for numerical stability.
        weight_decay: the decoupled weight decay coefficient.
        correct_bias: apply Adam's bias correction (the default of groups that leave it out).
        scale_front: apply the groups' ``scale`` before the norm-growth limiter rather than
            after it (``apollo_torch``'s flag).
        disable_nl: turn Fira's norm-growth limiter off.
        namespace: prefixes the state's store keys; claimed on the store for the optimizer's
            lifetime (see [`StagedOptimizer`][]).
        **staging: the staging options (DRAM budget, read-ahead, sub-group size, clipping...),
            [`StagingKeywords`][]: each is a field of
            [`OptimizerOptions`][tierstore.optimizer.options.OptimizerOptions], which gives its
            default and meaning.

    Raises:
        ConfigError: an argument or group key of the wrong type or out of range (the message
            names it; ``maximize`` and ``amsgrad`` as group keys), a parameter listed twice, a
            ``DTensor`` parameter (FSDP2's shards), or a ``gpu_budget`` for parameters in host
            memory.
        BufferMismatchError: a parameter that is not a contiguous tensor in host memory or on a
            GPU, or one on another device than the first (the message names it).
        CapacityError: ``dram_budget`` is below the working set (the ring and the gradient
            buffer), or does not fit beside the store's other reservations.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
    """

    LAYOUT_KEYS = ("rank", "proj_type")
    SHARDED_PARAMETERS = (
        "APOLLO needs whole matrices (its random projection mixes every row of a gradient, its "
        "norm-growth limiter takes whole-tensor norms), while FSDP2's fully_shard gives each rank some "
        "rows only; on those alone the step would not be APOLLO's. Use "
        "tierstore.integrations.fsdp.FSDPOffloadedAdamW (element-wise) with FSDP2"
    )

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        store: TierStore,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        scale_front: bool = False,
        disable_nl: bool = False,
        namespace: str = "apollo",
        **staging: Unpack[StagingKeywords],
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "correct_bias": correct_bias,
        }
        _check_group(defaults, "")
        for name, flag in (("scale_front", scale_front), ("disable_nl", disable_nl)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name}: must be True or False, got {flag!r}")
        self.scale_front = scale_front
        self.disable_nl = disable_nl
        self._slots: dict[SubGroup, list[_Slot]] = {}
        super().__init__(
            params,
            store,
            defaults,
            namespace=namespace,
            whole_params=True,
            **staging,
        )
        self.seeds = [number + 1 for number in range(len(self.params))]
        """Per parameter, the seed of its current projection (``apollo_torch`` numbers parameters
        from 1 across groups and advances a seed at each refresh)."""

    # -- checkpoints --------------------------------------------------------------------------------
    def _state_entries(self) -> list[dict[str, Any]]:
        """``exp_avg`` and ``exp_avg_sq`` (low-rank for APOLLO matrices), ``master_param`` for a
        low-precision parameter, and for APOLLO matrices the projection ``seed`` and, once set,
        ``scaled_grad`` (the limiter's last norm)."""
        entries: list[dict[str, Any]] = [{} for _ in self.params]
        for sg in self.subgroups:
            blob = self.stager.read(sg.index)
            for slot in self._layout(sg):
                i = slot.piece.param
                master, exp_avg, exp_avg_sq, scaled = self._views(slot, blob)
                entries[i] = {"exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
                if slot.master:
                    entries[i]["master_param"] = master.clone()
                if scaled is not None:
                    entries[i]["seed"] = self.seeds[i]
                    if self.param_steps[i] > 0 and not self.disable_nl:
                        entries[i]["scaled_grad"] = scaled.clone()
        return entries

    def _check_entries(self, entries: list[dict[str, Any] | None]) -> None:
        slots = {slot.piece.param: slot for sg in self.subgroups for slot in self._layout(sg)}
        for i, entry in enumerate(entries):
            slot = slots[i]
            for name, shape in (
                ("master_param", slot.shape),
                ("exp_avg", slot.moment_shape),
                ("exp_avg_sq", slot.moment_shape),
            ):
                if entry is not None and name in entry and tuple(entry[name].shape) != tuple(shape):
                    raise BufferMismatchError(
                        f"state of parameter {i}: {name} has shape {tuple(entry[name].shape)}, "
                        f"this optimizer's is {tuple(shape)}"
                    )

    def _restore_entries(self, entries: list[dict[str, Any] | None]) -> None:
        self.seeds = [
            number + 1 if entry is None else int(entry.get("seed", number + 1))
            for number, entry in enumerate(entries)
        ]

    def _snapshot_metadata(self) -> dict[str, Any]:
        return {"seeds": self.seeds, "state_numels": [self.state_numel(sg) for sg in self.subgroups]}

    def _restore_snapshot_metadata(self, path: Any, metadata: dict[str, Any]) -> None:
        if metadata.get("state_numels") != [self.state_numel(sg) for sg in self.subgroups]:
            raise BufferMismatchError(f"{path}: its ranks or projection types differ from this optimizer's")
        self.seeds = [int(seed) for seed in metadata["seeds"]]

    def _params_added(self, count: int) -> None:
        self.seeds.extend(range(len(self.seeds) + 1, len(self.seeds) + 1 + count))

    # -- the layout and the kernel ---------------------------------------------------------------------
    def _check_group(self, group: dict[str, Any], where: str) -> None:
        _check_group(group, where)

    def state_numel(self, sg: SubGroup) -> int:
        return sum(slot.numel for slot in self._layout(sg))

    def _layout(self, sg: SubGroup) -> list[_Slot]:
        if sg not in self._slots:
            group = self.param_groups[sg.group]
            slots, offset = [], 0
            for piece in sg.pieces:
                shape = self.params[piece.param].shape
                side = _side(shape, group["proj_type"]) if "rank" in group and len(shape) == 2 else None
                if side is None:
                    moment: tuple[int, ...] = tuple(shape)
                else:
                    rows, columns = shape
                    moment = (rows, group["rank"]) if side == "right" else (group["rank"], columns)
                    norm_dim = 0 if rows < columns else 1  # apollo_torch's channel dimension
                    if group["scale_type"] == "channel" and norm_dim != (0 if side == "left" else 1):
                        raise ConfigError(
                            f"param_groups.{sg.group}.scale_type: 'channel' scaling of a {rows}x{columns} "
                            f"matrix needs proj_type 'std' (got {group['proj_type']!r})"
                        )
                slots.append(_Slot(piece, offset, shape, moment, side, not self._own_masters[piece.param]))
                offset += slots[-1].numel
            self._slots[sg] = slots
        return self._slots[sg]

    def _views(
        self, slot: _Slot, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Master weights (of ``state``, or the parameter itself if it is its own master), both
        moments and (APOLLO only) the limiter's norm, as views of ``state``."""
        start, n, k = slot.offset, slot.master_numel, slot.moment_numel
        weights = state[start : start + n] if slot.master else self._window(slot.piece)
        master = weights.view(slot.shape)
        exp_avg = state[start + n : start + n + k].view(slot.moment_shape)
        exp_avg_sq = state[start + n + k : start + n + 2 * k].view(slot.moment_shape)
        scaled = None if slot.side is None else state[start + n + 2 * k]
        return master, exp_avg, exp_avg_sq, scaled

    def _master_views(self, sg: SubGroup, state: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        return [(slot.piece, self._views(slot, state)[0].view(-1)) for slot in self._layout(sg)]

    def _fill(self, sg: SubGroup, state: torch.Tensor, *, saved: dict[Any, Any] | None) -> None:
        for slot in self._layout(sg):
            i = slot.piece.param
            entry = None if saved is None else saved.get(i, saved.get(str(i)))
            master, exp_avg, exp_avg_sq, scaled = self._views(slot, state)
            if slot.master:
                weights = (
                    self.params[i] if entry is None or "master_param" not in entry else entry["master_param"]
                )
                master.copy_(weights.detach().reshape(slot.shape))
            for part, name in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq"), (scaled, "scaled_grad")):
                if part is None:
                    continue
                if entry is not None and name in entry:
                    part.copy_(entry[name].reshape(part.shape))
                else:
                    part.zero_()

    def _update(self, sg: SubGroup, state: torch.Tensor, coefficient: float) -> None:
        group = self.param_groups[sg.group]
        slots = {slot.piece.param: slot for slot in self._layout(sg)}
        for piece, grad in self._gradients(sg, coefficient):
            slot = slots[piece.param]
            master, exp_avg, exp_avg_sq, scaled = self._views(slot, state)
            self._apollo_adamw(group, slot, grad.view(slot.shape), master, exp_avg, exp_avg_sq, scaled)
            if slot.master:  # an fp32 parameter was updated in place
                self._copy_to_model(piece, master.view(-1))

    def _apollo_adamw(
        self,
        group: dict[str, Any],
        slot: _Slot,
        grad: torch.Tensor,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        scaled: torch.Tensor | None,
    ) -> None:
        """``APOLLOAdamW.step`` for one parameter, in ``apollo_torch``'s order of operations except
        that with tensor scaling the scalar factors (the scale, the norm-growth limiter) are folded
        into one, applied with the update: three fewer passes over the gradient, equal to the
        reference within rounding. The fp32 gradient buffer takes a channel-scaled gradient in
        place (no full-size temporary)."""
        param = slot.piece.param
        step = self.param_steps[param]  # this step included
        moment_grad = grad
        if slot.side is not None:  # APOLLO step 1: the gradient in the low-rank space
            if (step - 1) % group["update_proj_gap"] == 0 and step > 1:
                self.seeds[param] = next_seed(self.seeds[param])
            seed = self.seeds[param]
            projection = random_projection(slot.shape, group["rank"], slot.side, seed, grad.device)
            moment_grad = grad @ projection.t() if slot.side == "right" else projection.t() @ grad
        beta1, beta2 = group["betas"]
        exp_avg.mul_(beta1).add_(moment_grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(moment_grad, moment_grad, value=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size = step_size * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        norm_grad = exp_avg / denom
        if scaled is None:
            master.add_(norm_grad, alpha=-step_size)
        else:  # APOLLO steps 3 and 4: scale the raw gradient as Adam scaled the projected one
            rows, columns = slot.shape
            norm_dim = 0 if rows < columns else 1
            if group["scale_type"] == "channel":
                factor = torch.norm(norm_grad, dim=norm_dim) / (torch.norm(moment_grad, dim=norm_dim) + 1e-8)
                update = grad.mul_(factor.unsqueeze(1) if norm_dim == 1 else factor)
                coefficient = 1.0
            else:
                update = grad
                coefficient = float(torch.norm(norm_grad) / (torch.norm(moment_grad) + 1e-8))
            # Every later scaling is by a scalar: folded into one, applied with the update.
            scale = math.sqrt(group["scale"])
            if self.scale_front:
                coefficient *= scale
            if not self.disable_nl:  # Fira's norm-growth limiter
                update_norm = float(torch.norm(update)) * coefficient
                if step > 1:
                    limiter = max(update_norm / (float(scaled) + 1e-8), 1.01) / 1.01
                    coefficient /= limiter
                    update_norm /= limiter
                scaled.fill_(update_norm)
            if not self.scale_front:
                coefficient *= scale
            master.add_(update, alpha=-step_size * coefficient)
        if group["weight_decay"] > 0.0:
            master.add_(master, alpha=-group["lr"] * group["weight_decay"])


def random_projection(
    shape: torch.Size, rank: int, side: str, seed: int, device: torch.device | None = None
) -> torch.Tensor:
    """``apollo_torch``'s projection: standard normal entries from ``seed``, over sqrt(rank);
    (rank x columns) applied from the right, (rows x rank) from the left; drawn by a generator on
    ``device`` (default the CPU), where the gradient is, as ``apollo_torch`` draws it (a GPU's
    generator draws other numbers than the CPU's from the same seed)."""
    rows, columns = shape
    generator = torch.Generator(device=device or "cpu").manual_seed(seed)
    size = (rank, columns) if side == "right" else (rows, rank)
    return torch.randn(size, generator=generator, dtype=torch.float32, device=device) / math.sqrt(rank)


def next_seed(seed: int) -> int:
    """The seed of the next projection, as ``apollo_torch`` derives it."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, torch.iinfo(torch.int64).max, (SEED_ADVANCE,), generator=generator)
    return int(draws.tolist()[-1])


def _side(shape: torch.Size, proj_type: str) -> Literal["left", "right"]:
    rows, columns = shape
    tall = rows >= columns
    if proj_type == "std":
        return "right" if tall else "left"
    if proj_type == "reverse_std":
        return "left" if tall else "right"
    return "right" if proj_type == "right" else "left"


def _check_group(group: dict[str, Any], where: str) -> None:
    """AdamW's hyper-parameters, ``correct_bias``, and for a group with ``rank`` the projection's
    keys (missing ones take `PROJECTION_DEFAULTS`): a [`ConfigError`][] naming the field. torch's
    ``maximize`` and ``amsgrad``, which APOLLO does not have, are refused rather than ignored."""
    for key in ("maximize", "amsgrad"):
        if group.get(key, False) is not False:
            raise ConfigError(
                f"{where}{key}: not supported by APOLLO (apollo_torch has no {key}), got {group[key]!r}"
            )
    _check_hyperparameters(group, where)
    group.setdefault("correct_bias", True)
    if not isinstance(group["correct_bias"], bool):
        raise ConfigError(f"{where}correct_bias: must be True or False, got {group['correct_bias']!r}")
    if "rank" not in group:
        return
    for key, value in PROJECTION_DEFAULTS.items():
        group.setdefault(key, value)
    if not is_integer(group["rank"]) or group["rank"] < 1:
        raise ConfigError(f"{where}rank: must be a positive integer, got {group['rank']!r}")
    if group["proj"] != "random":
        raise ConfigError(
            f"{where}proj: only 'random' is supported, got {group['proj']!r} (an SVD projection is a "
            "stored matrix per parameter; a random one is regenerated from its seed)"
        )
    if group["scale_type"] not in ("tensor", "channel"):
        raise ConfigError(f"{where}scale_type: must be 'tensor' or 'channel', got {group['scale_type']!r}")
    if not is_real(group["scale"]) or group["scale"] <= 0.0:
        raise ConfigError(f"{where}scale: must be a positive number, got {group['scale']!r}")
    if not is_integer(group["update_proj_gap"]) or group["update_proj_gap"] < 1:
        raise ConfigError(
            f"{where}update_proj_gap: must be a positive integer, got {group['update_proj_gap']!r}"
        )
    if group["proj_type"] not in ("std", "reverse_std", "left", "right"):
        raise ConfigError(
            f"{where}proj_type: must be 'std', 'reverse_std', 'left' or 'right', got {group['proj_type']!r}"
        )
