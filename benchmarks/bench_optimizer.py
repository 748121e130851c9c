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

Each side runs in a fresh child process (``--side``), ``--repeats`` times, alternating (A B, B A,
...), and right after each tierstore run comes its **bound**: fio replaying that run's I/O (the
same bytes read and written, concurrently, O_DIRECT, the nvme backend's request size and requests
in flight, on the files of the sub-groups moved, the writes a few files behind the reads as
tierstore's recycled files are), with the CPU idle; or the step's own compute where that is
longer. One more replay runs with the step's compute beside it in another process (``--side
compute``: on this VM the kernels' memory traffic slows the disk), the longer of the two being
the bound of a step that overlaps its I/O and its compute perfectly. Reported: seconds per step
of each side (median of the steps after the first; median, min and max over repeats), bytes
moved, DeepSpeed / tierstore, tierstore / both bounds, and the I/O model's predicted update time
over the measured one (``tierstore.pass_plan.plan_pass`` on the bandwidths the store measured during
each step and that step's compute time; the median over steady steps).

    .venv/bin/python -m benchmarks.bench_optimizer --output benchmarks/results/optimizer.json

With ``--sizes`` it measures tierstore alone at each state size instead (state larger than RAM):
seconds per GB moved (also against the same-run device bound), peak RSS against budget + model
(bf16 parameters and gradients), and the page cache's growth, a fresh process per size::

    .venv/bin/python -m benchmarks.bench_optimizer --budget 4GiB --sizes 1GiB,4GiB,16GiB,32GiB \\
        --output benchmarks/results/optimizer_scale.json

``--state-precision`` (``fp32``, ``bf16``, ``int8``, ``int8-compensated``) stores tierstore's state in a
compressed format (:mod:`tierstore.optimizer.state_precision`); ``--state`` stays its fp32 size, and
the bytes moved per step (``summary.bytes_moved``) are reported beside the step times::

    .venv/bin/python -m benchmarks.bench_optimizer --state-precision int8-compensated \
        --output benchmarks/results/optimizer_int8_compensated.json

Needs ``pip install deepspeed==0.19.8`` and Debian ``libaio-dev``; the first run JIT-builds
DeepSpeed's ops (minutes; cached in TORCH_EXTENSIONS_DIR).

With ``--device cuda`` it measures the optimizer over a model on the GPU instead (the device path:
the update on the GPU, the state streamed from the store), against its PCIe and storage bounds and
torch's fused AdamW on the GPU, alternating, in one run (see ``optimizer_gpu.py``); sized by default
to run within about two minutes on one H100 whose disk writes 1.3 GB/s::

    .venv/bin/python -m benchmarks.bench_optimizer --device cuda \\
        --output benchmarks/results/gpu/optimizer.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tierstore.backends import open_backend
from tierstore.optimizer import OffloadedAdamW, StagedOptimizer
from tierstore.optimizer.state_precision import PRESETS

from tierstore import Tier, TierStore
from tierstore.buffers import aligned_tensor
from tierstore.pass_plan import plan_pass

from . import pyspy_breakdown
from .common import (
    ROOT,
    log,
    measure_update_bound,
    metadata,
    module_command,
    parse_size,
    run_benchmark,
    run_captured,
    spread,
)

FP32 = 4
SIZES: dict[str, dict[str, int]] = {
    "state": {"cpu": parse_size("8GiB"), "cuda": parse_size("1GiB")},
    "budget": {"cpu": parse_size("2GiB"), "cuda": parse_size("320MiB")},
    "numel": {"cpu": 32 << 20, "cuda": 4 << 20},
    "steps": {"cpu": 3, "cuda": 4},
}
"""The defaults of the sizes, per ``--device``: ``cuda``'s run within about two minutes on one H100
whose disk writes 1.3 GB/s (the GPU check's share)."""
NVME_CHUNK = 4 << 20
NVME_QUEUE_DEPTH = 16
"""The nvme backend's defaults: request size and requests in flight (its worker threads)."""


def geometry(args: argparse.Namespace) -> tuple[int, int]:
    """(sub-groups, elements per sub-group) for the requested state size."""
    return max(1, args.state // (3 * FP32 * args.numel)), args.numel


def offloaded_adamw(
    args: argparse.Namespace, params: list[torch.nn.Parameter], store: TierStore
) -> OffloadedAdamW:
    """The optimizer under test, as both the tierstore side and the compute side build it: one
    sub-group per parameter, ``--budget`` of DRAM, ``--state-precision``."""
    return OffloadedAdamW(
        params,
        store,
        lr=1e-4,
        sub_group_size=args.numel,
        dram_budget=args.budget,
        state_precision=args.state_precision,
    )


def tierstore_side(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    count, numel = geometry(args)
    page_cache_before = page_cache_bytes()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel).to(torch.bfloat16)) for _ in range(count)]
    backend = open_backend({"type": "nvme", "path": str(directory / "tierstore")})
    with TierStore([Tier("nvme", backend)], cache_budget=0, workers=8) as store:
        started = time.perf_counter()
        optimizer = offloaded_adamw(args, params, store)
        init_seconds = time.perf_counter() - started
        stager = optimizer.stager

        def predicted() -> float:
            """What the I/O model predicts for the step just taken: the bandwidths the store
            measured during it, and the step's own compute time."""
            plan = plan_pass(
                store.bandwidths()["nvme"],
                stager.working_bytes + stager.area.capacity,
                [FP32 * optimizer._stored_numel(sg) for sg in optimizer.subgroups],
                working_bytes=stager.working_bytes,
                compute_seconds=optimizer.compute_seconds,
            )
            return plan.predicted_seconds

        steps = timed_steps(optimizer, params, store.tiers[0], args.steps, "tierstore", predicted)
        kept = len(stager.resident)
    return {
        "subgroups": count,
        "numel": numel,
        "kept_in_dram": kept,
        "stored_bytes": sum(FP32 * optimizer._stored_numel(sg) for sg in optimizer.subgroups),
        "model_bytes": 2 * 2 * count * numel,  # bf16 parameters and their bf16 gradients
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "page_cache_growth_bytes": page_cache_bytes() - page_cache_before,
        "init_s": round(init_seconds, 3),
        "steps": steps,
    }


