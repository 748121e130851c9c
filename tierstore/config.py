"""The store's configuration document: a dict, a JSON file or a TOML file, validated by pydantic.

Example (TOML)::

    [cache]
    budget = "2GiB"           # DRAM cache byte budget (bytes or "512MiB", "2GB"...)
    policy = "write-back"     # or "write-through"

    [[tiers]]
    name = "nvme"
    backend = "nvme:///local/scratch/tierstore"   # a URL, or a table with a "type" field
    capacity = "100GiB"                            # optional

Every error names the offending field, e.g. ``tiers.0.backend: ...``.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError, config_error_from_validation

_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_byte_size(text: str | int) -> int:
    """Bytes from an integer or a string such as ``"64MiB"`` or ``"2GB"``."""
    if isinstance(text, bool):  # an int to Python, and 1 byte to pydantic
        raise ConfigError(f"{text!r} is not a size such as 4096, 64MiB or 2GB")
    try:
        return int(_BYTE_SIZE.validate_python(text))
    except ValidationError:
        raise ConfigError(f"{text!r} is not a size such as 4096, 64MiB or 2GB") from None


NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$"


def refuse_bool_as_number(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A ``mode="before"`` field check for every config model, the backends' options included:
    pydantic reads ``true`` as 1, so ``budget = true`` would be one byte and ``workers = true``
    one thread. A bool passes only where the field's type takes a bool."""
    field = model.model_fields.get(info.field_name or "")
    if isinstance(value, bool) and field is not None and not _admits_bool(field.annotation):
        raise ValueError(f"expected a number or a string, not the boolean {str(value).lower()}")
    return value


def _admits_bool(annotation: Any) -> bool:
    """Whether a field's type takes a bool as itself (``bool``, ``bool | None``, ``Any``...)."""
    return annotation is bool or annotation is Any or any(_admits_bool(arg) for arg in get_args(annotation))


class ConfigModel(BaseModel):
    """Base of the store's configuration models: unknown fields are errors, and so is a bool
    given for a number."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_bool_as_number(cls, value, info)


class CacheConfig(ConfigModel):
    budget: ByteSize = Field(ByteSize(256 << 20))
    """Bytes of DRAM the cache may hold (aligned buffers, pinned where CUDA exists)."""
    policy: Literal["write-back", "write-through"] = "write-back"
    """write-back: a put lands in DRAM and reaches a tier on eviction or flush.
    write-through: a put resolves once its tier write is done (and stays cached)."""
    cache_reads: bool = True
    """Keep objects read from a tier in the cache (False: read straight into the destination)."""
    pack_below: ByteSize = Field(ByteSize(64 << 10))
    """Dirty objects smaller than this are written back (``flush``, ``close``) in packs, one
    backend object per batch, instead of one object (file) each; 0 turns packing off."""


class BandwidthConfig(ConfigModel):
    """A path's bandwidth in bytes per second (e.g. ``"1.5GB"``), when known in advance."""

    read: ByteSize
    write: ByteSize


class NodeLimitConfig(ConfigModel):
    """Slots shared by every process on the node that names the same ``key`` (a shared PFS)."""

    key: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,100}$")
    max_reads: int = Field(1, ge=1, le=1024)
    max_writes: int = Field(1, ge=1, le=1024)
    directory: Path | None = None
    """Where the lock files live (default /dev/shm/tierstore-limits)."""


class PathConfig(ConfigModel):
    name: str | None = Field(None, pattern=NAME_PATTERN)
    backend: str | dict[str, Any]
    """A backend URL (``nvme:///path``) or a table with ``type`` and the backend's options."""
    max_reads: int = Field(4, ge=1, le=1024)
    """Read requests in flight on this path (each request is one object's extent)."""
    max_writes: int = Field(4, ge=1, le=1024)
    bandwidth: BandwidthConfig | None = None
    """Known bandwidth; otherwise probed (``probe = true``) or learned from traffic."""
    node_limit: NodeLimitConfig | None = None


class TierConfig(ConfigModel):
    name: str = Field(pattern=NAME_PATTERN)
    backend: str | dict[str, Any] | None = None
    """Shorthand for a tier of one path."""
    paths: list[PathConfig] | None = Field(None, min_length=1)
    """Several paths acting as one tier (MLP-Offload's virtual tier)."""
    placement: Literal["stripe", "place"] = "stripe"
    """stripe: split every object across the paths by bandwidth; place: whole objects per path."""
    stripe_by: Literal["round-trip", "write", "read"] = "round-trip"
    """Which bandwidth sets the shares: round-trip (objects written then read back), write, read."""
    adapt: bool = True
    """Re-weight the paths from their observed throughput (EWMA)."""
    probe: bool = False
    """Measure unconfigured paths' bandwidth when the store opens (cached on disk)."""
    capacity: ByteSize | None = None
    """Bytes this tier may hold; objects go to the first tier with room."""

    @model_validator(mode="after")
    def _one_way_to_give_paths(self) -> TierConfig:
        if (self.backend is None) == (self.paths is None):
            raise ValueError("give either 'backend' (one path) or 'paths' (several), not both or neither")
        return self

    def path_configs(self) -> list[PathConfig]:
        """The tier's paths, the one-path shorthand expanded."""
        if self.paths is not None:
            return self.paths
        assert self.backend is not None
        return [PathConfig(backend=self.backend)]


class StoreConfig(ConfigModel):
    cache: CacheConfig = CacheConfig()
    tiers: list[TierConfig] = Field(min_length=1)
    workers: int = Field(4, ge=1, le=256)
    """Threads that run put/get/prefetch (device I/O has its own threads in each backend)."""
    manifest: Path | None = None
    """Directory of the store's manifest: the store is persistent (reopening finds its objects).
    Without it the store is scratch space, deleted at close."""
    verify: Literal["always", "sampled", "off"] = "always"
    """Check extent checksums on read: every read, one in 16, or never (then none are computed)."""
    memory_budget: ByteSize | None = None
    """DRAM for everything on this store: its cache plus what workloads reserve (the optimizer's
    staging, the activations held for backward); a workload that would go over fails at start.
    None: reservations are counted, not bounded."""

    @field_validator("tiers")
    @classmethod
    def _unique_names(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        names = [tier.name for tier in tiers]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tier names must be unique; repeated: {', '.join(duplicates)}")
        return tiers


ConfigSource = StoreConfig | Mapping[str, Any] | str | os.PathLike[str]


def load_config(source: ConfigSource) -> StoreConfig:
    """Validate a config given as a model, a mapping, or the path of a .json/.toml file."""
    if isinstance(source, StoreConfig):
        return source
    where = "config"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        where = str(path)
        if path.suffix not in (".toml", ".json"):
            raise ConfigError(
                f"config file {path}: configs are TOML (.toml) or JSON (.json) files, "
                f"not {path.suffix or 'files without a suffix'}"
            )
        try:
            text = path.read_text()
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        try:
            source = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
            raise ConfigError(f"{path} is not valid {path.suffix.lstrip('.')}: {error}") from None
    if not isinstance(source, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(source).__name__}")
    try:
        return StoreConfig.model_validate(dict(source))
    except ValidationError as error:
        raise config_error_from_validation(error, where) from None


def default_config() -> dict[str, Any]:
    """The embedded default configuration (used by the demo), as a plain dict."""
    return tomllib.loads(files("tierstore").joinpath("default_config.toml").read_text())
