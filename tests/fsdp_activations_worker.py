"""One rank of the FSDP2 run of tests/test_activations_checkpoint.py (gloo, CPU), spawned by the
test: the same model, sharded with ``fully_shard``, trained from the same seed twice, once with its
activations offloaded by an attached :class:`~tierstore.activations.ActivationOffload` (a store per
rank under ``argv[1]``) and once without. Rank 0 writes the losses of both, whether every gathered
gradient was bit-identical, and the offloader's figures to ``argv[2]``. RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT come from the environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tierstore.activations import ActivationOffload
from tierstore.backends import open_backend
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tierstore import Tier, TierStore
from tierstore.app.demo import GPT

VOCAB, LENGTH, GLOBAL_BATCH, STEPS = 64, 32, 8, 3


def build() -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, width=64, layers=2, heads=2, length=LENGTH, dropout=0.0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def train(model: GPT) -> tuple[list[float], list[list[torch.Tensor]]]:
    """Losses (averaged over the ranks) and full gradients of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, gradients = [], []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH + 1), generator=generator).chunk(world)[rank]
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        gradients.append([full(p.grad) for p in model.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses, gradients


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def main() -> None:
    directory, output = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        reference_losses, reference_gradients = train(build())
        tier = Tier("nvme", open_backend(f"nvme://{directory / f'rank{rank}'}"))
        with TierStore([tier], cache_budget=0) as store:
            offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="all")
            model = build()
            attachment = offload.attach(model)
            losses, gradients = train(model)
            attachment.remove()
            stats = offload.stats()
            offload.close()
        result: dict[str, Any] = {
            "world": dist.get_world_size(),
            "losses": losses,
            "reference_losses": reference_losses,
            "gradients_equal": all(
                torch.equal(a, b)
                for ours, theirs in zip(gradients, reference_gradients, strict=True)
                for a, b in zip(ours, theirs, strict=True)
            ),
            "spilled_bytes": stats["spilled_bytes"],
            "parameter_bytes": stats["parameter_bytes"],
        }
        if rank == 0:
            output.write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
