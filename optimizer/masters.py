"""Master weights of the offloaded optimizers, and the checks that keep them and the state's layout
consistent with the model.

A low-precision (bf16, fp16) parameter's fp32 master weights are part of its sub-group's state, and
the model receives them rounded after each update. An fp32 parameter is its own master: the kernel
updates the parameter in place and the state holds no copy of it, so weights the model is given
outside the optimizer (``model.load_state_dict``) are the ones the next step updates, as with
torch's optimizers. Whether a parameter is fp32 is read when its group is added and lays out its
state, so it cannot change afterwards (`check_dtypes`), and a state dict's or checkpoint's master
weights are taken only if their parameter rounds from them (`stale_entries`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import BufferMismatchError, ConfigError, TierStoreError


class StaleMasterWeightsError(BufferMismatchError):
    """A state dict's or checkpoint's fp32 master weights (``master_param``) that their
    low-precision parameter no longer rounds from: the model's weights changed after the master
    weights were saved (another optimizer trained on, carrying the entry along unchanged, or the
    model's weights were loaded after the optimizer's). Using them would silently revert the
    model's weights at the next step. The message names the parameters and what to do: load the
    model's weights that belong to the optimizer's state first, or drop ``master_param`` from the
    entries to take the parameters as master weights."""


def stale_masters_error(
    source: str, params: list[int], shapes: list[tuple[int, ...]]
) -> StaleMasterWeightsError:
    """The `StaleMasterWeightsError` for ``params`` (their numbers and shapes), whose master weights
    in ``source`` their parameters do not round from."""
    named = ", ".join(
        f"{number} (shape {shape})" for number, shape in zip(params[:5], shapes[:5], strict=True)
    )
    more = f" and {len(params) - 5} more" if len(params) > 5 else ""
    return StaleMasterWeightsError(
        f"{source}: the master_param of parameter {named}{more} is stale: the model's weights do not "
        "round from it (they changed after it was saved, e.g. trained on by another optimizer that "
        "carried master_param along, or loaded after the optimizer's state), and the next step would "
        "revert them to it. Load the model's weights that belong to this state first, or drop "
        "'master_param' from the state entries to take the model's current weights as master weights"
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaNs and signed zeros
    included)."""
    return a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


def rounds_from(master: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether the low-precision ``weights`` are ``master`` rounded to their dtype (on their
    device), to the bit."""
    return same_bits(master.to(device=weights.device, dtype=weights.dtype), weights)


def stale_entries(
    params: Sequence[torch.Tensor], own_masters: Sequence[bool], masters: Sequence[torch.Tensor | None]
) -> list[int]:
    """The low-precision parameters that do not round from their entry's ``master_param``.

    Args:
        params: the parameters (the parts the optimizer steps).
        own_masters: per parameter, whether it is fp32 (its own master: a ``master_param`` of its
            is not used, so not checked).
        masters: per parameter, its entry's ``master_param`` (the part matching ``params``), or
            None for none.
    """
    return [
        number
        for number, (param, own, master) in enumerate(zip(params, own_masters, masters, strict=True))
        if master is not None and not own and not rounds_from(master.detach(), param.detach())
    ]


def check_dtypes(params: Sequence[torch.Tensor], own_masters: Sequence[bool]) -> None:
    """A [`ConfigError`][] for a parameter (the part the optimizer steps) that became fp32, or
    stopped being fp32, since its group was added (``own_masters``): whether it is its own master
    lays out its state."""
    for number, (param, own) in enumerate(zip(params, own_masters, strict=True)):
        if (param.dtype == torch.float32) != own:
            raise ConfigError(
                f"parameter {number} (shape {tuple(param.shape)}) is {param.dtype} now and "
                f"was {'fp32' if own else 'of a lower precision'} when its group was added: its state is "
                "laid out for that (an fp32 parameter is its own master weights, a low-precision one "
                "has fp32 master weights in the state); build the optimizer after converting the model"
            )


def check_own_masters(
    saved: Sequence[bool], own_masters: Sequence[bool], source: str | os.PathLike[str]
) -> None:
    """A [`BufferMismatchError`][] if a snapshot's parameters were their own masters (fp32,
    ``saved``) where this optimizer's are not (``own_masters``), or the reverse: their states are
    laid out differently."""
    differ = [n for n, (was, now) in enumerate(zip(saved, own_masters, strict=False)) if was != now]
    if len(saved) != len(own_masters) or differ:
        raise BufferMismatchError(
            f"{source}: its state is laid out for parameters of other dtypes: parameters {differ[:5]} "
            "were fp32 (their own master weights, none in the state) where they are low-precision "
            "here (fp32 master weights in the state), or the reverse; load it into an optimizer over "
            "parameters of the dtypes it was saved with"
        )


def check_layouts(
    groups: Sequence[dict[str, Any]],
    layouts: Sequence[dict[str, Any]],
    source: str,
    error: type[TierStoreError],
) -> None:
    """Refuse groups whose layout keys differ from ``layouts`` (per group, the values its state in
    the store is laid out by), with ``error`` naming the first such key in ``source``."""
    for number, (group, layout) in enumerate(zip(groups, layouts, strict=False)):
        for key, value in layout.items():
            if group.get(key) != value:
                raise error(
                    f"{source}.{number}.{key} is {group.get(key)!r}, but this optimizer's state is "
                    f"laid out for {value!r} (the layout depends on it: construct an optimizer "
                    "with the new value instead)"
                )
