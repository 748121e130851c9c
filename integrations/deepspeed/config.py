"""The ``tierstore`` section of a DeepSpeed config, validated by pydantic (no DeepSpeed import).

DeepSpeed keeps unknown top-level sections and hands the raw dict to the ZeRO-3 optimizer; every
other place (``zero_optimization``, ``offload_optimizer``, ``aio``) rejects or silently drops
unknown keys, so the section sits at the top level::

    "tierstore": {
        "tiers": [{"name": "nvme", "paths": [
            {"backend": "nvme:///local/nvme/ts", "max_writes": 8},
            {"backend": "zarr:///lustre/me/ts", "node_limit": {"key": "lustre", "max_writes": 2}}]}],
        "dram_budget": "8GiB",
        "prefetch_depth": 2,
        "cache_policy": "model",
        "order": "alternate",
        "state_precision": "int8-compensated",
        "activations": {"budget": "2GiB", "min_bytes": "1MiB", "plan": "lifetime"}
    }

Each key is the option it configures, as that option is defined once: the optimizer's staging
options ([`StagingOptions`][]) and its ``state_precision`` ([`OptimizerOptions`][]), the store's
``tiers`` and ``workers`` (`tierstore.config`), and the activation offload's options
(`ActivationOptions`). Without ``tiers``, one NVMe tier under
``offload_optimizer.nvme_path`` is used. A key of the section or of ``activations`` set to
``"auto"`` (Hugging Face's placeholder) takes its default; ``"auto"`` anywhere else in the section
is an error naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ByteSize, Field, ValidationError
from tierstore.activations.options import ActivationOptions
from tierstore.optimizer.options import OptimizerOptions, StagingOptions
from tierstore.optimizer.state_precision import StatePrecision

from tierstore._checks import defined_in
from tierstore.config import CacheConfig, StoreConfig, StoreOptions, TierConfig
from tierstore.errors import ConfigError, config_error_from_validation

SECTION = "tierstore"
AUTO = "auto"


class ActivationsSection(ActivationOptions):
    """``tierstore.activations``: the options of [`tierstore.activations.ActivationOffload`][],
    applied around the engine's forward on the optimizer's store."""


class TierstoreSection(StagingOptions):
    """The ``tierstore`` section: the optimizer's staging options ([`StagingOptions`][]) and
    ``state_precision``, the store's ``tiers`` and ``workers`` (as in a store config), and what the
    engine does with them."""

    tiers: list[TierConfig] | None = Field(None, min_length=1)
    """Where the optimizer state goes, as a store config's ``tiers`` (virtual tiers,
    ``node_limit`` for a shared PFS...); none: one NVMe tier at
    ``<nvme_path>/tierstore/rank<N>``."""
    workers: int = defined_in(StoreOptions, "workers")
    state_precision: StatePrecision = defined_in(OptimizerOptions, "state_precision")
    order: Literal["alternate", "ascending"] = "alternate"
    """Sub-group order per step: ``alternate`` forward/reverse (cache-friendly), or DeepSpeed's own
    ``ascending``."""
    activations: ActivationsSection | None = None
    """Spill the activations saved in forward through the same store (none: keep them in memory);
    the engine's ``tierstore_activations`` has their ``stats()`` and ``plan_explain()``."""

    def default_tier_path(self, nvme_path: str | Path, rank: int) -> Path | None:
        """The directory of the rank's default tier, ``<nvme_path>/tierstore/rank<N>``; None where
        the section gives ``tiers``."""
        return None if self.tiers else Path(nvme_path) / "tierstore" / f"rank{rank}"

    def store_config(self, nvme_path: str | Path, rank: int) -> StoreConfig:
        """The rank's store: no store-level cache (the stager holds the DRAM), default tier on
        ``nvme_path``."""
        default = self.default_tier_path(nvme_path, rank)
        tiers = self.tiers or [TierConfig(name="nvme", backend={"type": "nvme", "path": str(default)})]
        return StoreConfig(cache=CacheConfig(budget=ByteSize(0)), tiers=tiers, workers=self.workers)


def parse_section(ds_config: Mapping[str, Any]) -> TierstoreSection:
    """The validated ``tierstore`` section of a DeepSpeed config dict."""
    raw = ds_config.get(SECTION)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{SECTION}: the DeepSpeed config needs a '{SECTION}' section (a mapping)")
    section = _without_auto(raw)
    if isinstance(section.get("activations"), Mapping):
        section["activations"] = _without_auto(section["activations"])
    _refuse_auto(section, SECTION)
    try:
        return TierstoreSection.model_validate(section)
    except ValidationError as error:
        raise config_error_from_validation(error, SECTION) from None


def _without_auto(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in raw.items() if value != AUTO}


def _refuse_auto(value: Any, field: str) -> None:
    """An ``"auto"`` left where no default applies (inside ``tiers``) names its field."""
    if value == AUTO:
        raise ConfigError(f"{field}: 'auto' has no default here; give the value")
    items = (
        value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in items:
        _refuse_auto(item, f"{field}.{key}")
