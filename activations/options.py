"""The options of [`ActivationOffload`][], each defined once: its keyword arguments and the
DeepSpeed config's ``tierstore.activations`` table validate through `ActivationOptions`."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import ByteSize

from .._checks import ConfigModel

Plan = Literal["lifetime", "all", "none"]
PLANS: tuple[Plan, ...] = get_args(Plan)
Scope = Literal["saved", "checkpoint-inputs"]
SCOPES: tuple[Scope, ...] = get_args(Scope)


class ActivationOptions(ConfigModel):
    """How the activations saved in forward are spilled."""

    budget: ByteSize = ByteSize(512 << 20)
    """Memory for saved tensors of at least ``min_bytes``: captures being written, tensors the
    plan keeps, and bytes read back ahead of backward or in use by it; reserved from the store's
    memory ledger."""
    min_bytes: ByteSize = ByteSize(1 << 20)
    """Smaller saved tensors stay in memory as autograd keeps them."""
    plan: Plan = "lifetime"
    """``lifetime``: profile a step, then keep in memory (or on the device) what cannot be hidden;
    ``all``: spill every eligible tensor (a device's: to host memory first, to storage beyond the
    budget); ``none``: keep everything (the hooks only count)."""
    device_budget: ByteSize = ByteSize(512 << 20)
    """Device memory for saved tensors of a device: tensors held while their copy to host memory
    runs, tensors left on the device, and tensors copied back ahead of backward's use."""
    scope: Scope = "saved"
    """``saved``: every tensor autograd saves in the block; ``checkpoint-inputs``: only the inputs
    of checkpointed regions (recompute and offload combined), the rest stays as autograd keeps
    it."""
