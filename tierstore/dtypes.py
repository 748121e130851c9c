"""Torch dtypes by name, as manifests, snapshots and checkpoints store them (``"bfloat16"``...)."""

from __future__ import annotations

import torch

from .errors import BufferMismatchError, TierStoreError


def dtype_name(dtype: torch.dtype) -> str:
    """The name `dtype_from_name` reads back."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str, error: type[TierStoreError] = BufferMismatchError) -> torch.dtype:
    """The torch dtype called ``name``; ``error`` naming ``where`` otherwise (a name that is not
    a dtype, such as ``"Tensor"``, is refused too)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise error(f"{where} has unknown dtype {name!r}")
    return dtype
