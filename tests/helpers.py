"""Plain helpers shared by several test modules (the fixtures live in ``conftest.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from tierstore.backends import open_backend

from tierstore import Tier, TierStore

TESTS = Path(__file__).parent


# -- stores ---------------------------------------------------------------------------------------
def make_store(tmp_path: Path, kind: str) -> TierStore:
    """A store for an offloaded optimizer's state: one tier named ``state``, no cache (the
    optimizer stages its own DRAM).

    Args:
        tmp_path: the test's directory; an NVMe tier keeps its files in ``state`` under it.
        kind: ``"dram"`` or ``"nvme"`` (64 KiB chunks, so sub-groups span several).
    """
    backend = open_backend("dram://" if kind == "dram" else f"nvme://{tmp_path / 'state'}?chunk_bytes=64KiB")
    return TierStore([Tier("state", backend)], cache_budget=0)


def persistent(
    tmp_path: Path,
    backend: str | None = None,
    *,
    tier: str = "nvme",
    budget: str | int = "1MiB",
    **cache: object,
) -> dict[str, Any]:
    """The config document of a persistent store with one tier, for ``TierStore.from_config``.

    Args:
        tmp_path: the test's directory; the manifest is ``manifest`` under it (a crash writer
            records its progress beside it, in ``manifest.started``).
        backend: the tier's backend URL; by default NVMe in ``tmp_path / "nvme"`` with 64 KiB
            chunks, so objects of a few hundred KiB already span several.
        tier: the tier's name, which :meth:`TierStore.info` reports for the objects on it.
        budget: the DRAM cache's byte budget; the default 1 MiB makes larger objects go straight
            to the tier and smaller ones get evicted early.
        cache: other ``[cache]`` settings, such as ``pack_below``.
    """
    url = backend if backend is not None else f"nvme://{tmp_path / 'nvme'}?chunk_bytes=64KiB"
    return {
        "cache": {"budget": budget, **cache},
        "manifest": str(tmp_path / "manifest"),
        "tiers": [{"name": tier, "backend": url}],
    }


def kill_a_crash_writer(
    config: dict[str, Any], first_version: int, seed: int, seconds: float, *mode: str
) -> int:
    """Run ``crash_writer.py`` on the persistent store ``config`` in a child process and kill it
    with SIGKILL ``seconds`` after it has opened the store: a crash at a moment the writer does
    not choose.

    Args:
        config: the store's config document (it must name a ``manifest``).
        first_version: the first version the writer puts.
        seed: seeds the writer's choice of keys.
        seconds: how long the writer runs before the kill.
        mode: the writer's optional mode (``"packs"``: rounds of small objects, each flushed).

    Returns:
        The highest version the writer started before it died.
    """
    arguments = [json.dumps(config), str(first_version), str(seed), *mode]
    writer = subprocess.Popen(
        [sys.executable, str(TESTS / "crash_writer.py"), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    ready = writer.stdout.readline().strip() == "ready"
    if ready:
        time.sleep(seconds)
    writer.kill()
    _, errors = writer.communicate()
    assert ready, f"the crash writer did not open the store: {errors[-2000:]}"
    return int(Path(config["manifest"] + ".started").read_text())


def map_count() -> int:
    """How many memory maps this process has (``vm.max_map_count`` caps them, ~65k by default)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


# -- optimizers against their references ----------------------------------------------------------
class LossScaledOptimizer(Protocol):
    """An offloaded optimizer: it unscales (and checks) the gradients itself."""

    def step(self, closure: Any = None, *, grad_scale: float = 1.0) -> Any: ...


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` in the 2-norm (a zero ``expected`` counts as 1e-30)."""
    got, expected = got.detach(), expected.detach()
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


def twin_parameters(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Seed torch's global generator with 0, then draw a model of ``shapes`` in ``dtype`` and
    return it with its fp32 reference twin (the same values). The gradients
    :func:`train_against_reference` draws next come from the same generator, so a run repeats."""
    torch.manual_seed(0)
    model = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in shapes]
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in model]
    return model, reference


def train_against_reference(
    optimizer: LossScaledOptimizer,
    model: list[torch.nn.Parameter],
    expected: torch.optim.Optimizer,
    reference: list[torch.nn.Parameter],
    *,
    steps: int,
    max_grad_norm: float | None = None,
    grad_scale: float = 1.0,
    overflow_at: int | None = None,
    overflow_element: tuple[int, ...] = (1, 3),
) -> None:
    """A mixed-precision training loop for ``optimizer`` over ``model``, and the same loop in fp32
    for the reference optimizer ``expected`` over ``reference``.

    Args:
        optimizer: the optimizer under test; it gets each gradient in its parameter's dtype,
            multiplied by ``grad_scale``, and unscales (and clips) it itself.
        model: ``optimizer``'s parameters.
        expected: the reference optimizer; it gets the same gradients in fp32, unscaled and
            clipped to ``max_grad_norm`` (if given) by ``torch.nn.utils.clip_grad_norm_``.
        reference: ``expected``'s parameters, twins of ``model`` (see :func:`twin_parameters`).
        steps: how many steps; the gradients are drawn from torch's global generator.
        max_grad_norm: the clipping norm, or None for no clipping.
        grad_scale: the loss scale the gradients carry.
        overflow_at: a step whose gradients hold an inf, which ``optimizer`` must skip (the
            reference skips it too), or None.
        overflow_element: where that inf is: the gradient's index in ``model``, then the
            element's index in that gradient.
    """
    for step in range(steps):
        grads = [torch.randn(param.shape).mul(grad_scale).to(param.dtype) for param in model]
        if step == overflow_at:
            grads[overflow_element[0]][overflow_element[1:]] = float("inf")
        for param, grad in zip(model, grads, strict=True):
            param.grad = grad
        optimizer.step(grad_scale=grad_scale)
        if step == overflow_at:
            continue
        for param, grad in zip(reference, grads, strict=True):
            param.grad = grad.float() / grad_scale
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference, max_grad_norm)
        expected.step()


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
