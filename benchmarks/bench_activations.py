"""Activation spill: keep-in-memory, full recompute, and tierstore's ``all`` and ``lifetime`` plans.

``--device cuda`` runs the GPU benchmark instead (:mod:`activations_gpu`: a Hugging Face Llama on a
GPU against keeping everything, recomputation and ``save_on_cpu``); what follows is the CPU one.

Every variant trains the same GPT-style model (``tierstore.app.demo``) on the same batches, in
a fresh process of its own, and the variants alternate within each repeat. Figures are medians
over the steady steps (after the lifetime plan's profile and build steps) of every repeat.

Memory is the process's own: its peak RSS (VmHWM) above its *baseline*, the RSS once the model,
the data and the store exist and before the first step. Each variant runs under two allocator
settings: glibc's defaults (``default``: large blocks move from maps of their own into the heap
after the first is freed, and a fragmented heap keeps memory freed long ago resident) and glibc
with a fixed map threshold (``mmap-1MiB``: ``MALLOC_MMAP_THRESHOLD_=1048576``, every block of
1 MiB or more a map of its own, given back when freed), so the figures show both what a default
process holds and what its tensors need. Resident saved-activation bytes are also reported:
tensors of at least ``--min-bytes`` autograd holds for backward, measured by a counting hook for
the baselines and by the offloader for tierstore.

    python -m benchmarks.bench_activations --output benchmarks/results/activations.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from tierstore.activations import ActivationOffload
from tierstore.backends import open_backend

from tierstore import Tier, TierStore
from tierstore.app.demo import GPT, batch_of, byte_corpus

from . import activations_gpu
from .common import (
    ROOT,
    log,
    metadata,
    model_shape,
    module_command,
    parse_size,
    positive_int,
    run_variant_or_benchmark,
)

VARIANTS = ("keep", "recompute", "tierstore-all", "tierstore-lifetime")
ALLOCATORS: dict[str, dict[str, str]] = {"default": {}, "mmap-1MiB": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}
WARMUP = 2


class SavedBytesMeter:
    """Saved-tensor hooks that only count: the live bytes of unique saved storages (>= min_bytes,
    parameters excluded), and their peak."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.live = self.peak = 0
        self._holders: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held[0])

    def _pack(self, tensor: torch.Tensor) -> list[Any]:
        held: list[Any] = [tensor]
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, torch.nn.Parameter) or tensor.layout != torch.strided:
            return held
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes:
            return held
        with self._lock:
            holders = self._holders.setdefault(storage._cdata, [])
            if not holders:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            holders.append(weakref.ref(held_token := _Token()))
        held.append(held_token)
        weakref.finalize(held_token, self._release, storage._cdata, nbytes)
        return held

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            holders = [ref for ref in self._holders.get(key, []) if ref() is not None]
            if holders:
                self._holders[key] = holders
            else:
                self._holders.pop(key, None)
                self.live -= nbytes


