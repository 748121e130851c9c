"""The offloaded AdamW over a model on a GPU (``bench_optimizer.py --device cuda``): its step time
against its bounds and torch's own fused AdamW, side by side in one run.

A bf16 model whose fp32 state (master weights and two moments, 12 bytes per parameter) is
``--state`` bytes, cut into sub-groups of ``--numel`` elements, on one GPU, with small random bf16
gradients. Three variants alternate within each repeat (their order rotates from repeat to repeat):

* ``storage``: tierstore's :class:`~tierstore.optimizer.OffloadedAdamW` with ``gpu_budget =
  --gpu-budget`` of the state kept on the GPU, ``dram_budget = --budget`` of pinned host memory, and
  the rest on an NVMe tier under ``--dir``: the state beyond host memory;
* ``host``: the same, with a ``dram_budget`` that holds the whole state in pinned host memory (the
  Megatron-style setup): once it is read in, a step moves nothing but the bus's bytes;
* ``torch``: ``torch.optim.AdamW(fused=True)`` over fp32 master copies of the parameters, state and
  all on the GPU (the floor).

Right after each repeat's tierstore variants, their bounds, measured in the same run:

* ``pcie_s``: the bytes a steady step copies up and down, replayed alone: copies of one sub-group's
  state each, both directions at once on two streams, from and to page-locked memory;
* ``storage_s``: the bytes the tier read and wrote in a steady step, over the disk's read and write
  bandwidth as the store's probe measures them on the same tier (one disk: the times add);
* the device bound, the larger of the two.

Reported: steady step seconds of each variant (median of the steps after the first two, which read
the state in and fill the caches; median, min and max over repeats), the ratios storage /
device bound (target <= 1.10) and host / PCIe bound (target <= 1.10), each over torch's, and the GPU
memory a step allocates beyond the model and its gradients (``torch.cuda.max_memory_allocated``)
over ``gpu_budget`` + the ring (``device_staging_bytes``), target <= 1.0.

    python -m benchmarks.bench_optimizer --device cuda --output benchmarks/results/gpu/optimizer.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tierstore.backends import open_backend
from tierstore.optimizer import OffloadedAdamW
from tierstore.optimizer.device import DeviceStager

from tierstore import Tier, TierStore
from tierstore.bandwidth import probe

from .common import cuda_run, log, metadata, spread

STATE_BYTES_PER_PARAM = 12
"""fp32 master weights and two moments of a bf16 parameter."""
VARIANTS = ("storage", "host", "torch")
TARGETS = {"storage_over_device_bound": 1.10, "host_over_pcie_bound": 1.10, "device_memory_over_bound": 1.0}
PROBE_BYTES = 256 << 20
"""Bytes the disk's probe writes and reads back (a few sub-groups: the sizes the step moves)."""
PAGE = 4096


