"""AdamW with its fp32 state offloaded to a TierStore, staged sub-group by sub-group.

The model keeps its parameters and gradients in memory. Each sub-group's state lives in the store as
one object, rows of ``numel`` fp32 values: ``exp_avg | exp_avg_sq`` (8 bytes per parameter), with
``max_exp_avg_sq`` after them for a group with ``amsgrad``, and the fp32 master weights before them
for a group with low-precision (bf16/fp16) parameters (12 bytes per parameter). fp32 parameters are
their own master weights, updated in place; in a group that mixes them with low-precision ones the
master row is there for every piece but is neither read nor written for theirs. Sub-groups cut
parameters as ZeRO-3 does. The step's schedule (overflow and clipping, alternating order,
read-ahead, write-back, kept sub-groups, delayed gradient conversion) is [`StagedOptimizer`][]'s;
this module supplies the layout and one fused AdamW kernel call per sub-group chunk (each piece with
its parameter's step count, so pieces of parameters with different counts share the call).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Unpack

import torch

from ..errors import BufferMismatchError, ConfigError
from ..store import TierStore
from .engine import StagedOptimizer, is_real
from .options import StagingKeywords
from .partition import Piece, SubGroup
from .state_kernels import adamw_int8_compensated
from .state_precision import COMPENSATION_ENTRY, PRESETS, RowKind

STATE_PARTS = ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""A sub-group's state, in object order (as named in a state dict); the first for groups with
low-precision parameters only, the last for ``amsgrad`` only."""

KERNEL_KEYS: dict[str, tuple[bool | None, ...]] = {
    "foreach": (None, False),
    "fused": (None, True),
    "capturable": (False,),
    "differentiable": (False,),
}
"""``torch.optim.AdamW``'s implementation keys and the values this optimizer honours: its kernel is
torch's fused AdamW (``fused=True``, what ``None`` is taken to mean); ``foreach=True`` (another
kernel), ``fused=False``, ``capturable=True`` (CUDA graph capture) and ``differentiable=True``
(autograd through the step) are not what it runs, and are refused."""

PART_KINDS: dict[str, RowKind] = {
    "master_param": "master",
    "exp_avg": "signed",
    "exp_avg_sq": "nonnegative",
    "max_exp_avg_sq": "nonnegative",
}
"""What each state part holds, for its stored format ([`state_precision`][])."""


