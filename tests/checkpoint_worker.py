"""Processes of the checkpoint tests (``test_checkpoint.py``), started from a forkserver that has
torch and tierstore imported already, so each costs milliseconds, not seconds of imports.

Each entry point takes JSON-ready arguments and writes what the test needs to know into files of
``directory`` (a file replaced whole, never read half-written)."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save, save
from torch.distributed.fsdp import fully_shard

warnings.filterwarnings("ignore", module="torch.distributed")


def model_and_optimizer(seed: int, *, fsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP (a bf16 buffer too, for the dtypes), sharded by FSDP2 if ``fsdp``, with AdamW."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 10))
    model.register_buffer("scale", torch.randn(7).bfloat16())
    if fsdp:
        for layer in (model[0], model[2], model):
            fully_shard(layer)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        model(torch.randn(6, 24, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def assert_same(left: Any, right: Any, where: str = "") -> None:
    """Bit for bit: tensors equal in dtype, shape and every bit; everything else equal."""
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor), where
        assert left.dtype == right.dtype and left.shape == right.shape, where
        assert torch.equal(bits(left), bits(right)), where
    elif isinstance(left, dict):
        assert isinstance(right, dict) and set(left) == set(right), (where, set(left) ^ set(right))
        for key in left:
            assert_same(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, list | tuple):
        assert len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert left == right, (where, left, right)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (so -0.0 differs from 0.0, and a NaN equals itself)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as whole tensors keyed by parameter name (every rank joins)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optim": optimizer_state}


def fsdp_save_and_load(rank: int, world: int, port: int, config: dict[str, Any], directory: str) -> None:
    """Train an FSDP2 model on ``world`` ranks, save it, load it into a fresh one on the same ranks
    and check it; rank 0 writes the whole state as the reference for the 1-rank load."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, optimizer = model_and_optimizer(seed=0, fsdp=True)
        train(model, optimizer, steps=2)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        with TieredStorageWriter(config) as writer:
            save(
                {"model": model_state, "optim": optimizer_state},
                checkpoint_id="tierstore://fsdp",
                storage_writer=writer,
            )
            writer.wait_durable()
        reference = full_state(model, optimizer)
        if rank == 0:
            torch.save(reference, Path(directory) / "reference.pt")

        fresh, fresh_optimizer = model_and_optimizer(seed=1, fsdp=True)
        model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
        with TieredStorageReader(config) as reader:
            load(
                {"model": model_state, "optim": optimizer_state}, checkpoint_id="fsdp", storage_reader=reader
            )
        set_state_dict(fresh, fresh_optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        assert_same(reference, full_state(fresh, fresh_optimizer))
        (Path(directory) / f"rank{rank}.ok").touch()
    finally:
        dist.destroy_process_group()


def step_state(step: int) -> dict[str, Any]:
    """A state dict whose every value says ``step``: a torn or mixed checkpoint cannot pass for
    a whole one. Sizes cross the pack and object limits of a 64 KiB budget."""
    return {
        "large": torch.full((3, 9000), float(step)),
        "middle": torch.full((1000,), step, dtype=torch.int64),
        "small": {
            "a": torch.full((5,), step, dtype=torch.int16),
            "b": torch.full((40,), float(step)).bfloat16(),
        },
        "step": step,
    }


def record(path: Path, text: str) -> None:
    """Replace ``path``'s content whole."""
    path.with_suffix(".tmp").write_text(text)
    os.replace(path.with_suffix(".tmp"), path)


def save_forever(config: dict[str, Any], directory: str, first: int) -> None:
    """Save ``step-<n>`` checkpoints from ``first`` on until killed; ``saved`` names the last
    whose save returned."""
    with TieredStorageWriter(config, keep={"fast": 2, "slow": 3}) as writer:
        for step in range(first, first + 1000):
            save(
                step_state(step),
                checkpoint_id=f"tierstore://step-{step}",
                storage_writer=writer,
                no_dist=True,
            )
            record(Path(directory) / "saved", str(step))


def async_save_then_drain(config: dict[str, Any], directory: str) -> None:
    """``dcp.async_save`` one checkpoint, say so once it is committed on the fast tier, then wait
    for its (slow) drain."""
    with TieredStorageWriter(config) as writer:
        state = step_state(7)
        saving = async_save(state, checkpoint_id="tierstore://async", storage_writer=writer, no_dist=True)
        state["large"].fill_(-1.0)  # training goes on: the checkpoint keeps the staged values
        assert isinstance(saving, Future)
        saving.result()
        record(Path(directory) / "committed", "async")
        writer.wait_durable()
        record(Path(directory) / "durable", "async")