def compute_side(args: argparse.Namespace) -> None:
    """The update's compute alone, beside a replay of its I/O (``common.measure_update_bound``):
    the gradient norm, then each sub-group's gradient conversion, AdamW kernel and copy into the
    bf16 model, the calls :meth:`StagedOptimizer.step` makes, on two DRAM buffers in turn instead
    of staged state, with the threads a step uses. Prints ``ready``, starts on a line from stdin,
    ends by printing its seconds."""
    count, numel = geometry(args)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel).to(torch.bfloat16)) for _ in range(count)]
    for param in params:
        param.grad = torch.randn(param.shape, dtype=torch.bfloat16).mul_(1e-3)
    with TierStore([Tier("dram", open_backend({"type": "dram"}))], cache_budget=0) as store:
        optimizer = offloaded_adamw(args, params, store)
        optimizer.step()  # step counts of 1, as in a steady step's bias correction
        # Two state buffers, faulted in beforehand as the stager's ring is.
        ring = [aligned_tensor(optimizer._stored_numel(sg)).zero_() for sg in optimizer.subgroups[:2]]
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))  # compute_threads' default
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.perf_counter()
        coefficient = optimizer._gradient_coefficient(1.0)
        assert coefficient is not None
        for index, sg in enumerate(optimizer.subgroups):
            stored = ring[index % 2][: optimizer._stored_numel(sg)]
            optimizer._in_precision(sg, stored, optimizer._update, coefficient)  # unpacked, updated, packed
        print(round(time.perf_counter() - started, 3), flush=True)


