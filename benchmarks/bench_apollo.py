"""Update phase of offloaded APOLLO-Mini vs offloaded AdamW vs DeepSpeed's swapper + CPU Adam, one run.

All three update a model of ``--state`` bytes of AdamW fp32 state (master weights and two moments,
12 bytes per parameter) on the same local disk with the same DRAM budget. The model is matrices of
``--numel`` elements (``--rows`` rows), one per sub-group, since APOLLO projects whole matrices:

* **apollo-mini**: :class:`~tierstore.optimizer.OffloadedAPOLLO`, rank 1, tensor scaling: the
  master weights plus 2 x rows + 1 values per matrix (about 4 bytes per parameter);
* **adamw**: :class:`~tierstore.optimizer.OffloadedAdamW` over the same tier and budget;
* **deepspeed**: ``bench_optimizer.py``'s DeepSpeed side (``PipelinedOptimizerSwapper`` +
  ``DeepSpeedCPUAdam``) in a child process, same state, budget and sub-group size.

Reported per side: seconds per step (median of the steps after the first) and bytes read and
written; the summary gives APOLLO-Mini's bytes and time as ratios to the others'. Targets (issue
16): bytes <= 0.4x AdamW's, >= 2.5x faster than offloaded AdamW, >= 3x faster than DeepSpeed.

    .venv/bin/python -m benchmarks.bench_apollo --output benchmarks/results/apollo.json

``--no-deepspeed`` leaves the DeepSpeed side out (it needs ``deepspeed`` and Debian ``libaio-dev``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tierstore.backends import open_backend
from tierstore.optimizer import OffloadedAdamW, OffloadedAPOLLO, StagedOptimizer

from tierstore import Tier, TierStore

from .bench_optimizer import steady, timed_steps, update_phase
from .common import ROOT, log, measure_fio, metadata, module_command, parse_size, run_benchmark, run_captured

STATE_BYTES_PER_PARAM = 12  # AdamW: fp32 master weights + two moments

Factory = Callable[[list[torch.nn.Parameter], TierStore, argparse.Namespace], StagedOptimizer]


def apollo_mini(
    params: list[torch.nn.Parameter], store: TierStore, args: argparse.Namespace
) -> StagedOptimizer:
    group = {"params": params, "rank": 1, "scale_type": "tensor", "scale": 128.0, "proj": "random"}
    return OffloadedAPOLLO([group], store, lr=1e-4, sub_group_size=args.numel, dram_budget=args.budget)


def adamw(params: list[torch.nn.Parameter], store: TierStore, args: argparse.Namespace) -> StagedOptimizer:
    return OffloadedAdamW(params, store, lr=1e-4, sub_group_size=args.numel, dram_budget=args.budget)


def offloaded_side(args: argparse.Namespace, directory: Path, name: str, make: Factory) -> dict[str, Any]:
    count = max(1, args.state // (STATE_BYTES_PER_PARAM * args.numel))
    shape = (args.rows, args.numel // args.rows)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16)) for _ in range(count)]
    backend = open_backend({"type": "nvme", "path": str(directory / name)})
    with TierStore([Tier("nvme", backend)], cache_budget=0, workers=8) as store:
        started = time.perf_counter()
        optimizer = make(params, store, args)
        init_seconds = time.perf_counter() - started
        steps = timed_steps(optimizer, params, store.tiers[0], args.steps, name)
        state_bytes = sum(4 * optimizer.state_numel(sg) for sg in optimizer.subgroups)
        kept = len(optimizer.stager.resident)
    shutil.rmtree(directory / name, ignore_errors=True)  # the next side gets the disk to itself
    return {
        "subgroups": count,
        "matrix": list(shape),
        "state_bytes": state_bytes,
        "kept_in_dram": kept,
        "init_s": round(init_seconds, 3),
        "steps": steps,
    }


def deepspeed_side(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """bench_optimizer.py's DeepSpeed side, in a child process, over the same state and budget."""
    command = [*module_command("bench_optimizer"), "--side", "deepspeed", "--dir", str(directory)]
    command += ["--state", str(args.state), "--budget", str(args.budget), "--numel", str(args.numel)]
    child = run_captured([*command, "--steps", str(args.steps)], "DeepSpeed side", cwd=ROOT)
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return result


def moved(side: dict[str, Any]) -> float:
    return steady(side, "bytes_read") + steady(side, "bytes_written")


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    fio = measure_fio(directory, min(1 << 30, args.state))
    log("offloaded APOLLO-Mini ...")
    mini = offloaded_side(args, directory, "apollo-mini", apollo_mini)
    log("offloaded AdamW ...")
    plain = offloaded_side(args, directory, "adamw", adamw)
    sides: dict[str, Any] = {"apollo_mini": mini, "adamw": plain}
    seconds = steady(mini, "update_s")
    summary: dict[str, Any] = {
        "apollo_mini_update_s": seconds,
        "adamw_update_s": steady(plain, "update_s"),
        "apollo_mini_bytes_moved": moved(mini),
        "adamw_bytes_moved": moved(plain),
        "bytes_vs_adamw": round(moved(mini) / moved(plain), 3),
        "speedup_vs_adamw": round(steady(plain, "update_s") / seconds, 3),
    }
    if not args.no_deepspeed:
        log("deepspeed (child process) ...")
        sides["deepspeed"] = theirs = deepspeed_side(args, directory)
        summary["deepspeed_update_s"] = steady(theirs, "update_s")
        summary["deepspeed_bytes_moved"] = moved(theirs)
        summary["speedup_vs_deepspeed"] = round(steady(theirs, "update_s") / seconds, 3)
    summary["targets"] = {
        "bytes_vs_adamw": "<= 0.4",
        "speedup_vs_adamw": ">= 2.5",
        "speedup_vs_deepspeed": ">= 3",
    }
    return {
        "benchmark": "apollo_update_phase",
        "metadata": {
            **metadata(directory, adamw_state_bytes=args.state, matrix_rows=args.rows, **update_phase(args)),
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        **sides,
        "fio_gb_per_s": {k: round(v / 1e9, 3) for k, v in fio.items()},
        "summary": summary,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--state", type=parse_size, default=parse_size("8GiB"), help="AdamW fp32 state bytes")
    parser.add_argument("--budget", type=parse_size, default=parse_size("2GiB"), help="DRAM budget bytes")
    parser.add_argument("--numel", type=int, default=32 << 20, help="elements per matrix (one sub-group)")
    parser.add_argument("--rows", type=int, default=4096, help="rows of each matrix (divides --numel)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-deepspeed", action="store_true", help="leave the DeepSpeed side out")
    args = parser.parse_args()
    if args.numel % args.rows:
        parser.error(f"--rows {args.rows} does not divide --numel {args.numel}")
    return run_benchmark(run, args, prefix="apollo-")


if __name__ == "__main__":
    sys.exit(main())
