"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with its optimizer state offloaded through tierstore.

One line replaces ``torch.optim.AdamW`` in a training script that shards its model with
``fully_shard``::

    optimizer = FSDPOffloadedAdamW(model, store, lr=3e-4, dram_budget=256 << 20)

Each rank stages the state of its own local shards through its own store (namespace
``rank<N>/adamw``): fp32 masters and both moments for a bf16-sharded model, the moments only when
the sharded parameters are fp32 (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``). DCP
checkpoints ([`save`][], [`load`][]) stream the state between the store and the checkpoint and
reshard it to any number of ranks. See `optimizer` and `checkpoint`;
``python -m tierstore.integrations.fsdp.example`` trains a small GPT this way.
"""

from __future__ import annotations

from .checkpoint import StateStream, StreamingLoadPlanner, StreamingSavePlanner, load, save
from .optimizer import (
    FSDPOffloadedAdamW,
    FSDPSetupError,
    check_fsdp_model,
    like_parameter,
    local_shard,
)

__all__ = [
    "FSDPOffloadedAdamW",
    "FSDPSetupError",
    "StateStream",
    "StreamingLoadPlanner",
    "StreamingSavePlanner",
    "check_fsdp_model",
    "like_parameter",
    "load",
    "local_shard",
    "save",
]