class AdamWKeywords(StagingKeywords, total=False):
    """[`OffloadedAdamW`][]'s keyword arguments but ``namespace`` (its hyper-parameters, with its
    signature's types, and the staging options), typed for a caller passing them on
    (``**options: Unpack[AdamWKeywords]``); [`OffloadedAdamW`][] documents them."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    foreach: bool | None
    capturable: bool
    differentiable: bool
    fused: bool | None


class OffloadedAdamW(StagedOptimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) over a [`TierStore`][].

    Every option of ``torch.optim.AdamW`` is honoured or refused, as a constructor argument (the
    defaults) or a group key: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``,
    ``maximize`` and the group key ``decoupled_weight_decay`` (False: L2 weight decay added to the
    gradient, as ``torch.optim.Adam``) are the training's; the kernel is torch's fused AdamW, the
    arithmetic of ``torch.optim.AdamW(fused=True)`` (``fused=None`` is taken to mean it, and the
    groups say ``fused=True``), and ``foreach=True``, ``fused=False``, ``capturable=True`` and
    ``differentiable=True``, which ask for something else, are refused (`KERNEL_KEYS`). A loaded
    state dict's ``foreach``, ``fused``, ``capturable`` and ``differentiable`` describe its saver's
    kernel and are not taken. ``amsgrad`` adds a fourth of state (its bytes counted against
    ``dram_budget`` and moved every step) and, laying the group's state out, cannot change after the
    group is added.

    fp32 parameters are their own master weights (the state holds their two moments, 8 bytes per
    parameter); low-precision ones get fp32 master weights in the state (12 bytes per parameter) and
    receive them rounded after each step. A state dict carries ``master_param`` for the
    low-precision parameters only (see `load_state_dict` for what a loaded one must satisfy).

    Args:
        params: the parameters (contiguous tensors, each listed once, all in host memory or all
            on one GPU) or parameter groups, as for ``torch.optim.AdamW``.
        store: the store holding the fp32 state (master weights and moments).
        lr: the learning rate.
        betas: the coefficients of the running averages of the gradient and its square, each in
            [0, 1).
        eps: added to the denominator for numerical stability.
        weight_decay: the weight decay coefficient (decoupled; L2 in a group with
            ``decoupled_weight_decay=False``).
        amsgrad: keep the running maximum of the second moment (AMSGrad).
        maximize: maximize the objective instead of minimizing it.
        foreach: torch's choice of its multi-tensor kernel: None or False (this optimizer runs
            the fused kernel); True is refused.
        capturable: torch's CUDA-graph-capturable step: False; True is refused.
        differentiable: torch's autograd through the step: False; True is refused.
        fused: torch's fused kernel, the one this optimizer runs: None or True; False is refused.
        namespace: prefixes the state's store keys; claimed on the store for the optimizer's
            lifetime (see [`StagedOptimizer`][]).
        **staging: the staging options (DRAM budget, read-ahead, sub-group size, clipping...),
            [`StagingKeywords`][]: each is a field of
            [`OptimizerOptions`][tierstore.optimizer.options.OptimizerOptions], which gives its
            default and meaning.

    Raises:
        ConfigError: an argument or group key of the wrong type or out of range, or asking for a
            kernel other than torch's fused AdamW (the message names it), a parameter listed twice,
            a ``DTensor`` parameter (FSDP2's shards), or a ``gpu_budget`` for parameters in host
            memory.
        BufferMismatchError: a parameter that is not a contiguous tensor in host memory or on a
            GPU, or one on another device than the first (the message names it).
        CapacityError: ``dram_budget`` is below the working set (the ring and the gradient
            buffer), or does not fit beside the store's other reservations.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
    """

    LAYOUT_KEYS = ("amsgrad",)
    IMPLEMENTATION_KEYS = tuple(KERNEL_KEYS)
    COMPRESSED_STATE: ClassVar[str | None] = None

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        store: TierStore,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        namespace: str = "adamw",
        **staging: Unpack[StagingKeywords],
    ) -> None:
        hyperparameters = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": True,
        }
        _check_adamw_group(hyperparameters, "")
        super().__init__(
            params,
            store,
            hyperparameters,
            namespace=namespace,
            whole_params=False,
            **staging,
        )

    def _check_entries(self, entries: list[dict[str, Any] | None]) -> None:
        for i, (param, entry) in enumerate(zip(self.params, entries, strict=True)):
            for name in (*STATE_PARTS, COMPENSATION_ENTRY):
                if entry is not None and name in entry and entry[name].shape != param.shape:
                    raise BufferMismatchError(
                        f"state of parameter {i}: {name} has shape {tuple(entry[name].shape)}, "
                        f"the parameter {tuple(param.shape)}"
                    )

    # -- the layout and the kernel ---------------------------------------------------------------------
    def _check_group(self, group: dict[str, Any], where: str) -> None:
        _check_adamw_group(group, where)

    def state_numel(self, sg: SubGroup) -> int:
        return len(self._parts(sg)) * sg.numel

    def _parts(self, sg: SubGroup) -> tuple[str, ...]:
        """The parts of the sub-group's state object, in order (`STATE_PARTS`): a master row if its
        group has a low-precision parameter, the moments, and ``max_exp_avg_sq`` for ``amsgrad``."""
        parts = STATE_PARTS if self._layouts[sg.group]["amsgrad"] else STATE_PARTS[:-1]
        if all(self._own_masters[number] for number in self._group_params(sg.group)):
            return parts[1:]
        return parts

    def _row_parts(self, sg: SubGroup) -> tuple[tuple[str, RowKind], ...]:
        return tuple((part, PART_KINDS[part]) for part in self._parts(sg))

    def _entry_parts(self, param: int, group: int) -> tuple[str, ...]:
        """The state parts of parameter ``param`` (of group ``group``) in a state dict: its group's,
        without ``master_param`` for an fp32 parameter (its own master)."""
        parts = self._parts(SubGroup(0, group, 0, ()))
        return tuple(p for p in parts if p != "master_param" or not self._own_masters[param])

    def _rows(self, sg: SubGroup, state: torch.Tensor) -> dict[str, torch.Tensor]:
        """The sub-group's state object as one view per part."""
        parts = self._parts(sg)
        return dict(zip(parts, state.view(len(parts), sg.numel), strict=True))

    def _master_views(self, sg: SubGroup, state: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        master = self._rows(sg, state).get("master_param")
        return [
            (piece, self._window(piece))
            if self._own_masters[piece.param] or master is None
            else (piece, master[piece.offset : piece.offset + piece.length])
            for piece in sg.pieces
        ]

    def _update(self, sg: SubGroup, state: torch.Tensor, coefficient: float) -> None:
        """One fused AdamW call per cache-sized chunk of the sub-group's pieces that have gradients."""
        for grads in self._gradient_chunks(sg, coefficient):
            self._adamw(sg, state, grads)

    def _host_update(self, sg: SubGroup, stored: torch.Tensor, coefficient: float) -> None:
        """An ``"int8-compensated"`` sub-group of bf16 parameters in one pass over its packed state
        where the CPU runs it (`adamw_int8_compensated`: the same bits), else unpacked, updated and
        packed a span at a time."""
        if not self._packed_update(sg, stored, coefficient):
            super()._host_update(sg, stored, coefficient)

    def _packed_update(self, sg: SubGroup, stored: torch.Tensor, coefficient: float) -> bool:
        """`adamw_int8_compensated` on the stored object, where its conditions hold: whether it
        ran."""
        group = self.param_groups[sg.group]
        if (
            self.precision != PRESETS["int8-compensated"]
            or self.device is not None
            or group["amsgrad"]
            or not group["decoupled_weight_decay"]
            or tuple(kind for _, kind in self._row_parts(sg)) != ("master", "signed", "nonnegative")
            or any(
                self._own_masters[piece.param] or self.params[piece.param].dtype != torch.bfloat16
                for piece in sg.pieces
            )
        ):
            return False
        grads = {piece.offset: flat for piece, flat in self._pieces_with_gradients(sg)}
        if any(grad.dtype != torch.bfloat16 for grad in grads.values()):
            return False
        pieces = [
            (
                piece.offset,
                self._window(piece),
                None
                if piece.offset not in grads
                else grads[piece.offset][piece.param_offset : piece.param_offset + piece.length],
                self.param_steps[piece.param],
            )
            for piece in sg.pieces
        ]
        layout = self._packed_layout(sg)
        compensation = layout.compensation(stored)
        assert compensation is not None
        moments = (layout.quantised(stored, 1), layout.quantised(stored, 2))
        return adamw_int8_compensated(moments, compensation, pieces, group, coefficient)

    def _adamw(self, sg: SubGroup, state: torch.Tensor, grads: list[tuple[Piece, torch.Tensor]]) -> None:
        group = self.param_groups[sg.group]
        windows = {
            part: [row[piece.offset : piece.offset + piece.length] for piece, _ in grads]
            for part, row in self._rows(sg, state).items()
        }
        steps = [self._step_tensor(self.param_steps[piece.param]) for piece, _ in grads]  # own corrections
        # An fp32 parameter's own memory is its master weights; the others' are in the state.
        weights = [
            self._window(piece) if self._own_masters[piece.param] else windows["master_param"][number]
            for number, (piece, _) in enumerate(grads)
        ]
        beta1, beta2 = group["betas"]
        # torch.optim.AdamW(fused=True)'s arithmetic (torch.optim.Adam(fused=True)'s, L2 weight
        # decay, for decoupled_weight_decay=False); a step count per tensor
        kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        kernel(
            weights,
            [grad for _, grad in grads],
            windows["exp_avg"],
            windows["exp_avg_sq"],
            windows.get("max_exp_avg_sq", []),
            steps,
            amsgrad=group["amsgrad"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=None,
            found_inf=None,
        )
        for (piece, _), updated in zip(grads, weights, strict=True):
            if not self._own_masters[piece.param]:  # fp32 parameters were updated in place
                self._copy_to_model(piece, updated)

    # -- state plumbing -----------------------------------------------------------------------------
    def _fill(self, sg: SubGroup, state: torch.Tensor, *, saved: dict[Any, Any] | None) -> None:
        """Lay out a sub-group's state from per-parameter tensors (or fresh: master = parameter).
        An fp32 parameter's window of a master row is unused: zeros, whatever its entry holds."""
        for part, row in self._rows(sg, state).items():
            for piece in sg.pieces:
                window = row[piece.offset : piece.offset + piece.length]
                source = slice(piece.param_offset, piece.param_offset + piece.length)
                entry = None if saved is None else saved.get(piece.param, saved.get(str(piece.param)))
                if part == "master_param" and self._own_masters[piece.param]:
                    window.zero_()
                elif entry is not None and part in entry:
                    window.copy_(self._local(entry[part]).detach().reshape(-1)[source])
                elif part == "master_param":
                    window.copy_(self._window(piece))
                else:
                    window.zero_()

    def _state_entries(self) -> list[dict[str, Any]]:
        """Per parameter, its state parts (``torch.optim.AdamW``'s, and the fp32 ``master_param`` of
        a low-precision parameter) as whole fp32 tensors of its shape; in a compensated
        `precision`, a low-precision parameter's stored compensation terms too
        ([`COMPENSATION_ENTRY`][tierstore.optimizer.state_precision.COMPENSATION_ENTRY], bf16)."""
        gathered: list[dict[str, Any]] = [
            {
                part: torch.empty(self._local(param).shape, dtype=torch.float32)
                for part in self._entry_parts(number, group)
            }
            for number, (param, group) in enumerate(zip(self.params, self._param_groups_of(), strict=True))
        ]
        for sg in self.subgroups:
            stored = self.stager.read(sg.index)  # read once for the rows and the compensation terms
            for part, row in self._rows(sg, self._unpacked(sg, stored)).items():
                for piece in sg.pieces:
                    whole = gathered[piece.param].get(part)
                    if whole is not None:
                        whole.view(-1)[piece.param_offset : piece.param_offset + piece.length].copy_(
                            row[piece.offset : piece.offset + piece.length]
                        )
            for piece, terms in self._compensations(sg, stored):
                whole = gathered[piece.param].setdefault(
                    COMPENSATION_ENTRY,
                    torch.empty(self._local(self.params[piece.param]).shape, dtype=torch.bfloat16),
                )
                whole.view(-1)[piece.param_offset : piece.param_offset + piece.length].copy_(terms)
        return gathered


def _check_adamw_group(group: dict[str, Any], where: str) -> None:
    """An AdamW group's keys (the defaults, or a parameter group's): a [`ConfigError`][] naming the
    key for a bad one or a kernel this optimizer does not run; ``fused`` is set to True (the kernel
    it runs)."""
    _check_flags(group, where, ("amsgrad", "maximize", "decoupled_weight_decay"))
    _check_hyperparameters(group, where)
    for key, honoured in KERNEL_KEYS.items():
        value = group.get(key)
        if not (value is None or isinstance(value, bool)) or value not in honoured:
            allowed = " or ".join(repr(v) for v in honoured)
            raise ConfigError(
                f"{where}{key}: the offloaded AdamW runs torch's fused AdamW kernel on the CPU "
                f"(torch.optim.AdamW(fused=True)'s arithmetic) and honours {key}={allowed} only, got "
                f"{value!r}"
            )
    group["fused"] = True


def _check_flags(group: dict[str, Any], where: str, names: tuple[str, ...]) -> None:
    """Boolean hyper-parameters (``amsgrad``, ``maximize``...): a [`ConfigError`][] naming the
    key."""
    for name in names:
        if not isinstance(group.get(name), bool):
            raise ConfigError(f"{where}{name}: must be True or False, got {group.get(name)!r}")


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    """AdamW's hyper-parameters (the defaults, or a parameter group's): a [`ConfigError`][] naming
    the field, rather than a wrong update or a failure deep inside the first step."""
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
