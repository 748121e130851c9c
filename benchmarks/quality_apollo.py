"""Quality run: offloaded APOLLO-Mini vs offloaded AdamW training the same small GPT, same batches.

A byte-level GPT (``tierstore.app.demo``) on the standard library's source files, ``--steps``
steps each, both optimizers' fp32 state on an NVMe (O_DIRECT) tier under a DRAM budget below it.
Reports both loss curves (JSON and a PNG) and the final losses (mean of the last 20 steps); the
target (issue 16) is APOLLO-Mini's final loss within 5% of AdamW's. Small enough for 2 cores:

    .venv/bin/python -m benchmarks.quality_apollo --output benchmarks/results/apollo_quality.json \\
        --plot benchmarks/results/apollo_quality.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tierstore.backends import open_backend
from tierstore.optimizer import APOLLO_MINI, OffloadedAdamW, OffloadedAPOLLO, StagedOptimizer

from tierstore import Tier, TierStore
from tierstore.app.demo import GPT, apollo_groups, batch_of, byte_corpus

TAIL = 20


def train(name: str, args: argparse.Namespace, corpus: torch.Tensor, directory: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(width=args.width, layers=args.layers, heads=args.width // 32, length=args.length, dropout=0.0)
    backend = open_backend({"type": "nvme", "path": str(directory / name)})
    with TierStore([Tier("nvme", backend)], cache_budget=0) as store:
        options: dict[str, Any] = {
            "lr": args.lr,
            "weight_decay": 0.0,
            "sub_group_size": args.sub_group_size,
            "dram_budget": args.dram_budget,
            "max_grad_norm": 1.0,
        }
        optimizer: StagedOptimizer = (
            OffloadedAPOLLO(apollo_groups(model, APOLLO_MINI), store, **options)
            if name == "apollo-mini"
            else OffloadedAdamW(model.parameters(), store, **options)
        )
        state_bytes = sum(4 * optimizer.state_numel(sg) for sg in optimizer.subgroups)
        losses, started = [], time.perf_counter()
        for step in range(args.steps):
            tokens, targets = batch_of(corpus, step, args.batch, args.length)
            loss = model(tokens, targets)
            model.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(round(float(loss.detach()), 5))
            if step % 50 == 0:
                print(f"{name} step {step}: loss {losses[-1]:.4f}", file=sys.stderr)
        return {
            "fp32_state_bytes": state_bytes,
            "subgroups": len(optimizer.subgroups),
            "seconds": round(time.perf_counter() - started, 1),
            "final_loss": round(sum(losses[-TAIL:]) / TAIL, 5),
            "losses": losses,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sub-group-size", type=int, default=16384)
    parser.add_argument("--dram-budget", type=int, default=1 << 20)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    args = parser.parse_args()
    corpus = byte_corpus()
    Path("bench-data").mkdir(exist_ok=True)  # the benchmarks' (git-ignored) data directory
    with tempfile.TemporaryDirectory(dir="bench-data") as directory:
        runs = {name: train(name, args, corpus, Path(directory)) for name in ("adamw", "apollo-mini")}
    ratio = runs["apollo-mini"]["final_loss"] / runs["adamw"]["final_loss"]
    document = {
        "benchmark": "apollo_quality",
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "plot")},
        "apollo_mini_group": {k: v for k, v in APOLLO_MINI.items()},
        "final_loss_is_mean_of_last": TAIL,
        "summary": {
            "adamw_final_loss": runs["adamw"]["final_loss"],
            "apollo_mini_final_loss": runs["apollo-mini"]["final_loss"],
            "apollo_mini_over_adamw": round(ratio, 4),
            "state_bytes_vs_adamw": round(
                runs["apollo-mini"]["fp32_state_bytes"] / runs["adamw"]["fp32_state_bytes"], 3
            ),
            "target": "apollo_mini_over_adamw <= 1.05",
        },
        **runs,
    }
    args.output.write_text(json.dumps(document, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        axes.plot(run["losses"], label=f"offloaded {name} (final {run['final_loss']:.3f})", linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (nats per byte)")
    axes.set_title(f"GPT {args.layers}x{args.width} on stdlib source bytes, state on NVMe")
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print(json.dumps(document["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
