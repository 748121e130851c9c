"""A small GPT-style model trained by DeepSpeed ZeRO-3 with its optimizer state offloaded either
by DeepSpeed itself (ZeRO-Infinity NVMe swapping) or by tierstore. The integration's tests and
benchmark drive this script; it is also the shortest complete example of enabling tierstore.

    python -m tierstore.integrations.deepspeed.example --offload tierstore --nvme /dev/shm/ts --steps 10

One process per rank: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (defaults: one rank).
Prints one JSON line per step (global mean loss, forward/backward/step seconds) and, with
``--json``, writes them all with the run's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from tierstore.app.demo import GPT


def ds_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch // world,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(args.nvme),
                "pin_memory": False,
                "pipeline_read": args.pipeline,
                "pipeline_write": args.pipeline,
                "buffer_count": args.buffer_count,
            },
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True},
    }
    if args.offload == "tierstore":
        section: dict[str, Any] = {
            "dram_budget": args.buffer_count * 4 * args.sub_group_size,  # DeepSpeed's swap buffers
            "prefetch_depth": args.prefetch_depth,
            "cache_policy": args.cache_policy,
            "order": args.order,
            "state_precision": args.state_precision,
        }
        if args.tiers:
            section["tiers"] = json.loads(args.tiers)
        if args.activations:
            section["activations"] = json.loads(args.activations)
        config["tierstore"] = section
    return config


def batch(args: argparse.Namespace, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the step's global batch (the same for any rank count), drawn from a
    small fixed pool of sequences so that the loss visibly falls."""
    pool = torch.randint(
        args.vocab, (16, args.length + 1), generator=torch.Generator().manual_seed(args.seed)
    )
    rows = torch.arange(step * args.batch, (step + 1) * args.batch) % len(pool)
    share = pool[rows].chunk(world)[rank]
    return share[:, :-1], share[:, 1:]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--offload", choices=["deepspeed", "tierstore"], required=True)
    parser.add_argument("--nvme", type=Path, required=True, help="offload_optimizer.nvme_path")
    parser.add_argument("--tiers", help="tierstore tiers as JSON (default: NVMe under --nvme)")
    parser.add_argument("--activations", help='tierstore: spill activations, e.g. \'{"budget": "64MiB"}\'')
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="global batch (split over ranks)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sub-group-size", type=int, default=8_000_000)
    parser.add_argument("--buffer-count", type=int, default=12, help="DeepSpeed's swap buffers (= DRAM)")
    parser.add_argument("--pipeline", action="store_true", help="DeepSpeed's pipelined swapper")
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument("--cache-policy", default="model", choices=["model", "static", "none"])
    parser.add_argument("--order", default="alternate", choices=["alternate", "ascending"])
    parser.add_argument(
        "--state-precision",
        default="fp32",
        choices=["fp32", "bf16", "int8", "int8-compensated"],
        help="tierstore: how the optimizer state is stored (tierstore.state_precision)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--save",
        type=Path,
        help="checkpoint directory written after --save-after steps (at once after --load from that step)",
    )
    parser.add_argument("--save-after", type=int, default=0)
    parser.add_argument("--load", type=Path, help="resume from this checkpoint directory")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--telemetry", type=Path, help="tierstore: each path's request history, per rank")
    parser.add_argument(
        "--skip-last-block-at",
        type=lambda text: {int(step) for step in text.split(",")},
        default=set(),
        help="steps (comma-separated) whose forward leaves the last block out, so it gets no gradient",
    )
    parser.add_argument("--parameters", type=Path, help="rank 0 saves the trained parameters here (torch)")
    parser.add_argument(
        "--matmul-dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="dtype the linear layers multiply in (float32: for CPUs without fast bf16 GEMM)",
    )
    args = parser.parse_args(argv)

    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    import deepspeed
    from tierstore.integrations.deepspeed import initialize

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(args.seed)
    # tierstore's demo GPT with neither dropout nor a tied head: both offloads train the same model
    model = GPT(
        args.vocab,
        args.width,
        args.layers,
        args.heads,
        args.length,
        dropout=0.0,
        tied_head=False,
        compute=getattr(torch, args.matmul_dtype),
    )
    start_initialize = deepspeed.initialize if args.offload == "deepspeed" else initialize
    engine, *_ = start_initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args, world)
    )
    first = 0
    if args.load is not None:
        engine.load_checkpoint(str(args.load), tag="checkpoint")
        first = engine.global_steps
    tiers = engine.optimizer.optimizer_swapper.store.tiers if args.offload == "tierstore" else []
    rows = []
    for step in range(first, args.steps + 1):
        if args.save is not None and step == args.save_after:
            engine.save_checkpoint(str(args.save), tag="checkpoint")
        if step == args.steps:
            break
        moved = sum(t.bytes_read for t in tiers), sum(t.bytes_written for t in tiers)
        tokens, targets = batch(args, step, rank, world)
        began = time.perf_counter()
        loss = engine(tokens, targets, step in args.skip_last_block_at)
        forward = time.perf_counter()
        engine.backward(loss)
        backward = time.perf_counter()
        engine.step()
        stepped = time.perf_counter()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        row = {
            "step": step,
            "loss": float(mean) / world,
            "forward_s": round(forward - began, 4),
            "backward_s": round(backward - forward, 4),
            "step_s": round(stepped - backward, 4),
            "iteration_s": round(stepped - began, 4),
        }
        if tiers:  # what tierstore moved this step (DeepSpeed's own swapper keeps no such count)
            row["bytes_read"] = sum(t.bytes_read for t in tiers) - moved[0]
            row["bytes_written"] = sum(t.bytes_written for t in tiers) - moved[1]
        offload = getattr(engine, "tierstore_activations", None)
        if offload is not None:
            stats = offload.stats()
            row["activations_spilled_bytes"] = stats["spilled_bytes"]
            row["activations_peak_resident_bytes"] = stats["step_peak_resident_bytes"]
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if args.json is not None and rank == 0:
        parameters = sum(p.ds_numel for p in model.parameters())  # type: ignore[attr-defined]
        adam_steps = [  # Adam's step count per sub-group (DeepSpeed's optimizer keeps one per flat partition)
            int(engine.optimizer.optimizer.state[flat].get("step", 0))
            for flat in engine.optimizer.fp32_partitioned_groups_flat
        ]
        args.json.write_text(
            json.dumps({"parameters": parameters, "adam_steps": adam_steps, "rows": rows}, indent=1)
        )
    if args.parameters is not None:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            if rank == 0:
                torch.save(
                    {name: p.detach().float().clone() for name, p in model.named_parameters()},
                    args.parameters,
                )
    if args.telemetry is not None and args.offload == "tierstore":
        paths = [path for tier in tiers for path in tier.paths]
        history = {path.name: list(path.scheduler.telemetry.history) for path in paths}
        Path(f"{args.telemetry}.rank{rank}").write_text(json.dumps(history))
    engine.destroy()
    return rows


if __name__ == "__main__":
    main()