class Model:
    """``count`` bf16 parameters of ``numel`` elements on the GPU, with fixed small gradients."""

    def __init__(self, state_bytes: int, numel: int) -> None:
        self.numel = numel
        self.count = max(1, state_bytes // (STATE_BYTES_PER_PARAM * numel))
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.params = [
            torch.nn.Parameter(torch.randn(numel, device="cuda", generator=generator).bfloat16())
            for _ in range(self.count)
        ]
        for param in self.params:
            param.grad = torch.randn(numel, device="cuda", generator=generator).mul_(1e-3).bfloat16()

    @property
    def state_bytes(self) -> int:
        return STATE_BYTES_PER_PARAM * self.numel * self.count


def tierstore_variant(
    model: Model, directory: Path, *, dram_budget: int, gpu_budget: int, steps: int
) -> dict[str, Any]:
    """Steps of tierstore's AdamW over the model, the state's store on an NVMe tier: seconds, tier
    bytes, bus bytes and the GPU memory each step allocates beyond what was allocated before it."""
    folder = directory / "state"
    try:
        with TierStore([Tier("nvme", open_backend(f"nvme://{folder}"))], cache_budget=0, workers=8) as store:
            optimizer = OffloadedAdamW(
                model.params,
                store,
                lr=1e-4,
                sub_group_size=model.numel,
                dram_budget=dram_budget,
                gpu_budget=gpu_budget,
            )
            stager = optimizer.stager
            assert isinstance(stager, DeviceStager)
            tier = store.tiers[0]
            records = []
            for step in range(steps):
                streamed = sum(
                    4 * optimizer.state_numel(sg)
                    for sg in optimizer.subgroups
                    if sg.index not in stager.on_device
                )
                read, written = tier.bytes_read, tier.bytes_written
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                started = time.perf_counter()
                optimizer.step()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                records.append(
                    {
                        "step": step,
                        "step_s": round(seconds, 4),
                        "bytes_read": tier.bytes_read - read,
                        "bytes_written": tier.bytes_written - written,
                        "pcie_bytes_each_way": streamed,
                        "device_bytes_above": torch.cuda.max_memory_allocated() - before,
                    }
                )
                log(f"    step {step}: {seconds:.3f} s")
            result = {
                "steps": records,
                "subgroups": len(optimizer.subgroups),
                "kept_on_device": len(stager.on_device),
                "kept_in_host_memory": len(stager.resident),
                "dram_budget": stager.dram_budget,
                "gpu_budget": gpu_budget,
                "device_staging_bytes": optimizer.device_staging_bytes,
                "slot_bytes": stager.slot_bytes,
            }
            optimizer.close()
            return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def torch_variant(model: Model, steps: int) -> dict[str, Any]:
    """Steps of torch's fused AdamW over fp32 master copies of the parameters, all on the GPU."""
    masters = [torch.nn.Parameter(param.detach().float()) for param in model.params]
    for master, param in zip(masters, model.params, strict=True):
        master.grad = param.grad.float()  # type: ignore[union-attr]
    optimizer = torch.optim.AdamW(masters, lr=1e-4, fused=True)
    records = []
    for step in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        optimizer.step()
        torch.cuda.synchronize()
        records.append({"step": step, "step_s": round(time.perf_counter() - started, 4)})
    del optimizer, masters
    torch.cuda.empty_cache()
    return {"steps": records}


def pcie_seconds(bytes_each_way: int, chunk: int) -> float:
    """Seconds to copy ``bytes_each_way`` up and as many down at once, in copies of ``chunk``
    bytes on two streams, between page-locked host memory and the GPU (best of two)."""
    if bytes_each_way == 0:
        return 0.0
    host = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    device = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(2)]
    up, down = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    copies = -(-bytes_each_way // chunk)
    best = float("inf")
    for _ in range(2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(copies):
            with torch.cuda.stream(up):
                device[0].copy_(host[0], non_blocking=True)
            with torch.cuda.stream(down):
                host[1].copy_(device[1], non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def storage_seconds(directory: Path, bytes_read: int, bytes_written: int) -> dict[str, float]:
    """The disk's bandwidth by the store's probe on an NVMe tier in ``directory``, and the seconds
    it takes to read and write the step's bytes at it (one disk: the times add)."""
    if bytes_read + bytes_written == 0:
        return {"storage_s": 0.0}
    folder = directory / "probe"
    backend = open_backend(f"nvme://{folder}")
    try:
        measured = probe(backend, PROBE_BYTES).bandwidth
    finally:
        backend.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "disk_read_gb_s": round(measured.read / 1e9, 3),
        "disk_write_gb_s": round(measured.write / 1e9, 3),
        "storage_s": bytes_read / measured.read + bytes_written / measured.write,
    }


def steady(run: dict[str, Any], field: str) -> float:
    """The median of ``field`` over the steps after the first two (which read the state in)."""
    values = [step[field] for step in run["steps"][2:]] or [run["steps"][-1][field]]
    return float(statistics.median(values))


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Repeats alternate the three variants, each repeat's bounds measured right after it."""
    started = time.perf_counter()
    model = Model(args.state, args.numel)
    ring = (2 + 3) * STATE_BYTES_PER_PARAM * args.numel  # prefetch_depth 2 + the pipeline's 3
    whole = ring + model.count * (STATE_BYTES_PER_PARAM * args.numel + PAGE)
    repeats: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        order = list(VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3])
        log(f"repeat {repeat + 1}/{args.repeats}: {', '.join(order)}")
        figures: dict[str, Any] = {}
        for variant in order:
            log(f"  {variant} ...")
            if variant == "torch":
                figures[variant] = torch_variant(model, args.steps)
            else:
                budget = args.budget if variant == "storage" else whole
                figures[variant] = tierstore_variant(
                    model, directory, dram_budget=budget, gpu_budget=args.gpu_budget, steps=args.steps
                )
        storage = figures["storage"]
        chunk = storage["slot_bytes"]
        figures["bounds"] = {
            "storage": {
                **storage_seconds(
                    directory, int(steady(storage, "bytes_read")), int(steady(storage, "bytes_written"))
                ),
                "pcie_s": pcie_seconds(int(steady(storage, "pcie_bytes_each_way")), chunk),
            },
            "host": {"pcie_s": pcie_seconds(int(steady(figures["host"], "pcie_bytes_each_way")), chunk)},
        }
        bound = figures["bounds"]["storage"]
        bound["device_s"] = max(bound["storage_s"], bound["pcie_s"])
        repeats.append(figures)

    def ratios(name: str) -> list[float]:
        values = []
        for figures in repeats:
            step = {variant: steady(figures[variant], "step_s") for variant in VARIANTS}
            bounds = figures["bounds"]
            values.append(
                {
                    "storage_over_device_bound": step["storage"] / max(bounds["storage"]["device_s"], 1e-9),
                    "host_over_pcie_bound": step["host"] / max(bounds["host"]["pcie_s"], 1e-9),
                    "storage_over_torch": step["storage"] / step["torch"],
                    "host_over_torch": step["host"] / step["torch"],
                }[name]
            )
        return values

    memory = [
        max(step["device_bytes_above"] for step in figures[variant]["steps"])
        / (figures[variant]["gpu_budget"] + figures[variant]["device_staging_bytes"])
        for figures in repeats
        for variant in ("storage", "host")
    ]
    step_seconds = {
        variant: spread([steady(figures[variant], "step_s") for figures in repeats]) for variant in VARIANTS
    }
    summary: dict[str, Any] = {
        "step_s": step_seconds,
        "storage_over_device_bound": spread(ratios("storage_over_device_bound")),
        "host_over_pcie_bound": spread(ratios("host_over_pcie_bound")),
        "storage_over_torch": spread(ratios("storage_over_torch")),
        "host_over_torch": spread(ratios("host_over_torch")),
        "device_memory_over_bound": round(max(memory), 3),
        "targets": {name: f"<= {value}" for name, value in TARGETS.items()},
    }
    summary["met"] = (
        summary["storage_over_device_bound"]["median"] <= TARGETS["storage_over_device_bound"]
        and summary["host_over_pcie_bound"]["median"] <= TARGETS["host_over_pcie_bound"]
        and summary["device_memory_over_bound"] <= TARGETS["device_memory_over_bound"]
    )
    return {
        **metadata(
            directory,
            benchmark="optimizer_gpu",
            **cuda_run(),
            config={
                "state_bytes": model.state_bytes,
                "parameters": model.count * model.numel,
                "subgroup_numel": args.numel,
                "dram_budget_bytes": args.budget,
                "dram_budget_bytes_host_variant": whole,
                "gpu_budget_bytes": args.gpu_budget,
                "steps": args.steps,
                "repeats": args.repeats,
            },
            elapsed_s=round(time.perf_counter() - started, 1),
        ),
        "summary": summary,
        "repeats": repeats,
    }
