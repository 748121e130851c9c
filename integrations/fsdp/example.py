"""A small GPT trained with FSDP2 (``fully_shard``), its optimizer state through tierstore, and a
DCP checkpoint resumed in a fresh model, optimizer and store.

    python -m tierstore.integrations.fsdp.example                      # 1 rank
    torchrun --nproc-per-node 2 -m tierstore.integrations.fsdp.example # 2 ranks (gloo, CPU)

The run trains ``--steps`` steps, saving a checkpoint after ``--save-at``; then it builds everything
again, loads the checkpoint and trains the remaining steps, and checks that the resumed losses are
the uninterrupted run's. With ``--resume`` it only loads ``--checkpoint`` and continues (e.g. on
another number of ranks). Each rank's state goes to an NVMe tier in ``<state-dir>/rank<N>``.
Rank 0 prints one JSON line per step and, with ``--json``, writes the whole report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tierstore.backends import open_backend
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tierstore.app.demo import GPT, batch_of, byte_corpus
from tierstore.store import TierStore
from tierstore.tier import Tier

from . import FSDPOffloadedAdamW, load, save


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps in all")
    parser.add_argument("--save-at", type=int, default=4, help="save a DCP checkpoint after this step")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint and continue from it")
    parser.add_argument("--checkpoint", type=Path, help="DCP checkpoint directory (default: a temporary one)")
    parser.add_argument("--state-dir", type=Path, help="the ranks' store directories (default: temporary)")
    parser.add_argument("--setup", choices=("mp", "bf16", "fp32"), default="mp", help=SETUPS)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="global batch (split over the ranks)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--sub-group-size", type=int, default=100_000, help="local elements per sub-group")
    parser.add_argument(
        "--dram-budget", type=int, default=8 << 20, help="bytes of fp32 state in DRAM per rank"
    )
    parser.add_argument("--json", type=Path, help="rank 0 writes the report here")
    return parser.parse_args(argv)


SETUPS = (
    "mp: fp32 shards, bf16 compute (MixedPrecisionPolicy), the moments in the store; "
    "bf16: a bf16 model, fp32 masters and moments in the store; fp32: fp32 throughout"
)


def build(args: argparse.Namespace) -> GPT:
    """The model, the same on every rank and every run, sharded block by block and at the root."""
    torch.manual_seed(0)
    heads = max(1, args.width // 64)
    # No dropout: a resumed run would draw other masks (the RNG state is not in the checkpoint).
    model = GPT(vocab=256, width=args.width, layers=args.layers, heads=heads, length=args.length, dropout=0.0)
    if args.setup == "bf16":
        model = model.to(torch.bfloat16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.setup == "mp" else None)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def open_store(state_dir: Path) -> TierStore:
    """This rank's store: one NVMe tier in its own directory, no cache (the optimizer stages)."""
    directory = state_dir / f"rank{dist.get_rank()}"
    return TierStore([Tier("state", open_backend(f"nvme://{directory}"))], cache_budget=0)


def train(
    args: argparse.Namespace, state_dir: Path, first: int, checkpoint: Path, *, resume: bool
) -> list[dict[str, Any]]:
    """Steps ``first``..``--steps`` (from the checkpoint if ``resume``), saving after ``--save-at``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = byte_corpus()
    model = build(args)
    with open_store(state_dir) as store:
        optimizer = FSDPOffloadedAdamW(  # the one line that replaces torch.optim.AdamW
            model,
            store,
            lr=args.lr,
            max_grad_norm=args.max_grad_norm,
            sub_group_size=args.sub_group_size,
            dram_budget=args.dram_budget,
        )
        if resume:
            first = int(load(checkpoint, model, optimizer, step=torch.tensor(0))["step"])
        rows = []
        for step in range(first, args.steps):
            tokens, targets = batch_of(corpus, step, args.batch, args.length)
            tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
            started = time.perf_counter()
            loss = model(tokens, targets)
            loss.backward()
            backward = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = time.perf_counter()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            row = {
                "step": step + 1,
                "loss": float(mean) / world,
                "forward_backward_s": round(backward - started, 4),
                "optimizer_s": round(done - backward, 4),
            }
            if step + 1 == args.save_at:
                started = time.perf_counter()
                moved = save(checkpoint, model, optimizer, step=torch.tensor(step + 1))
                row["checkpoint_s"] = round(time.perf_counter() - started, 4)
                row["checkpoint_state_bytes"] = moved["optimizer_bytes"]
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
        optimizer.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if "RANK" not in os.environ:  # python -m ...: one rank, a free local port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scratch = tempfile.TemporaryDirectory(prefix="tierstore-fsdp-") if rank == 0 else None
    shared = [scratch.name if scratch is not None else ""]
    dist.broadcast_object_list(shared)  # the ranks' common temporary directory (one machine)
    base = Path(shared[0])
    checkpoint = args.checkpoint or base / "checkpoint"
    state_dir = args.state_dir or base / "state"
    try:
        report: dict[str, Any] = {"world": dist.get_world_size(), "setup": args.setup}
        if args.resume:
            report["resumed"] = train(args, state_dir, 0, checkpoint, resume=True)
        else:
            report["straight"] = train(args, state_dir, 0, checkpoint, resume=False)
            if rank == 0:
                print(
                    f"# resuming from the checkpoint of step {args.save_at} in a fresh model and store",
                    flush=True,
                )
            report["resumed"] = train(args, state_dir, args.save_at, checkpoint, resume=True)
            expected = [row["loss"] for row in report["straight"][args.save_at :]]
            report["resume_matches"] = [row["loss"] for row in report["resumed"]] == expected
            if rank == 0:
                print(
                    f"# resumed losses equal the uninterrupted run's: {report['resume_matches']}", flush=True
                )
        if args.json is not None and rank == 0:
            args.json.write_text(json.dumps(report, indent=1))
    finally:
        dist.barrier()
        if scratch is not None:
            scratch.cleanup()
        dist.destroy_process_group()
    if not report.get("resume_matches", True):
        raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
