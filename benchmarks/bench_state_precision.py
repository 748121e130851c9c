"""Compressed optimizer state against fp32 state and DeepSpeed's update, one run, alternating.

Three sides update ``--state`` bytes of fp32-equivalent optimizer state (bf16 parameters: master
weights and two Adam moments) in sub-groups of ``--numel`` elements on the same local disk, with
the same DRAM budget, each in a fresh child process of ``bench_optimizer`` (its ``--side``):
DeepSpeed's ZeRO-Infinity update, tierstore's ``OffloadedAdamW`` with fp32 state, and tierstore
with ``--state-precision`` (:mod:`tierstore.optimizer.state_precision`). The order rotates every
repeat, so the disk's drift hits all alike. Reported: seconds per step (median of the steps after
the first; median, min and max over repeats), bytes read and written per step, and the ratios the
issue asks for: DeepSpeed / compressed, fp32 / compressed, and compressed bytes / fp32 bytes::

    .venv/bin/python -m benchmarks.bench_state_precision \\
        --output benchmarks/results/state_precision.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tierstore.optimizer.state_precision import PRESETS

from .bench_optimizer import SIZES, child, run_metadata, steady
from .common import log, parse_size, run_benchmark, spread

SIDES = ("deepspeed", "fp32", "compressed")


def side_run(side: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """One side's child process: ``bench_optimizer --side`` with the side's state precision."""
    options = copy.copy(args)
    options.state_precision = {"deepspeed": "fp32", "fp32": "fp32", "compressed": args.state_precision}[side]
    return child("deepspeed" if side == "deepspeed" else "tierstore", options, directory)


def moved(run: dict[str, Any]) -> float:
    """Bytes read plus written in a steady step."""
    return steady(run, "bytes_read") + steady(run, "bytes_written")


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        order = SIDES[repeat % len(SIDES) :] + SIDES[: repeat % len(SIDES)]
        for side in order:
            log(f"repeat {repeat}: {side} ...")
            runs[side].append(side_run(side, args, directory))
    update = {side: [steady(r, "update_s") for r in runs[side]] for side in SIDES}
    medians = {side: statistics.median(update[side]) for side in SIDES}
    bytes_moved = {side: moved(runs[side][0]) for side in SIDES}
    return {
        "benchmark": "state_precision_update",
        "metadata": run_metadata(args, directory, started),
        "runs": runs,
        "summary": {
            "update_s": {side: spread(update[side]) for side in SIDES},
            "bytes_moved_per_step": bytes_moved,
            "speedup_vs_deepspeed": round(medians["deepspeed"] / medians["compressed"], 3),
            "fp32_speedup_vs_deepspeed": round(medians["deepspeed"] / medians["fp32"], 3),
            "speedup_vs_fp32": round(medians["fp32"] / medians["compressed"], 3),
            "bytes_vs_fp32": round(bytes_moved["compressed"] / bytes_moved["fp32"], 3),
            "targets": {"speedup_vs_deepspeed": ">= 2.5", "bytes_vs_fp32": "<= 0.5"},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--state", type=parse_size, default=SIZES["state"]["cpu"], help="fp32 state bytes")
    parser.add_argument("--budget", type=parse_size, default=SIZES["budget"]["cpu"], help="DRAM budget")
    parser.add_argument("--numel", type=int, default=SIZES["numel"]["cpu"], help="elements per sub-group")
    parser.add_argument("--steps", type=int, default=SIZES["steps"]["cpu"])
    parser.add_argument(
        "--state-precision",
        choices=[name for name in PRESETS if name != "fp32"],
        default="int8-compensated",
        help="the compressed format measured against fp32",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rotations of the three sides")
    args = parser.parse_args()
    return run_benchmark(run, args, prefix="state-precision-", needs_fio=False)


if __name__ == "__main__":
    sys.exit(main())
