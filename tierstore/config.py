"""The store's options, each defined once, and its configuration document.

Each option of a store is one field of the models below (type, default, constraints, and its meaning
in the docstring under it). The document (a dict, a JSON file or a TOML file) validates through them
with [`load_config`][]; [`TierStore`][]'s keyword arguments validate through the same fields
(`StoreOptions.from_arguments`, the keywords named in `STORE_ARGUMENTS`); the DeepSpeed section
reuses them; the README's configuration reference is written from them (`tierstore.app.reference`).
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
from typing import Any, Literal

from pydantic import (
    ByteSize,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._checks import SIZE_REQUIREMENT, ConfigModel, byte_count, check_arguments, defined_in
from .errors import ConfigError, config_error_from_validation


def parse_byte_size(value: str | int) -> int:
    """Bytes from an integer or text such as ``"64MiB"`` or ``"2GB"``, by the rule of every size in
    bytes (`byte_count`).

    Raises:
        ConfigError: ``"must be a number of bytes >= 0 (an integer or text such as '64MiB'), not
            <value>"``.
    """
    count = byte_count(value)
    if count is None:
        raise ConfigError(f"must be {SIZE_REQUIREMENT}, not {value!r}")
    return count


NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$"
"""Tier and path names: they appear in manifests, telemetry and error messages."""

Policy = Literal["write-back", "write-through"]
Verify = Literal["always", "sampled", "off"]
PlacementPolicy = Literal["stripe", "place"]
StripeBy = Literal["round-trip", "write", "read"]


class CacheConfig(ConfigModel):
    """The store's DRAM cache (the ``[cache]`` table)."""

    budget: ByteSize = ByteSize(256 << 20)
    """Bytes of DRAM the cache may hold (page-aligned buffers; device copies cross the bus through
    the store's own few pinned pieces)."""
    policy: Policy = "write-back"
    """``write-back``: a put lands in DRAM and reaches a tier on eviction or flush;
    ``write-through``: a put resolves once its tier write is done (and stays cached)."""
    cache_reads: bool = True
    """Keep objects read from a tier in the cache (false: read straight into the destination)."""
    pack_below: ByteSize = ByteSize(64 << 10)
    """Dirty objects smaller than this are written back (``flush``, ``close``) in packs, one
    backend object per batch of up to 4 MiB, instead of one object (file) each; 0 turns packing
    off."""
    resident: bool = False
    """Keep the pages of buffers the cache frees for its next objects instead of giving them back
    to the kernel: refilling the cache (a checkpoint staged at every save) then copies into memory
    already mapped, several times faster than into fresh pages, and the process's RSS stays at the
    cache's high-water mark (never above its budget) until the store closes."""


class BandwidthConfig(ConfigModel):
    """A path's bandwidth in bytes per second (e.g. ``"1.5GB"``), when known in advance."""

    read: ByteSize
    """Bytes per second read."""
    write: ByteSize
    """Bytes per second written."""


class NodeLimitConfig(ConfigModel):
    """Slots shared by every process on the node that names the same ``key`` (a shared PFS)."""

    key: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,100}$")
    """The name every process on the node sharing these slots gives."""
    max_reads: int = Field(1, ge=1, le=1024, strict=True)
    """Read requests in flight on the node at once, all processes together."""
    max_writes: int = Field(1, ge=1, le=1024, strict=True)
    """Write requests in flight on the node at once, all processes together."""
    directory: Path | None = None
    """Where the lock files live (default ``/dev/shm/tierstore-limits``)."""


class PathConfig(ConfigModel):
    """One path of a virtual tier (a ``[[tiers.paths]]`` table)."""

    name: str | None = Field(None, pattern=NAME_PATTERN)
    """The path's name (default ``<tier>.<index>``)."""
    backend: str | dict[str, Any]
    """A backend URL (``nvme:///path``) or a table with ``type`` and the backend's options."""
    max_reads: int = Field(4, ge=1, le=1024, strict=True)
    """Read requests in flight on this path (each request is one object's extent)."""
    max_writes: int = Field(4, ge=1, le=1024, strict=True)
    """Write requests in flight on this path."""
    bandwidth: BandwidthConfig | None = None
    """Known bandwidth; otherwise probed (``probe = true``) or learned from traffic."""
    node_limit: NodeLimitConfig | None = None
    """Slots shared with the node's other processes (none: this process's limits only)."""


class TierConfig(ConfigModel):
    """One tier (a ``[[tiers]]`` table): one path (``backend``) or several (``paths``)."""

    name: str = Field(pattern=NAME_PATTERN)
    """The tier's name, unique in the store."""
    backend: str | dict[str, Any] | None = None
    """Shorthand for a tier of one path: its backend URL or table."""
    paths: list[PathConfig] | None = Field(None, min_length=1)
    """Several paths acting as one tier (MLP-Offload's virtual tier)."""
    placement: PlacementPolicy = "stripe"
    """``stripe``: split every object across the paths by bandwidth; ``place``: whole objects per
    path, in bandwidth proportion."""
    stripe_by: StripeBy = "round-trip"
    """Which bandwidth sets the shares: ``round-trip`` (objects written then read back),
    ``write`` or ``read``."""
    adapt: bool = True
    """Re-weight the paths from their observed throughput (EWMA)."""
    probe: bool = False
    """Measure unconfigured paths' bandwidth when the store opens (cached on disk)."""
    capacity: ByteSize | None = None
    """Bytes of objects a store keeps on this tier (each store on shared directories counts its
    own; a checkpoint config's tier bounds each store it opens so); objects go to the first tier
    with room (none: no limit)."""

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


