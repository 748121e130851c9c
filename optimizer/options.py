"""The staging options of the offloaded optimizers, each defined once.

:class:`~tierstore.optimizer.staging.SubGroupStager` (so :class:`~tierstore.optimizer.OffloadedAdamW`
and :class:`~tierstore.optimizer.OffloadedAPOLLO`) checks its keyword arguments through
:class:`StagingOptions`, and the DeepSpeed config's ``tierstore`` section takes the same keys
through the same fields (:mod:`tierstore.integrations.deepspeed.config`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, Field

from .._checks import ConfigModel

CachePolicy = Literal["model", "static", "none"]


class StagingOptions(ConfigModel):
    """How an optimizer stages its fp32 state through DRAM."""

    dram_budget: ByteSize | None = None
    """DRAM for staging the state (per rank): the read-ahead ring, the fp32 gradient buffer and the
    sub-groups kept between steps. None: the ring and the gradient buffer only (nothing kept)."""
    prefetch_depth: int = Field(2, ge=1, strict=True)
    """Sub-groups read ahead of the one being updated (the ring's buffers)."""
    cache_policy: CachePolicy = "model"
    """Which sub-groups stay in DRAM across steps: the I/O model's choice (``model``),
    MLP-Offload's last K (``static``), or none (``none``)."""
