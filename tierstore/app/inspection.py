"""``tierstore inspect``: what a persistent store holds, read from its manifest without writing
anything (a process may have the store open for writing meanwhile)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ..config import StoreConfig
from ..errors import ConfigError, ManifestError
from ..store import TierStore
from ..tier import Tier


def run_inspect(config: StoreConfig, source: Path) -> dict[str, Any]:
    """The persistent store ``config`` names, opened read-only: its keys (size, dtype, shape,
    tier), its tiers (capacity, bytes held, each path with its location and free space).

    Raises:
        ConfigError: the config has no manifest (a scratch store keeps nothing to inspect).
        ManifestError: no persistent store at the manifest directory.
    """
    if config.manifest is None:
        raise ConfigError(
            f"{source}: the config has no manifest, so its store is scratch space, which keeps nothing "
            "once closed; inspect opens a persistent store (one with a manifest directory)"
        )
    if not config.manifest.is_dir():  # before the tiers are opened, which would create their paths
        raise ManifestError(f"manifest {config.manifest}: no persistent store there (no such directory)")
    # Inspecting reads the manifest only: no cache, and no bandwidth probe writing to the tiers.
    opened = config.model_copy(
        update={
            "cache": config.cache.model_copy(update={"budget": 0}),
            "memory_budget": None,
            "tiers": [tier.model_copy(update={"probe": False}) for tier in config.tiers],
        }
    )
    with TierStore.from_config(opened, read_only=True) as store:
        keys = {}
        for key in sorted(store.keys()):
            info = store.info(key)
            keys[key] = {
                "nbytes": info.nbytes,
                "dtype": str(info.dtype).removeprefix("torch."),
                "shape": list(info.shape),
                "tier": info.tier,
            }
        tiers = {tier.name: _tier_report(tier, keys) for tier in store.tiers}
    return {
        "config": str(source),
        "manifest": str(config.manifest),
        "objects": len(keys),
        "bytes": sum(entry["nbytes"] for entry in keys.values()),
        "tiers": tiers,
        "keys": keys,
    }


def _tier_report(tier: Tier, keys: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A tier of an inspected store: capacity, the objects and bytes it holds, and each path's
    location with the space its file system has free (None where it is no local directory)."""
    paths = {}
    for path in tier.paths:
        location = path.backend.location()
        shown = None if location is None else location.shown
        usage = shutil.disk_usage(shown) if shown is not None and os.path.isdir(shown) else None
        paths[path.name] = {
            "location": shown,
            "free_bytes": None if usage is None else usage.free,
            "total_bytes": None if usage is None else usage.total,
        }
    held = [entry["nbytes"] for entry in keys.values() if entry["tier"] == tier.name]
    return {
        "capacity_bytes": tier.capacity,
        "used_bytes": tier.used_bytes,
        "objects": len(held),
        "bytes": sum(held),
        "paths": paths,
    }


def inspect_summary(report: dict[str, Any]) -> str:
    """The listing for people: the store, its tiers and paths, then one line per key."""
    lines = [
        f"store {report['manifest']} (opened read-only): {report['objects']} objects, "
        f"{size_in_words(report['bytes'])}"
    ]
    for name, tier in report["tiers"].items():
        capacity = (
            ", no capacity limit"
            if tier["capacity_bytes"] is None
            else f" of its capacity of {size_in_words(tier['capacity_bytes'])}"
        )
        lines.append(
            f"tier {name}: {tier['objects']} objects, {size_in_words(tier['used_bytes'])} used{capacity}"
        )
        for path_name, path in tier["paths"].items():
            free = (
                "free space unknown"
                if path["free_bytes"] is None
                else f"{size_in_words(path['free_bytes'])} free of {size_in_words(path['total_bytes'])}"
            )
            lines.append(f"  path {path_name}: {path['location'] or 'memory'}, {free}")
    if report["keys"]:
        width = max(len(key) for key in report["keys"])
        lines.append(f"{'key':<{width}}  {'size':>10}  {'dtype':<9}  {'tier':<8}  shape")
        for key, entry in report["keys"].items():
            lines.append(
                f"{key:<{width}}  {size_in_words(entry['nbytes']):>10}  {entry['dtype']:<9}  "
                f"{entry['tier'] or '-':<8}  {entry['shape']}"
            )
    return "\n".join(lines)


def size_in_words(nbytes: int) -> str:
    """Bytes for people: ``"36.0 MiB"``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"