def timed_steps(
    optimizer: StagedOptimizer,
    params: list[torch.nn.Parameter],
    tier: Tier,
    count: int,
    name: str,
    predicted: Callable[[], float] | None = None,
) -> list[dict[str, Any]]:
    """``count`` optimizer steps on fresh small bf16 gradients: seconds of each, the part of them
    spent computing rather than waiting on the store, the seconds the tier's paths had requests in
    flight, tier bytes, and what ``predicted`` (called after the step) says it should have taken."""
    steps = []
    for step in range(count):
        for param in params:
            param.grad = torch.randn(param.shape, dtype=torch.bfloat16).mul_(1e-3)
        read, written = tier.bytes_read, tier.bytes_written
        busy = sum(path.busy_seconds for path in tier.paths)
        started = time.perf_counter()
        optimizer.step()
        seconds = time.perf_counter() - started
        steps.append(
            {
                "step": step,
                "update_s": round(seconds, 3),
                "compute_s": round(optimizer.compute_seconds, 3),
                "device_busy_s": round(sum(path.busy_seconds for path in tier.paths) - busy, 3),
                "bytes_read": tier.bytes_read - read,
                "bytes_written": tier.bytes_written - written,
            }
        )
        if predicted is not None:
            steps[-1]["predicted_update_s"] = round(predicted(), 3)
        log(f"  {name} step {step}: {seconds:.2f} s")
    return steps


