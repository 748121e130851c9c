"""Two paths of one store never share a medium: every alias of one directory or URL is refused."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.backends import open_backend

from tierstore import ConfigError, Tier, TierStore

Alias = Callable[[Path, Path], str]


def one_tier(*urls: str) -> dict[str, Any]:
    paths = [{"name": f"p{index}", "backend": url} for index, url in enumerate(urls)]
    return {"cache": {"budget": 0}, "tiers": [{"name": "v", "paths": paths}]}


def same_spelling(directory: Path, scratch: Path) -> str:
    return str(directory)


def dot_segment(directory: Path, scratch: Path) -> str:
    return f"{directory}/./"


def symlink(directory: Path, scratch: Path) -> str:
    link = scratch / "link"
    link.symlink_to(directory)
    return str(link)


@pytest.fixture
def bind_mount(tmp_path: Path) -> Iterator[Alias]:
    """A bind mount of the directory elsewhere (root only: mounting needs CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def alias(directory: Path, scratch: Path) -> str:
        target = scratch / "bound"
        target.mkdir()
        if os.geteuid() != 0:
            pytest.skip("a bind mount needs root")
        result = subprocess.run(
            ["mount", "--bind", str(directory), str(target)], capture_output=True, text=True, check=False
        )
        if result.returncode:
            pytest.skip(f"mount --bind is not permitted here: {result.stderr.strip()}")
        mounted.append(target)
        return str(target)

    yield alias
    for target in mounted:
        subprocess.run(["umount", str(target)], check=True)


@pytest.fixture(params=["same spelling", "dot segment", "symlink", "bind mount"])
def alias(request: pytest.FixtureRequest) -> Alias:
    if request.param == "bind mount":
        bound: Alias = request.getfixturevalue("bind_mount")
        return bound
    return {"same spelling": same_spelling, "dot segment": dot_segment, "symlink": symlink}[request.param]


def test_one_directory_twice_in_a_tier_is_refused_naming_both_paths(tmp_path: Path, alias: Alias) -> None:
    directory = tmp_path / "d"
    directory.mkdir()
    other = alias(directory, tmp_path)
    with pytest.raises(ConfigError, match=r"path 'p0' and tier 'v' path 'p1' are the same location"):
        TierStore.from_config(one_tier(f"nvme://{directory}", f"nvme://{other}"))
    assert list(directory.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("second", ["nvme", "zarr", "adios2"])
def test_one_directory_in_two_tiers_is_refused(tmp_path: Path, second: str) -> None:
    config = {
        "tiers": [
            {"name": "fast", "backend": f"nvme://{tmp_path / 'd'}", "capacity": "1MiB"},
            {"name": "slow", "backend": f"{second}://{tmp_path / 'd'}/"},
        ]
    }
    with pytest.raises(ConfigError, match=r"tier 'fast' path 'fast.0' and tier 'slow' path 'slow.0'"):
        TierStore.from_config(config)


def test_a_wrapped_backend_reports_the_directory_it_wraps(tmp_path: Path) -> None:
    wrapped = {"type": "fault", "inner": f"nvme://{tmp_path}"}
    with pytest.raises(ConfigError, match="same location"):
        TierStore.from_config(
            {"tiers": [{"name": "v", "paths": [{"backend": wrapped}, {"backend": f"nvme://{tmp_path}"}]}]}
        )


def test_a_tier_built_by_hand_checks_too(tmp_path: Path) -> None:
    first, second = open_backend(f"nvme://{tmp_path}"), open_backend(f"nvme://{tmp_path}/.")
    try:
        with pytest.raises(ConfigError, match=str(tmp_path)):
            Tier("v", [first, second])
    finally:
        first.close()
        second.close()


def test_fsspec_urls_are_compared_normalised() -> None:
    with pytest.raises(ConfigError, match="memory:///shared"):
        TierStore.from_config(one_tier("zarr+memory://shared", "zarr+memory://shared/./"))


def test_distinct_media_are_accepted_and_stripe(tmp_path: Path) -> None:
    config = one_tier(f"nvme://{tmp_path / 'a'}", f"nvme://{tmp_path / 'b'}", "dram://", "dram://")
    with TierStore.from_config(config) as store:
        store["x"] = torch.arange(1 << 18, dtype=torch.int32)
        assert len(store.info("x").extents) == 4
        assert torch.equal(store["x"], torch.arange(1 << 18, dtype=torch.int32))
