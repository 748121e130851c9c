"""Stock DeepSpeed ZeRO-3 with its optimizer-state offload going through tierstore.

Add a top-level ``tierstore`` section to the DeepSpeed config (see `config`) next to a ZeRO-3
``offload_optimizer`` with ``device: "nvme"``, and call this package's [`initialize`][] where you
called ``deepspeed.initialize``::

    from tierstore.integrations import deepspeed as ts_deepspeed
    engine, optimizer, _, _ = ts_deepspeed.initialize(model=model, model_parameters=params, config=cfg)

Everything else (``engine.backward``, ``engine.step``, ``save_checkpoint``, ``load_checkpoint``) is
DeepSpeed's own. With ``tierstore.activations`` in the section, the engine's forward also spills the
activations it saves through the same store (``engine.tierstore_activations``). No DeepSpeed file is
edited; the seams are in `seams`.

Where DeepSpeed is started by someone else (Hugging Face ``Trainer``, Accelerate), [`enable`][]
routes every later ``deepspeed.initialize`` whose config has a ``tierstore`` section through
[`initialize`][]; configs without one stay on stock DeepSpeed. ``TIERSTORE_DEEPSPEED=1`` does the
same without code (see `hook`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

from tierstore.errors import ConfigError, UnsupportedVersionError

from . import hook
from .config import AUTO, SECTION, TierstoreSection, parse_section

__all__ = [
    "SECTION",
    "TierstoreSection",
    "check_deepspeed_version",
    "check_huggingface_versions",
    "disable",
    "enable",
    "initialize",
    "is_enabled",
    "validate_config",
]

_READ_BY_TIERSTORE = (  # "auto" here: neither Trainer/Accelerate nor tierstore can fill it
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.nvme_path",
    "optimizer.type",
)


def supported_versions(package: str = "deepspeed", extra: str = "deepspeed") -> str:
    """The versions of ``package`` this install supports.

    Args:
        package: the distribution's name.
        extra: the tierstore extra that requires it.

    Returns:
        Its version specifier in tierstore's ``extra`` (``">=0.19.8,<0.20"``, say).

    Raises:
        UnsupportedVersionError: tierstore's metadata names no version of ``package`` for ``extra``.
    """
    from packaging.requirements import Requirement

    for text in metadata.requires("tierstore") or []:
        requirement = Requirement(text)
        if (
            requirement.name == package
            and requirement.marker is not None
            and requirement.marker.evaluate({"extra": extra})
        ):
            return str(requirement.specifier)
    raise UnsupportedVersionError(f"tierstore's metadata names no supported {package} version")


def _check_version(package: str, extra: str, installed: str | None, required: bool) -> str | None:
    from packaging.specifiers import SpecifierSet

    supported = supported_versions(package, extra)
    name = {"deepspeed": "DeepSpeed", "accelerate": "Accelerate"}.get(package, package)
    if installed is None:
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            if not required:
                return None
            raise UnsupportedVersionError(
                f"{name} is not installed; pip install 'tierstore[{extra}]' ({package}{supported})"
            ) from None
    if installed not in SpecifierSet(supported, prereleases=True):
        raise UnsupportedVersionError(
            f"{name} {installed} is not supported: tierstore is tested with {package}{supported} "
            f"(pip install 'tierstore[{extra}]')"
        )
    return installed


def check_deepspeed_version(installed: str | None = None) -> str:
    """The installed DeepSpeed version, checked against the supported range.

    Args:
        installed: the version to check; None for the installed distribution's.

    Returns:
        The version.

    Raises:
        UnsupportedVersionError: DeepSpeed is not installed, or its version is outside the range
            of tierstore's ``deepspeed`` extra.
    """
    version = _check_version("deepspeed", "deepspeed", installed, required=True)
    assert version is not None  # required: a missing DeepSpeed raised
    return version


def check_huggingface_versions(installed: Mapping[str, str] | None = None) -> dict[str, str]:
    """The installed transformers/accelerate versions, checked against the supported ranges: they
    decide how the config reaches ``deepspeed.initialize``.

    Args:
        installed: the versions to check, by package name; None (or a package left out) for the
            installed distribution's.

    Returns:
        By package name, the version of each of the two that is present.

    Raises:
        UnsupportedVersionError: a present one's version is outside the range of tierstore's
            ``huggingface`` extra.
    """
    found = {}
    for package in ("transformers", "accelerate"):
        version = _check_version(package, "huggingface", (installed or {}).get(package), required=False)
        if version is not None:
            found[package] = version
    return found


def validate_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The DeepSpeed config as a dict, checked for what tierstore needs.

    ``"auto"`` (Hugging Face's placeholder) is accepted where DeepSpeed or ``Trainer`` resolves it
    and, in the ``tierstore`` section, means the field's default; in a field tierstore itself must
    read (ZeRO stage, offload device and path, optimizer type) it is refused.

    Args:
        config: the DeepSpeed config, as a mapping or the path of a JSON file.

    Returns:
        The config as a dict.

    Raises:
        ConfigError: the file cannot be read; or a bad ``tierstore`` section, a ZeRO stage other
            than 3, an ``offload_optimizer`` without ``device: "nvme"`` and an ``nvme_path`` (or
            with ``super_offload``), an optimizer type other than Adam/AdamW, ``fast_init`` with
            NVMe parameter offload, or ``"auto"`` where tierstore must read the value. The
            message names the field.
    """
    config = read_config(config)
    for field in _READ_BY_TIERSTORE:
        if _lookup(config, field) == AUTO:
            raise ConfigError(
                f"{field}: 'auto' is resolved by neither Trainer/Accelerate nor tierstore; give the value"
            )
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