def page_cache_bytes() -> int:
    """The kernel's file page cache, which O_DIRECT I/O must not grow: ``Cached`` in /proc/meminfo
    less ``Shmem`` (shared anonymous memory, such as DeepSpeed's or torch's shared maps, counts
    as cached)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["Cached"].split()[0]) - int(fields["Shmem"].split()[0])) * 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def deepspeed_side(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
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


def predicted_over_measured(side: dict[str, Any]) -> float:
    """The median over steady steps of each step's predicted over its measured update time: a
    step's prediction uses the bandwidths measured during that step, so the disk's drift between
    steps (1.5x at 32 GiB) tests the model's structure, not the disk's mood."""
    steps = side["steps"][1:] or side["steps"]
    return round(statistics.median(s["predicted_update_s"] / s["update_s"] for s in steps), 3)


def bounded(run: dict[str, Any], directory: Path, beside: list[str] | None = None) -> dict[str, float]:
    """A tierstore run's bound: its steady step can be no faster than fio replaying the step's I/O
    (the device bound, ``device_s``) nor than the step's own compute (``compute_s``: the kernels,
    the gradient norm and conversion, the copies into the model; what the step spent not waiting on
    the store). ``bound_s`` is the larger; a step that moves nothing is bound by its compute.
    ``beside``: also replay the I/O with that command (the ``compute`` side) running beside it."""
    compute = steady(run, "compute_s")
    read, written = int(steady(run, "bytes_read")), int(steady(run, "bytes_written"))
    if not read + written:
        return {"compute_s": compute, "bound_s": compute}
    device = measure_update_bound(
        directory,
        read_bytes=read,
        write_bytes=written,
        files=max(1, run["subgroups"] - run["kept_in_dram"]),
        request_bytes=NVME_CHUNK,
        in_flight=NVME_QUEUE_DEPTH,
        beside=beside,
    )
    return {
        **device,
        "device_s": device["bound_s"],
        "compute_s": compute,
        "bound_s": max(device["bound_s"], compute),
    }


def update_phase(args: argparse.Namespace) -> dict[str, int]:
    """An update-phase benchmark's settings in its metadata: the DRAM budget (``--budget``), the
    elements per sub-group (``--numel``) and the steps (``--steps``)."""
    return {"dram_budget_bytes": args.budget, "subgroup_numel": args.numel, "steps": args.steps}


def run_metadata(args: argparse.Namespace, directory: Path, started: float) -> dict[str, Any]:
    """The run's metadata: its sizes and repeats, where and with what it ran, and its duration
    since ``started`` (a ``time.perf_counter()``)."""
    return {
        **metadata(
            directory,
            state_bytes=args.state,
            state_precision=args.state_precision,
            **update_phase(args),
            repeats=args.repeats,
        ),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def child_command(side: str, args: argparse.Namespace, directory: Path) -> list[str]:
    return [
        *module_command("bench_optimizer"),
        f"--side={side}",
        f"--dir={directory}",
        f"--state={args.state}",
        f"--budget={args.budget}",
        f"--numel={args.numel}",
        f"--steps={args.steps}",
        f"--state-precision={args.state_precision}",
    ]


def child(side: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """One side in a fresh process: each has the machine and its page cache to itself."""
    done = run_captured(child_command(side, args, directory), f"{side} side", cwd=ROOT)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def profiled(args: argparse.Namespace, directory: Path) -> dict[str, dict[str, float]]:
    """An extra tierstore run under py-spy (not timed: sampling slows it a little)."""
    samples = directory / "pyspy.txt"
    pyspy_breakdown.record(child_command("tierstore", args, directory), samples, cwd=ROOT)
    return pyspy_breakdown.breakdown(samples, phase=re.compile(r"^\w+\.step \(.*engine\.py"))


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Repeats alternate tierstore and DeepSpeed, each tierstore run followed by its device bound
    (fio replaying its I/O), so the disk's drift hits all alike; figures are medians of repeats."""
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"tierstore": [], "deepspeed": [], "device_bound": []}
    for repeat in range(args.repeats):
        sides = ["tierstore", "deepspeed"] if repeat % 2 == 0 else ["deepspeed", "tierstore"]
        for side in sides:
            log(f"repeat {repeat}: {side} (child process) ...")
            runs[side].append(child(side, args, directory))
            if side == "tierstore":  # the bound right after it: the disk in the same mood
                ours = runs["tierstore"][-1]
                log(f"repeat {repeat}: device bound (fio) ...")
                compute = child_command("compute", args, directory)
                runs["device_bound"].append(bounded(ours, directory, beside=compute))
    profile = None
    if args.profile:
        log("tierstore under py-spy ...")
        profile = profiled(args, directory)
    update = {side: [steady(r, "update_s") for r in runs[side]] for side in ("tierstore", "deepspeed")}
    bound = [b["bound_s"] for b in runs["device_bound"]]
    compute_bound = [b["bound_with_compute_s"] for b in runs["device_bound"]]
    over_bound = [u / b for u, b in zip(update["tierstore"], bound, strict=True)]
    over_compute_bound = [u / b for u, b in zip(update["tierstore"], compute_bound, strict=True)]
    predicted = [predicted_over_measured(r) for r in runs["tierstore"]]
    return {
        "benchmark": "optimizer_update_phase",
        "metadata": run_metadata(args, directory, started),
        "runs": runs,
        "profile_seconds": profile,
        "summary": {
            "tierstore_update_s": spread(update["tierstore"]),
            "deepspeed_update_s": spread(update["deepspeed"]),
            "device_bound_s": spread(bound),
            "speedup_vs_deepspeed": round(
                statistics.median(update["deepspeed"]) / statistics.median(update["tierstore"]), 3
            ),
            "tierstore_over_device_bound": spread(over_bound),
            "bound_with_compute_s": spread(compute_bound),
            "tierstore_over_bound_with_compute": spread(over_compute_bound),
            "predicted_over_measured": spread(predicted),
            "bytes_moved": {
                "tierstore": steady(runs["tierstore"][0], "bytes_read")
                + steady(runs["tierstore"][0], "bytes_written"),
                "deepspeed": steady(runs["deepspeed"][0], "bytes_read")
                + steady(runs["deepspeed"][0], "bytes_written"),
            },
            "targets": {
                "speedup_vs_deepspeed": ">= 1.5",
                "tierstore_over_device_bound": "<= 1.1",
                "predicted_over_measured": "0.85 - 1.15",
            },
        },
    }


