"""The staging options of the offloaded optimizers, each defined once.

Every option is a field of [`OptimizerOptions`][] (its type, default, range and meaning, the
docstring under it). [`OffloadedAdamW`][], [`OffloadedAPOLLO`][] and
[`FSDPOffloadedAdamW`][tierstore.integrations.fsdp.FSDPOffloadedAdamW] take them as keyword
arguments, ``**staging``, typed for their callers by [`StagingKeywords`][] (a test holds its keys
equal to the fields), and check them through the fields (`optimizer_options`). The three that
`SubGroupStager` takes are [`StagingOptions`][], which the DeepSpeed config's ``tierstore`` section
takes through the same fields (`tierstore.integrations.deepspeed.config`), as it takes
``state_precision`` (`defined_in`).

An option is added as a field of [`OptimizerOptions`][] (or of [`StagingOptions`][], where the
DeepSpeed section takes it too) and its key in [`StagingKeywords`][]; the optimizers read it from
the checked options.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypedDict

from pydantic import BeforeValidator, ByteSize, Field, field_validator

from .._checks import ConfigModel, Takes, check_arguments, is_integer
from ..errors import ConfigError
from .state_precision import PRESETS, StatePrecision, state_precision

CachePolicy = Literal["model", "static", "none"]


def _checked_precision(value: Any) -> StatePrecision:
    """``value`` as a [`StatePrecision`][]
    ([`state_precision`][tierstore.optimizer.state_precision.state_precision]), or a ``ValueError``
    that pydantic reports naming the field."""
    try:
        return state_precision(value)
    except ConfigError as error:
        raise ValueError(str(error).removeprefix("state_precision: ")) from None


Precision = Annotated[
    StatePrecision,
    BeforeValidator(_checked_precision),
    Takes(f"{', '.join(repr(name) for name in PRESETS)}, or a table of `moments` and `master`"),
]
"""The type of the ``state_precision`` option: a preset's name, a [`StatePrecision`][] or a mapping
of its fields, held as a [`StatePrecision`][]."""


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


class OptimizerOptions(StagingOptions):
    """Every staging option of an offloaded optimizer: how its state is cut, staged and updated."""

    sub_group_size: int = Field(100_000_000, ge=1, strict=True)
    """Parameter elements per sub-group, the unit staged through DRAM (a rank's own elements
    under FSDP2)."""
    max_grad_norm: float | None = None
    """Clip the global gradient norm (over all ranks under FSDP2) to this, as ``clip_grad_norm_``
    does; None for no clipping."""
    compute_threads: int | None = Field(None, ge=1, strict=True)
    """Threads torch's CPU kernels use during a step; None for one fewer than torch's setting (at
    least one), leaving a core to the store's I/O."""
    gpu_budget: ByteSize | None = None
    """Parameters on a GPU only: GPU memory for sub-groups that stay there between steps, which then
    never cross the bus; None or 0 for none (see [`tierstore.optimizer.device`][])."""
    state_precision: Precision = Field("fp32", validate_default=True)
    """How the state is stored and moved: a preset's name (``"fp32"``, exact; ``"bf16"`` moments;
    ``"int8"`` blockwise-quantised moments; ``"int8-compensated"``, with a bf16-compensated master
    for low-precision parameters) or a
    [`StatePrecision`][tierstore.optimizer.state_precision.StatePrecision] (see
    [`tierstore.optimizer.state_precision`][])."""

    @field_validator("max_grad_norm", mode="before")
    @classmethod
    def _positive_norm(cls, value: Any) -> Any:
        if value is None or (
            (is_integer(value) or isinstance(value, float)) and math.isfinite(value) and value > 0
        ):
            return value
        raise ValueError(f"must be None or a finite number > 0, not {value!r}")


class StagingKeywords(TypedDict, total=False):
    """[`OptimizerOptions`][] as an optimizer's keyword arguments
    (``**staging: Unpack[StagingKeywords]``), typed for its callers; the fields define their
    defaults, ranges and meanings. A size in bytes is an integer or text such as ``"64MiB"``."""

    dram_budget: int | str | None
    prefetch_depth: int
    cache_policy: CachePolicy
    sub_group_size: int
    max_grad_norm: float | None
    compute_threads: int | None
    gpu_budget: int | str | None
    state_precision: str | StatePrecision


def optimizer_options(owner: str, staging: Mapping[str, Any]) -> OptimizerOptions:
    """An optimizer's staging keyword arguments checked through [`OptimizerOptions`][].

    Args:
        owner: the optimizer's class name, for the message refusing a keyword that is no option.
        staging: the keyword arguments given; the others take their fields' defaults.

    Returns:
        Every option, given or default.

    Raises:
        TypeError: a keyword that is no staging option, as Python's own for an unexpected keyword
            argument.
        ConfigError: ``"<argument>: must be <requirement>, not <value>"`` for a value of the
            wrong type or out of range.
    """
    unknown = sorted(staging.keys() - OptimizerOptions.model_fields.keys())
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    return check_arguments(OptimizerOptions, staging)
