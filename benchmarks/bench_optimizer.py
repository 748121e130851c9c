"""Update phase of an offloaded optimizer: tierstore's OffloadedAdamW vs DeepSpeed's, one run.

Both sides update ``--state`` bytes of fp32 optimizer state (master weights and two Adam moments)
in sub-groups of ``--numel`` elements on the same local disk, with the same DRAM budget:

* **tierstore**: :class:`~tierstore.optimizer.OffloadedAdamW` over an NVMe (O_DIRECT) tier,
  ``dram_budget = --budget``; bf16 gradients stay in memory and are converted per sub-group.
* **DeepSpeed** (ZeRO-Infinity's path, 0.19.x): its ``PipelinedOptimizerSwapper`` with
  ``DeepSpeedCPUAdam``, driven in ``stage3.py``'s order (swap in with the next sub-group
  prefetched, Adam, copy into the bf16 partition, swap out), ``buffer_count`` buffers of one
  sub-group tensor so that the buffers equal the same budget; its fp32 gradients are swapped out
  first, as its backward pass does (timed apart, not in the update phase).

Reported per side: seconds per step (median of the steps after the first), bytes read and
written, and the ratio DeepSpeed / tierstore. The lower bound is tierstore's bytes read / fio's
best read GB/s + bytes written / fio's best write GB/s (fio in the same run, before and after).
DeepSpeed runs in a child process (``--side deepspeed``), so each side has the machine alone.

    .venv/bin/python benchmarks/bench_optimizer.py --output benchmarks/results/optimizer.json

Needs ``pip install deepspeed==0.19.8`` and Debian ``libaio-dev``; the first run JIT-builds
DeepSpeed's ops (minutes; cached in TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import log, measure_fio, metadata, parse_size, run_benchmark
from tierstore.backends import open_backend
from tierstore.optimizer import OffloadedAdamW

from tierstore import Tier, TierStore

FP32 = 4


def geometry(args: argparse.Namespace) -> tuple[int, int]:
    """(sub-groups, elements per sub-group) for the requested state size."""
    return max(1, args.state // (3 * FP32 * args.numel)), args.numel


def tierstore_side(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    count, numel = geometry(args)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel).to(torch.bfloat16)) for _ in range(count)]
    backend = open_backend({"type": "nvme", "path": str(directory / "tierstore")})
    with TierStore([Tier("nvme", backend)], cache_budget=0, workers=8) as store:
        started = time.perf_counter()
        optimizer = OffloadedAdamW(params, store, lr=1e-4, sub_group_size=numel, dram_budget=args.budget)
        init_seconds = time.perf_counter() - started
        tier = store.tiers[0]
        steps = []
        for step in range(args.steps):
            for param in params:
                param.grad = torch.randn(numel, dtype=torch.bfloat16).mul_(1e-3)
            read, written = tier.bytes_read, tier.bytes_written
            started = time.perf_counter()
            optimizer.step()
            seconds = time.perf_counter() - started
            steps.append(
                {
                    "step": step,
                    "update_s": round(seconds, 3),
                    "bytes_read": tier.bytes_read - read,
                    "bytes_written": tier.bytes_written - written,
                }
            )
            log(f"  tierstore step {step}: {seconds:.2f} s")
        kept = len(optimizer.stager.resident)
    return {
        "subgroups": count,
        "numel": numel,
        "kept_in_dram": kept,
        "init_s": round(init_seconds, 3),
        "steps": steps,
    }


def deepspeed_side(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29531",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import PipelinedOptimizerSwapper
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
    from deepspeed.utils.timer import SynchronizedWallClockTimer

    deepspeed.init_distributed(dist_backend="gloo")
    count, numel = geometry(args)
    buffers = args.budget // (FP32 * numel)
    if buffers < 12:
        raise SystemExit(f"DeepSpeed's pipelined swapper needs >= 12 buffers; the budget gives {buffers}")
    folder = directory / "deepspeed"
    folder.mkdir(parents=True, exist_ok=True)
    swap_config = DeepSpeedZeroOffloadOptimizerConfig(
        device="nvme", nvme_path=str(folder), pipeline_read=True, pipeline_write=True, buffer_count=buffers
    )
    aio = get_aio_config(
        {
            "aio": {
                "block_size": 1 << 20,
                "queue_depth": 16,
                "intra_op_parallelism": 1,
                "single_submit": False,
                "overlap_events": True,
                "use_gds": False,
            }
        }
    )
    masters = []
    for index in range(count):
        tensor = torch.empty(0, dtype=torch.float32)
        tensor.ds_id = f"{index}_{index}"  # type: ignore[attr-defined]  # DeepSpeed's tag, not torch's
        tensor.requires_grad = True
        masters.append(tensor)
    following = [*masters[1:], None]
    torch.manual_seed(0)
    partitions = [torch.randn(numel).to(torch.bfloat16) for _ in range(count)]
    adam = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    adam.param_groups[0]["params"] = []
    swapper = PipelinedOptimizerSwapper(
        swap_config=swap_config,
        aio_config=aio,
        base_folder=str(folder),
        optimizer=adam,
        largest_numel=numel,
        device="cpu",
        dtype=torch.float32,
        timers=SynchronizedWallClockTimer(),
    )
    started = time.perf_counter()
    swapper.initialize_parameters(parameters=masters, src_tensors=partitions)
    zeros = torch.zeros(numel)
    for index in range(count):  # stage3.initialize_optimizer_states: create the moments on disk
        swapper.swap_in_optimizer_state(parameter=masters[index], async_parameter=following[index])
        masters[index].grad = zeros
        swapper.swap_out_optimizer_state(parameter=masters[index], async_swap=following[index] is not None)
        masters[index].grad = None
    init_seconds = time.perf_counter() - started
    steps = []
    for step in range(args.steps):
        started = time.perf_counter()
        for index in range(count):  # backward: fp32 gradients go to disk
            gradient = torch.randn(numel).mul_(1e-3)
            swapper.swap_out_gradients(
                parameter=masters[index], gradient_offsets=[0], gradient_tensors=[gradient]
            )
        gradient_seconds = time.perf_counter() - started
        started = time.perf_counter()
        for index in range(count):
            swapper.swap_in_optimizer_state(parameter=masters[index], async_parameter=following[index])
            adam.param_groups[0]["params"] = [masters[index]]
            adam.step()
            adam.param_groups[0]["params"] = []
            partitions[index].copy_(masters[index].data)
            swapper.swap_out_optimizer_state(
                parameter=masters[index], async_swap=following[index] is not None
            )
            masters[index].grad = None
        seconds = time.perf_counter() - started
        steps.append(
            {
                "step": step,
                "update_s": round(seconds, 3),
                "gradient_swap_out_s": round(gradient_seconds, 3),
                "bytes_read": 4 * count * numel * FP32,
                "bytes_written": 3 * count * numel * FP32,
            }
        )
        log(f"  deepspeed step {step}: {seconds:.2f} s (+ {gradient_seconds:.2f} s gradient swap-out)")
    return {
        "subgroups": count,
        "numel": numel,
        "buffer_count": buffers,
        "init_s": round(init_seconds, 3),
        "steps": steps,
        "version": deepspeed.__version__,
    }


def steady(side: dict[str, Any], field: str) -> float:
    values = [step[field] for step in side["steps"][1:]] or [side["steps"][0][field]]
    return float(statistics.median(values))


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    fio = [measure_fio(directory, 1 << 30)]
    log("tierstore ...")
    ours = tierstore_side(args, directory)
    log("deepspeed (child process) ...")
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--side",
            "deepspeed",
            "--dir",
            str(directory),
            "--state",
            str(args.state),
            "--budget",
            str(args.budget),
            "--numel",
            str(args.numel),
            "--steps",
            str(args.steps),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        raise RuntimeError(f"DeepSpeed side failed:\n{child.stderr[-3000:]}")
    theirs = json.loads(child.stdout.strip().splitlines()[-1])
    fio.append(measure_fio(directory, 1 << 30))
    best_read = max(f["fio_read"] for f in fio)
    best_write = max(f["fio_write"] for f in fio)
    our_seconds, their_seconds = steady(ours, "update_s"), steady(theirs, "update_s")
    bound = steady(ours, "bytes_read") / best_read + steady(ours, "bytes_written") / best_write
    return {
        "benchmark": "optimizer_update_phase",
        "metadata": {
            **metadata(
                directory,
                state_bytes=args.state,
                dram_budget_bytes=args.budget,
                subgroup_numel=args.numel,
                steps=args.steps,
            ),
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "tierstore": ours,
        "deepspeed": theirs,
        "fio_gb_per_s": [{k: round(v / 1e9, 3) for k, v in f.items()} for f in fio],
        "summary": {
            "tierstore_update_s": our_seconds,
            "deepspeed_update_s": their_seconds,
            "speedup_vs_deepspeed": round(their_seconds / our_seconds, 3),
            "lower_bound_s": round(bound, 3),
            "tierstore_over_lower_bound": round(our_seconds / bound, 3),
            "targets": {"speedup_vs_deepspeed": ">= 2.5", "tierstore_over_lower_bound": "<= 1.2"},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--state", type=parse_size, default=parse_size("8GiB"), help="fp32 state bytes")
    parser.add_argument("--budget", type=parse_size, default=parse_size("2GiB"), help="DRAM budget bytes")
    parser.add_argument("--numel", type=int, default=32 << 20, help="elements per sub-group")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--side", choices=["deepspeed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "deepspeed":
        print(json.dumps(deepspeed_side(args, args.dir)))
        return 0
    return run_benchmark(run, args, prefix="optimizer-")


if __name__ == "__main__":
    sys.exit(main())