def scale(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """State larger than RAM: tierstore alone at each of ``--sizes`` with one budget, a fresh
    process each; cost per GB moved and peak RSS against budget + model, per size. Each run is
    followed at once by its bound (:func:`bounded`: fio replaying its I/O, or its own compute): the
    disk drifts 2-3x between runs minutes apart, and a step whose sub-groups mostly stay in DRAM is
    bound by its kernels, not its bytes, so the cost is also given against that bound."""
    started = time.perf_counter()
    sizes = []
    for state in args.sizes:
        log(f"state {state / 2**30:.0f} GiB ...")
        result = child("tierstore", argparse.Namespace(**{**vars(args), "state": state}), directory)
        moved = steady(result, "bytes_read") + steady(result, "bytes_written")
        limit = args.budget + result["model_bytes"]
        log(f"state {state / 2**30:.0f} GiB: bound (fio replaying its I/O) ...")
        bound = bounded(result, directory)
        update = steady(result, "update_s")
        sizes.append(
            {
                "state_bytes": state,
                "update_s": update,
                "bytes_moved": moved,
                "s_per_gb": round(update / (moved / 1e9), 4) if moved else None,
                "device_s_per_gb": round(bound["device_s"] / (moved / 1e9), 4) if moved else None,
                "bound": bound,
                "over_bound": round(update / bound["bound_s"], 3),
                "peak_rss_bytes": result["peak_rss_bytes"],
                "budget_plus_model_bytes": limit,
                "peak_rss_over_budget_plus_model": round(result["peak_rss_bytes"] / limit, 3),
                "page_cache_growth_bytes": result["page_cache_growth_bytes"],
                "predicted_over_measured": predicted_over_measured(result),
                "run": result,
            }
        )
    per_gb = [size["s_per_gb"] for size in sizes if size["s_per_gb"] is not None]  # None: all kept in DRAM
    over_bound = [size["over_bound"] for size in sizes]
    return {
        "benchmark": "optimizer_state_scale",
        "metadata": {
            **metadata(directory, **update_phase(args)),
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "sizes": sizes,
        "summary": {
            "s_per_gb_spread": round(max(per_gb) / min(per_gb) - 1, 3) if per_gb else None,
            "over_bound_spread": round(max(over_bound) / min(over_bound) - 1, 3),
            "worst_peak_rss_over_budget_plus_model": max(
                size["peak_rss_over_budget_plus_model"] for size in sizes
            ),
            "targets": {"s_per_gb_spread": "<= 0.10", "worst_peak_rss_over_budget_plus_model": "<= 1.10"},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the model is (and the update runs)"
    )
    parser.add_argument("--state", type=parse_size, default=None, help="fp32 state bytes")
    parser.add_argument("--budget", type=parse_size, default=None, help="DRAM budget bytes")
    parser.add_argument("--numel", type=int, default=None, help="elements per sub-group")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--state-precision",
        choices=list(PRESETS),
        default="fp32",
        help="how tierstore stores the state (--state is its fp32 size); bytes moved per step are reported",
    )
    parser.add_argument(
        "--gpu-budget", type=parse_size, default=parse_size("128MiB"), help="--device cuda: GPU budget"
    )
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats of each side")
    parser.add_argument("--profile", action="store_true", help="add a py-spy breakdown of a tierstore run")
    parser.add_argument(
        "--sizes",
        type=lambda text: [parse_size(size) for size in text.split(",")],
        default=None,
        help="state sizes, e.g. 1GiB,4GiB,16GiB,32GiB: tierstore alone at each (state larger than RAM)",
    )
    parser.add_argument("--side", choices=["tierstore", "deepspeed", "compute"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, defaults in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[args.device])
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "bench_optimizer --device cuda needs a CUDA device (torch.cuda.is_available() is False)"
            )
        from . import optimizer_gpu

        return run_benchmark(optimizer_gpu.run, args, prefix="optimizer-gpu-", needs_fio=False)
    if args.side == "compute":
        compute_side(args)
        return 0
    if args.side is not None:
        side = tierstore_side if args.side == "tierstore" else deepspeed_side
        print(json.dumps(side(args, args.dir)))
        return 0
    if args.sizes is not None:
        return run_benchmark(scale, args, prefix="optimizer-scale-")
    return run_benchmark(run, args, prefix="optimizer-")


if __name__ == "__main__":
    sys.exit(main())
