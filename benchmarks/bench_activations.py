"""Activation spill: keep-in-memory, full recompute, and tierstore's ``all`` and ``lifetime`` plans.

Every variant trains the same GPT-style model (``tierstore.testing.gpt``) on the same batches, in
a fresh process of its own (so peak RSS is its own), and the variants alternate within each repeat.
Figures are medians over the steady steps (after the lifetime plan's profile and build steps) of
every repeat. Resident saved-activation bytes count tensors of at least ``--min-bytes`` that
autograd holds for backward (unique storages, parameters excluded): measured by a counting hook for
the baselines and by the offloader itself for tierstore.

    python benchmarks/bench_activations.py --output benchmarks/results/activations.json
"""

from __future__ import annotations

import argparse
import json
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
from common import log, metadata, parse_size, positive_int, run_benchmark
from tierstore.activations import ActivationOffload
from tierstore.backends import open_backend

from tierstore import Tier, TierStore
from tierstore.testing.gpt import GPT, batch_of, byte_corpus

VARIANTS = ("keep", "recompute", "tierstore-all", "tierstore-lifetime")
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
    with TierStore([tier], cache_budget=0) as store:
        offload = None
        if args.variant.startswith("tierstore-"):
            plan = args.variant.removeprefix("tierstore-")
            offload = ActivationOffload(store, budget=args.budget, min_bytes=args.min_bytes, plan=plan)
        for step in range(args.steps):
            tokens, targets = batch_of(corpus, step, args.batch, args.length)
            model.zero_grad(set_to_none=True)
            before = offload.stats() if offload else {}
            started = time.perf_counter()
            with offload if offload is not None else meter.hooks():
                loss = model(tokens, targets)
            forward = time.perf_counter()
            loss.backward()
            finished = time.perf_counter()
            row: dict[str, Any] = {
                "step": step + 1,
                "loss": round(float(loss), 4),
                "forward_s": round(forward - started, 3),
                "backward_s": round(finished - forward, 3),
                "step_s": round(finished - started, 3),
            }
            if offload is not None:
                after = offload.stats()
                for name in (
                    "read_stall_s",
                    "write_stall_s",
                    "spilled_bytes",
                    "read_bytes",
                    "forwarded_bytes",
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
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "offload_stats": stats,
        "plan": explanation,
    }


def run_variant(variant: str, args: argparse.Namespace, directory: Path, repeat: int) -> dict[str, Any]:
    output = directory / f"{variant}-{repeat}.json"
    tier = directory / f"{variant}-{repeat}"
    command = [sys.executable, __file__, "--child", variant, "--dir", str(tier), "--json", str(output)]
    for option in ("layers", "width", "length", "batch", "steps"):
        command += [f"--{option}", str(getattr(args, option))]
    command += ["--budget", str(args.budget), "--min-bytes", str(args.min_bytes)]
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(output.read_text())
    return result


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        for variant in order:
            log(f"{variant}, repeat {repeat + 1}/{args.repeats} ...")
            runs[variant].append(run_variant(variant, args, directory, repeat))
    summary: dict[str, Any] = {}
    for variant, results in runs.items():
        steady = [row for result in results for row in result["rows"][WARMUP:]]
        summary[variant] = {
            "step_s": round(statistics.median(row["step_s"] for row in steady), 3),
            "step_s_range": [min(row["step_s"] for row in steady), max(row["step_s"] for row in steady)],
            "peak_resident_saved_bytes": max(r["peak_resident_saved_bytes"] for r in results),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in results),
        }
        if variant.startswith("tierstore-"):
            summary[variant]["spilled_bytes_per_step"] = statistics.median(
                row["spilled_bytes"] for row in steady
            )
            summary[variant]["read_stall_s"] = statistics.median(row["read_stall_s"] for row in steady)
            summary[variant]["write_stall_s"] = statistics.median(row["write_stall_s"] for row in steady)
            predicted = [row["predicted_step_s"] for row in steady if row["predicted_step_s"]]
            if predicted:
                summary[variant]["predicted_step_s"] = round(statistics.median(predicted), 3)
    keep = summary["keep"]
    ratios: dict[str, Any] = {}
    for variant in VARIANTS[1:]:
        ratios[variant] = {
            "step_vs_keep": round(summary[variant]["step_s"] / keep["step_s"], 3),
            "resident_vs_keep": round(
                summary[variant]["peak_resident_saved_bytes"] / keep["peak_resident_saved_bytes"], 3
            ),
            "rss_vs_keep": round(summary[variant]["peak_rss_bytes"] / keep["peak_rss_bytes"], 3),
        }
        if variant.startswith("tierstore-"):
            ratios[variant]["step_vs_recompute"] = round(
                summary[variant]["step_s"] / summary["recompute"]["step_s"], 3
            )
    lifetime = summary["tierstore-lifetime"]
    if "predicted_step_s" in lifetime:
        ratios["tierstore-lifetime"]["predicted_vs_measured"] = round(
            lifetime["predicted_step_s"] / lifetime["step_s"], 3
        )
    return {
        "benchmark": "activation_spill",
        "metadata": {
            **metadata(
                directory,
                layers=args.layers,
                width=args.width,
                tokens_per_step=args.batch * args.length,
                budget_bytes=args.budget,
                min_bytes=args.min_bytes,
                steps=args.steps,
                steady_steps_from=WARMUP + 1,
                repeats=args.repeats,
            ),
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "targets": {
            "resident_vs_keep": "<= 0.5 and within the budget",
            "step_vs_keep": "<= 1.15",
            "step_vs_recompute": "< 1",
            "predicted_vs_measured": "within 15%",
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--layers", type=positive_int, default=6, help="transformer blocks")
    parser.add_argument("--width", type=positive_int, default=512, help="model width (heads = width / 64)")
    parser.add_argument("--length", type=positive_int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    parser.add_argument("--steps", type=positive_int, default=6, help="steps per run (the first 2 warm up)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs of each variant, alternating")
    parser.add_argument("--budget", type=parse_size, default=parse_size("320MiB"), help="offload budget")
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("1MiB"), help="spill threshold")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.variant = args.child
        args.json.write_text(json.dumps(child(args)))
        return 0
    return run_benchmark(run, args, prefix="activations-", needs_fio=False)


if __name__ == "__main__":
    sys.exit(main())