def read_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed config, as a dict.

    Args:
        config: a mapping, or the path of a JSON file.

    Returns:
        A shallow copy of the mapping, or the file's contents.

    Raises:
        ConfigError: the file cannot be read or is not JSON, or the config is not a mapping.
    """
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
    return dict(config)


def _lookup(config: Mapping[str, Any], field: str) -> Any:
    value: Any = config
    for key in field.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def initialize(
    *,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    config_params: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> Any:
    """``deepspeed.initialize`` with tierstore as the ZeRO-3 optimizer-state offload.

    Takes the same keyword arguments (``model``, ``model_parameters``, ``training_data``...) except
    a client ``optimizer``: the config's Adam/AdamW section builds it. With an ``activations``
    entry in the ``tierstore`` section, the engine also offloads the activations its forward saves
    (``engine.tierstore_activations``).

    Args:
        config: the DeepSpeed config (a mapping or the path of a JSON file), with a ``tierstore``
            section (see [`TierstoreSection`][]).
        config_params: the same, as Accelerate passes it; give exactly one of the two.
        **kwargs: ``deepspeed.initialize``'s other keyword arguments, passed on.

    Returns:
        What ``deepspeed.initialize`` returns: ``(engine, optimizer, dataloader, lr_scheduler)``.

    Raises:
        UnsupportedVersionError: DeepSpeed is missing or outside the supported range.
        ConfigError: a client ``optimizer`` is given, neither or both of ``config`` and
            ``config_params`` are, or the config fails [`validate_config`][].
    """
    check_deepspeed_version()
    if kwargs.get("optimizer") is not None:
        raise ConfigError("optimizer: pass the optimizer through the config's 'optimizer' section")
    source = config if config is not None else config_params
    if source is None or (config is not None and config_params is not None):
        raise ConfigError("config: give the DeepSpeed config as exactly one of config or config_params")
    checked = validate_config(source)
    section = parse_section(checked)
    import deepspeed

    from .seams import offload_activations, substituted_optimizer, tierstore_checkpoints

    with substituted_optimizer():
        result = _stock_initialize(deepspeed)(config=checked, **kwargs)
    tierstore_checkpoints(result[0])
    if section.activations is not None:
        offload_activations(result[0], section.activations)
    return result


_replaced: dict[str, Callable[..., Any]] = {}
"""DeepSpeed's own functions that [`enable`][] replaced, by name, until [`disable`][]."""


def _stock_initialize(deepspeed: Any) -> Callable[..., Any]:
    return _replaced.get("initialize", deepspeed.initialize)


def is_enabled() -> bool:
    """Whether tierstore routes ``deepspeed.initialize``.

    Returns:
        True once [`enable`][] has replaced ``deepspeed.initialize`` and until [`disable`][].
    """
    return "initialize" in _replaced


def enable() -> None:
    """Route every later ``deepspeed.initialize`` whose config (``config`` or ``config_params``) has
    a ``tierstore`` section through [`initialize`][]; others reach DeepSpeed untouched.

    Idempotent. Checks the DeepSpeed version, and transformers/accelerate where installed.

    Raises:
        UnsupportedVersionError: DeepSpeed is missing, or it or an installed transformers or
            accelerate is outside the supported range.
    """
    check_deepspeed_version()
    check_huggingface_versions()
    if is_enabled():
        return
    import deepspeed

    stock = deepspeed.initialize
    signature = inspect.signature(stock)

    @functools.wraps(stock)
    def routed(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        if not _has_section(arguments.get("config", arguments.get("config_params"))):
            return stock(*args, **kwargs)
        return initialize(**arguments)

    _replaced["initialize"] = stock
    deepspeed.initialize = routed


def disable() -> None:
    """Put DeepSpeed's own ``initialize`` back (a no-op when not enabled)."""
    if is_enabled():
        import deepspeed

        deepspeed.initialize = _replaced.pop("initialize")


def _has_section(config: Any) -> bool:
    """Whether a config (as ``deepspeed.initialize`` takes it) has a ``tierstore`` section; one
    that cannot be read is left to DeepSpeed to report."""
    if config is None:
        return False
    try:
        return SECTION in read_config(config)
    except ConfigError:
        return False


if hook.requested():  # TIERSTORE_DEEPSPEED=1 without the .pth (e.g. an install that skipped it)
    hook.install()