class TierOptions(ConfigModel):
    """The options a [`Tier`][] takes from Python, checked through this model: those of a document's
    tier, defined by `TierConfig`'s fields, and ``checksums``."""

    capacity: ByteSize | None = defined_in(TierConfig, "capacity")
    placement: PlacementPolicy = defined_in(TierConfig, "placement")
    stripe_by: StripeBy = defined_in(TierConfig, "stripe_by")
    checksums: bool = True
    """Checksum every extent written, so reads can verify it (a document's tiers always do)."""


class PathOptions(ConfigModel):
    """The options a `TierPath` (and its `PathScheduler`) takes from Python, checked through this
    model and defined by the document's fields: a path's limits (`PathConfig`) and whether its
    bandwidth estimate follows its traffic (a tier's ``adapt``, `TierConfig`)."""

    max_reads: int = defined_in(PathConfig, "max_reads")
    max_writes: int = defined_in(PathConfig, "max_writes")
    adapt: bool = defined_in(TierConfig, "adapt")


class StoreOptions(ConfigModel):
    """Every option of a store but its tiers: the one definition of [`TierStore`][]'s keyword
    arguments (see `STORE_ARGUMENTS`) and of the document's keys."""

    cache: CacheConfig = CacheConfig()
    """The DRAM cache."""
    workers: int = Field(4, ge=1, strict=True)
    """Threads that run put/get/prefetch (device I/O has its own threads in each backend)."""
    manifest: Path | None = None
    """Directory of the store's manifest: the store is persistent (reopening finds its objects).
    Without it the store is scratch space, deleted at close."""
    verify: Verify = "always"
    """Check extent checksums on read: every read, one in 16 (``sampled``), or never (``off``:
    then none are computed)."""
    memory_budget: ByteSize | None = None
    """DRAM for everything on this store, at least its cache's budget: the cache plus what
    workloads reserve (the optimizer's staging, the activations held for backward); a workload
    that would go over fails at start. None: reservations are counted, not bounded."""

    @field_validator("memory_budget")
    @classmethod
    def _holds_the_cache(cls, budget: ByteSize | None, info: ValidationInfo) -> ByteSize | None:
        cache = info.data.get("cache")
        if budget is not None and cache is not None and budget < cache.budget:
            raise ValueError(
                f"must be a number of bytes >= the cache budget ({cache.budget}), not {int(budget)}"
            )
        return budget

    @classmethod
    def from_arguments(cls, **arguments: Any) -> StoreOptions:
        """The options from [`TierStore`][]'s keyword arguments (named as in `STORE_ARGUMENTS`),
        checked; a [`ConfigError`][] names the argument."""
        document: dict[str, Any] = {}
        for argument, (*tables, key) in STORE_ARGUMENTS.items():
            if argument in arguments:
                table = document
                for name in tables:
                    table = table.setdefault(name, {})
                table[key] = arguments[argument]
        return check_arguments(cls, document, names={path: name for name, path in STORE_ARGUMENTS.items()})

    def arguments(self) -> dict[str, Any]:
        """The options as [`TierStore`][]'s keyword arguments."""
        arguments: dict[str, Any] = {}
        for argument, path in STORE_ARGUMENTS.items():
            value: Any = self
            for name in path:
                value = getattr(value, name)
            arguments[argument] = value
        return arguments


STORE_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "cache_budget": ("cache", "budget"),
    "policy": ("cache", "policy"),
    "cache_reads": ("cache", "cache_reads"),
    "pack_below": ("cache", "pack_below"),
    "cache_resident": ("cache", "resident"),
    "workers": ("workers",),
    "manifest": ("manifest",),
    "verify": ("verify",),
    "memory_budget": ("memory_budget",),
}
"""Each keyword argument of [`TierStore`][] and where its option sits in the document (the cache's
options are a table of their own there)."""


class StoreConfig(StoreOptions):
    """A store's configuration document: its options and its tiers."""

    tiers: list[TierConfig] = Field(min_length=1)
    """The tiers, tried in order: an object leaving the cache goes to the first with room."""

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
        source = read_config_file(path)
    if not isinstance(source, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(source).__name__}")
    try:
        return StoreConfig.model_validate(dict(source))
    except ValidationError as error:
        raise config_error_from_validation(error, where) from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a config file holds: TOML for a ``.toml`` suffix, JSON otherwise.

    Raises:
        ConfigError: the file cannot be read, is not valid TOML or JSON, or holds something other
            than a mapping.
    """
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    try:
        document = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is not valid {path.suffix.lstrip('.')}: {error}") from None
    if not isinstance(document, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(document).__name__}")
    return dict(document)


def default_config() -> dict[str, Any]:
    """The embedded default configuration (used by the demo), as a plain dict."""
    return tomllib.loads(files("tierstore").joinpath("default_config.toml").read_text())
