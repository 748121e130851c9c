"""Stock DeepSpeed ZeRO-3 with its optimizer-state offload going through tierstore.

Add a top-level ``tierstore`` section to the DeepSpeed config (see :mod:`.config`) next to a
ZeRO-3 ``offload_optimizer`` with ``device: "nvme"``, and call this package's :func:`initialize`
where you called ``deepspeed.initialize``::

    from tierstore.integrations import deepspeed as ts_deepspeed
    engine, optimizer, _, _ = ts_deepspeed.initialize(model=model, model_parameters=params, config=cfg)

Everything else (``engine.backward``, ``engine.step``, ``save_checkpoint``, ``load_checkpoint``)
is DeepSpeed's own. With ``tierstore.activations`` in the section, the engine's forward also
spills the activations it saves through the same store (``engine.tierstore_activations``).
No DeepSpeed file is edited; the seams are in :mod:`.seams`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from tierstore.errors import ConfigError, UnsupportedVersionError

from .config import SECTION, TierstoreSection, parse_section

__all__ = ["SECTION", "TierstoreSection", "check_deepspeed_version", "initialize", "validate_config"]


def supported_versions() -> str:
    """The DeepSpeed versions this install supports: the ``deepspeed`` extra's specifier."""
    from packaging.requirements import Requirement

    for text in metadata.requires("tierstore") or []:
        requirement = Requirement(text)
        if requirement.name == "deepspeed":
            return str(requirement.specifier)
    raise UnsupportedVersionError("tierstore's metadata names no supported DeepSpeed version")


def check_deepspeed_version(installed: str | None = None) -> str:
    """The installed DeepSpeed version, or :class:`UnsupportedVersionError` if it is missing or
    outside the supported range."""
    from packaging.specifiers import SpecifierSet

    supported = supported_versions()
    if installed is None:
        try:
            installed = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            raise UnsupportedVersionError(
                f"DeepSpeed is not installed; pip install 'tierstore[deepspeed]' (deepspeed{supported})"
            ) from None
    if installed not in SpecifierSet(supported, prereleases=True):
        raise UnsupportedVersionError(
            f"DeepSpeed {installed} is not supported: tierstore plugs into deepspeed{supported} "
            "(pip install 'tierstore[deepspeed]')"
        )
    return installed


def validate_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The DeepSpeed config as a dict, checked for what tierstore needs; errors name the field."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as source:
                config = json.load(source)
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(f"cannot read the DeepSpeed config {config}: {error}") from None
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"the DeepSpeed config must be a mapping or a JSON file, not {type(config).__name__}"
        )
    config = dict(config)
    parse_section(config)
    zero = config.get("zero_optimization") or {}
    if zero.get("stage") != 3:
        raise ConfigError(
            f"zero_optimization.stage: tierstore offloads ZeRO-3 optimizer state; got {zero.get('stage')!r}"
        )
    offload = zero.get("offload_optimizer") or {}
    if offload.get("device") != "nvme" or not offload.get("nvme_path"):
        raise ConfigError(
            "zero_optimization.offload_optimizer: tierstore replaces ZeRO-Infinity's NVMe swapping of "
            "optimizer state, so set device 'nvme' and an nvme_path (where checkpoints stage the state)"
        )
    if offload.get("super_offload"):
        raise ConfigError("zero_optimization.offload_optimizer.super_offload: not supported with tierstore")
    optimizer_type = str((config.get("optimizer") or {}).get("type", "")).lower()
    if optimizer_type not in ("adam", "adamw"):
        got = optimizer_type or "no optimizer section"
        raise ConfigError(f"optimizer.type: tierstore stages Adam/AdamW state; got {got!r}")
    offload_param = zero.get("offload_param") or {}
    if offload_param.get("device") == "nvme" and offload.get("fast_init"):
        raise ConfigError(
            "zero_optimization.offload_optimizer.fast_init: must be false when offload_param.device is 'nvme'"
        )
    return config


def initialize(*, config: Mapping[str, Any] | str | os.PathLike[str], **kwargs: Any) -> Any:
    """``deepspeed.initialize`` with tierstore as the ZeRO-3 optimizer-state offload.

    Takes the same keyword arguments (``model``, ``model_parameters``, ``training_data``...) except
    a client ``optimizer``: the config's Adam/AdamW section builds it.
    """
    check_deepspeed_version()
    if kwargs.get("optimizer") is not None:
        raise ConfigError("optimizer: pass the optimizer through the config's 'optimizer' section")
    checked = validate_config(config)
    section = parse_section(checked)
    import deepspeed

    from .seams import offload_activations, substituted_optimizer

    with substituted_optimizer():
        result = deepspeed.initialize(config=checked, **kwargs)
    if section.activations is not None:
        offload_activations(result[0], section.activations)
    return result
