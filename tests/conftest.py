import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tierstore.backends import open_backend

from tierstore import Tier, TierStore

StoreFactory = Callable[..., TierStore]


@pytest.fixture(params=["dram", "nvme"])
def tier_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(tmp_path: Path, tier_kind: str) -> Iterator[StoreFactory]:
    """Build stores over one persistent tier of the parametrized kind; closes them afterwards."""
    stores: list[TierStore] = []

    def factory(**options: object) -> TierStore:
        url = (
            "dram://"
            if tier_kind == "dram"
            else f"nvme://{tmp_path / f'tier{len(stores)}'}?chunk_bytes=65536"
        )
        store = TierStore([Tier(tier_kind, open_backend(url))], **options)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


TmpfsFactory = Callable[[str], Path]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[TmpfsFactory]:
    """Mount a tmpfs of a given size (``"16m"``) under ``tmp_path``: a real file system that fills
    up. Mounting needs root; without it the test skips and says so. Every mount made is unmounted
    when the test ends, whatever happened."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs (a file system that fills up) needs root")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode:
            pytest.skip(f"mounting a tmpfs is not permitted here: {result.stderr.strip()}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", str(point)], check=True)


def train_side_by_side(
    optimizer: torch.optim.Optimizer,
    model: list[torch.nn.Parameter],
    expected: torch.optim.Optimizer,
    reference: list[torch.nn.Parameter],
    steps: range,
) -> None:
    """Step ``optimizer`` over ``model`` and ``expected`` over ``reference`` (its twin: the same
    shapes and values) with the same gradients, seeded by each of ``steps``."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for param, twin in zip(model, reference, strict=True):
            param.grad = torch.randn(param.shape, generator=generator)
            twin.grad = param.grad.clone()
        optimizer.step()
        expected.step()