class _Token:
    """Dies with autograd's saved-tensor handle."""


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant's run (in its own process)."""
    torch.manual_seed(0)
    checkpointed = frozenset(range(args.layers)) if args.variant == "recompute" else frozenset()
    model = GPT(256, args.width, args.layers, args.width // 64, args.length, 0.1, checkpointed=checkpointed)
    corpus = byte_corpus()
    meter = SavedBytesMeter(args.min_bytes)
    tier = Tier("disk", open_backend(f"nvme://{args.dir}"))
    rows: list[dict[str, Any]] = []
    with TierStore([tier], cache_budget=0, verify=args.verify) as store:
        offload = None
        if args.variant.startswith("tierstore-"):
            plan = args.variant.removeprefix("tierstore-")
            offload = ActivationOffload(store, budget=args.budget, min_bytes=args.min_bytes, plan=plan)
        baseline = _status_bytes("VmRSS")
        for step in range(args.steps):
            tokens, targets = batch_of(corpus, step, args.batch, args.length)
            model.zero_grad(set_to_none=True)
            before = offload.stats() if offload else {}
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            with offload if offload is not None else meter.hooks():
                loss = model(tokens, targets)
            forward = time.perf_counter()
            loss.backward()
            finished = time.perf_counter()
            row: dict[str, Any] = {
                "step": step + 1,
                "loss": round(loss.item(), 4),
                "forward_s": round(forward - started, 3),
                "backward_s": round(finished - forward, 3),
                "step_s": round(finished - started, 3),
            }
            row["peak_rss_bytes"] = _status_bytes("VmHWM")
            row["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if offload is not None:
                after = offload.stats()
                for name in (
                    "read_stall_s",
                    "write_stall_s",
                    "spilled_bytes",
                    "read_bytes",
                    "forwarded_bytes",
                    "overflow_bytes",
                ):
                    row[name] = round(after[name] - before[name], 3)
                row["predicted_step_s"] = after.get("predicted_step_s")
            rows.append(row)
            log(f"  {args.variant} step {step + 1}: {row}")
        stats = offload.stats() if offload is not None else {}
        if offload is not None:
            offload.close()
        explanation = offload.plan_explain() if offload is not None else None
    return {
        "variant": args.variant,
        "rows": rows,
        "peak_resident_saved_bytes": stats["peak_resident_bytes"] if offload else meter.peak,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "offload_stats": stats,
        "plan": explanation,
    }


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory figure (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def run_variant(
    variant: str, allocator: str, args: argparse.Namespace, directory: Path, repeat: int
) -> dict[str, Any]:
    name = f"{variant}-{allocator}-{repeat}"
    output = directory / f"{name}.json"
    command = [*module_command("bench_activations"), "--child", variant, "--dir", str(directory / name)]
    command += ["--json", str(output)]
    for option in ("layers", "width", "length", "batch", "steps", "verify"):
        command += [f"--{option}", str(getattr(args, option))]
    command += ["--budget", str(args.budget), "--min-bytes", str(args.min_bytes)]
    environment = {**os.environ, **ALLOCATORS[allocator]}
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False, env=environment, cwd=ROOT)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(output.read_text())
    result["allocator"] = allocator
    return result


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        allocator: {variant: [] for variant in VARIANTS} for allocator in args.allocators
    }
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        for variant in order:
            for allocator in args.allocators:
                log(f"{variant} ({allocator} allocator), repeat {repeat + 1}/{args.repeats} ...")
                runs[allocator][variant].append(run_variant(variant, allocator, args, directory, repeat))
    summary = {allocator: _summary(by_variant) for allocator, by_variant in runs.items()}
    return {
        "benchmark": "activation_spill",
        "metadata": {
            **metadata(
                directory,
                **model_shape(args),
                budget_bytes=args.budget,
                min_bytes=args.min_bytes,
                verify=args.verify,
                steps=args.steps,
                steady_steps_from=WARMUP + 1,
                repeats=args.repeats,
                allocators=ALLOCATORS,
            ),
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "runs": runs,
        "summary": summary,
        "ratios": {allocator: _ratios(figures) for allocator, figures in summary.items()},
        "targets": {
            "rss_above_baseline_vs_keep": "<= 0.5",
            "step_vs_keep": "<= 1.15",
            "step_vs_recompute": "< 1",
            "predicted_vs_measured": "within 15%",
        },
    }


def _summary(by_variant: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each variant's medians over its steady steps, and its memory peaks over its repeats."""
    summary: dict[str, dict[str, Any]] = {}
    for variant, results in by_variant.items():
        steady = [row for result in results for row in result["rows"][WARMUP:]]
        figures: dict[str, Any] = {
            "step_s": round(statistics.median(row["step_s"] for row in steady), 3),
            "step_s_range": [min(row["step_s"] for row in steady), max(row["step_s"] for row in steady)],
            "peak_resident_saved_bytes": max(r["peak_resident_saved_bytes"] for r in results),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
            "rss_above_baseline_bytes": statistics.median(
                r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in results
            ),
        }
        if variant.startswith("tierstore-"):
            for name in ("spilled_bytes", "read_stall_s", "write_stall_s", "overflow_bytes"):
                figures[name] = statistics.median(row[name] for row in steady)
            predicted = [row["predicted_step_s"] for row in steady if row["predicted_step_s"]]
            if predicted:
                figures["predicted_step_s"] = round(statistics.median(predicted), 3)
        summary[variant] = figures
    return summary


def _ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each variant against keep-in-memory (and tierstore's against full recompute)."""
    keep = summary["keep"]
    ratios: dict[str, dict[str, float]] = {}
    for variant in VARIANTS[1:]:
        figures = summary[variant]
        ratios[variant] = {
            "step_vs_keep": round(figures["step_s"] / keep["step_s"], 3),
            "rss_above_baseline_vs_keep": round(
                figures["rss_above_baseline_bytes"] / keep["rss_above_baseline_bytes"], 3
            ),
            "resident_saved_vs_keep": round(
                figures["peak_resident_saved_bytes"] / keep["peak_resident_saved_bytes"], 3
            ),
        }
        if variant.startswith("tierstore-"):
            ratios[variant]["step_vs_recompute"] = round(
                figures["step_s"] / summary["recompute"]["step_s"], 3
            )
            if "predicted_step_s" in figures:
                ratios[variant]["predicted_vs_measured"] = round(
                    figures["predicted_step_s"] / figures["step_s"], 3
                )
    return ratios


DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"layers": 6, "width": 512, "steps": 6, "repeats": 2, "budget": "128MiB"},
    "cuda": {
        "layers": 4,
        "width": 1024,
        "intermediate": 2816,
        "heads": 16,
        "steps": 5,
        "repeats": 2,
        "budget": "4GiB",
    },
}
"""Each device's defaults of the options they share (sized for the GPU check's two minutes on an
H100 on ``cuda``)."""
ISSUE_SIZE = {"layers": 8, "width": 2048, "intermediate": 5632, "heads": 16, "budget": "24GiB"}
"""``--device cuda --issue-size``: the Llama of the issue (542M parameters), with a host budget that
holds a long sequence's captures."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model trains")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--layers", type=positive_int, default=None, help="transformer blocks")
    parser.add_argument(
        "--width", type=positive_int, default=None, help="model width (cpu: heads = width / 64)"
    )
    parser.add_argument("--length", type=positive_int, default=256, help="cpu: tokens per sequence")
    parser.add_argument("--batch", type=positive_int, default=16, help="cpu: sequences per step")
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="steps per run (the first 2 warm up)"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=None, help="runs of each variant, alternating"
    )
    parser.add_argument("--budget", type=parse_size, default=None, help="offload budget (host memory)")
    parser.add_argument(
        "--storage-budget",
        type=parse_size,
        default=parse_size("1GiB"),
        help="cuda: host budget of the storage tier",
    )
    parser.add_argument(
        "--device-budget", type=parse_size, default=parse_size("256MiB"), help="cuda: device budget"
    )
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("1MiB"), help="spill threshold")
    activations_gpu.add_arguments(parser)
    parser.add_argument(
        "--verify", choices=("always", "sampled", "off"), default="always", help="the store's checksums"
    )
    parser.add_argument(
        "--allocators",
        type=lambda text: [a for a in text.split(",") if a],
        default=list(ALLOCATORS),
        help=f"comma-separated allocator settings to run each variant under ({', '.join(ALLOCATORS)})",
    )
    parser.add_argument(
        "--child", choices=(*VARIANTS, *activations_gpu.VARIANTS), default=None, help=argparse.SUPPRESS
    )
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    defaults = {**DEFAULTS[args.device], **(ISSUE_SIZE if args.device == "cuda" and args.issue_size else {})}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, parse_size(value) if name == "budget" else value)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "bench_activations --device cuda needs a CUDA device (torch.cuda.is_available() is False)"
            )
        return run_variant_or_benchmark(
            activations_gpu.child, activations_gpu.run, args, "activations-gpu-", needs_fio=False
        )
    return run_variant_or_benchmark(child, run, args, "activations-", needs_fio=False)


if __name__ == "__main__":
    sys.exit(main())
