"""Activation offload on a GPU (``bench_activations.py --device cuda``): tierstore against keeping
everything, recomputation and PyTorch's ``save_on_cpu``, side by side in one run.

A Hugging Face ``LlamaForCausalLM`` built from a config (random weights, nothing downloaded; bf16,
``sdpa`` attention) takes ``--steps`` training steps (forward and backward, gradients set to None
before each; no optimizer) on random tokens, per batch shape (``--shapes``: ``4x1024``, and
``1x16384`` with ``--long``). Each variant runs in a fresh process of its own, and the variants
alternate within each repeat (their order rotates from repeat to repeat):

* ``keep``: autograd keeps every saved tensor on the GPU;
* ``recompute``: Hugging Face gradient checkpointing of every decoder layer (non-reentrant);
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around forward;
* ``tierstore-host``: :class:`~tierstore.activations.ActivationOffload`, plan ``all``, a host budget
  (``--budget``) that holds every capture: the GPU, pinned host memory, back;
* ``tierstore-storage``: the same with a host budget of ``--storage-budget``: the oldest captures go
  on to the store's NVMe tier under ``--dir``;
* ``tierstore-checkpoint``: recomputation as ``recompute``, and only the decoder layers' inputs
  offloaded (``scope="checkpoint-inputs"``, host budget ``--budget``);
* ``torchtune``: torchtune's ``OffloadActivations`` (streams on), where torchtune is installed.

Reported per variant and shape (medians over the steps after ``WARMUP`` of every repeat): step
seconds (the GPU synchronized at each step's end), ``torch.cuda.max_memory_allocated`` above the
model's parameters (gradients included), the process's peak RSS (VmHWM), whether the last step's
gradients are bit-identical to ``keep``'s (cuBLAS made deterministic), and for tierstore the
offloader's figures and its step report. The storage variant's *disk bound* is the bytes its steady
step wrote and read over the disk's write and read bandwidth (``tierstore.bandwidth.probe`` on the
same directory; one disk: the times add). The ratios are the issue's targets: host tier <= 0.5x
``save_on_cpu``'s step and (at the long shape) <= 1.10x keep's, GPU memory <= ``save_on_cpu``'s,
storage tier <= 1.10x its disk bound, checkpoint-input mode at recomputation's GPU memory or less
for <= 1.05x its step.

    python -m benchmarks.bench_activations --device cuda --long \
        --output benchmarks/results/gpu/activations.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import xxhash
from tierstore.activations import ActivationOffload
from tierstore.backends import open_backend

from tierstore import Tier, TierStore
from tierstore.bandwidth import probe

from .common import ROOT, log, metadata, module_command, spread

VARIANTS = (
    "keep",
    "recompute",
    "save_on_cpu",
    "tierstore-host",
    "tierstore-storage",
    "tierstore-checkpoint",
    "torchtune",
)
WARMUP = 2
"""Steps that warm allocators, kernels and the offloader's pools up before the measured ones."""
PROBE_BYTES = 512 << 20
PER_STEP_STATS = (
    "host_bytes",
    "spilled_bytes",
    "read_bytes",
    "restored_bytes",
    "device_kept_bytes",
    "snapshot_bytes",
    "read_stall_s",
    "write_stall_s",
)
"""The offloader's counters that each tierstore run reports per measured step."""
TARGETS = {
    "host_step_vs_save_on_cpu": "<= 0.5",
    "host_step_vs_keep_long": "<= 1.10",
    "host_memory_vs_save_on_cpu": "<= 1.0",
    "storage_step_vs_disk_bound": "<= 1.10",
    "checkpoint_memory_vs_recompute": "<= 1.0",
    "checkpoint_step_vs_recompute": "<= 1.05",
}


def shape_of(text: str) -> tuple[int, int]:
    """``"4x1024"`` -> (4, 1024): sequences per step and tokens per sequence."""
    batch, length = text.lower().split("x")
    return int(batch), int(length)


def variants() -> list[str]:
    """The variants this node can run (torchtune's only where it is installed)."""
    return [v for v in VARIANTS if v != "torchtune" or importlib.util.find_spec("torchtune") is not None]


# -- one variant, in its own process ----------------------------------------------------------------------
def child(args: argparse.Namespace) -> dict[str, Any]:
    """Run one variant on one shape; its figures."""
    import transformers

    batch, length = shape_of(args.shape)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(length, 2048),
        attn_implementation="sdpa",  # type: ignore[call-arg]  # a keyword of PretrainedConfig's
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.train()
    if args.variant in ("recompute", "tierstore-checkpoint"):
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.cuda.synchronize()
    model_bytes = torch.cuda.memory_allocated()
    baseline_rss = _status_bytes("VmRSS")
    store = TierStore([Tier("nvme", open_backend(f"nvme://{args.dir}"))], cache_budget=0)
    offload = _offload(args, store)
    attachment = offload.attach(model) if offload is not None else None
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    before: dict[str, Any] = {}
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (batch, length), device="cuda", generator=generator)
        if step == WARMUP:
            torch.cuda.reset_peak_memory_stats()
            before = offload.stats() if offload is not None else {}
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with _around_forward(args.variant):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.cuda.synchronize()
        rows.append({"step": step + 1, "step_s": round(time.perf_counter() - started, 4)})
        log(f"  {args.variant} {args.shape} step {step + 1}: {rows[-1]}")
    result: dict[str, Any] = {
        "variant": args.variant,
        "shape": args.shape,
        "rows": rows,
        "step_s": statistics.median(row["step_s"] for row in rows[WARMUP:]),
        "peak_gpu_above_model_bytes": torch.cuda.max_memory_allocated() - model_bytes,
        "model_bytes": model_bytes,
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "baseline_rss_bytes": baseline_rss,
        "gradients_xxh64": _digest(model),
    }
    if offload is not None and attachment is not None:
        attachment.remove()
        offload.synchronize()
        after = offload.stats()
        measured = args.steps - WARMUP
        for name in PER_STEP_STATS:
            result[f"{name}_per_step"] = (after[name] - before.get(name, 0)) / measured
        result["peak_device_bytes"] = after["peak_device_bytes"]
        result["report"] = offload.report()
        offload.close()
    store.close()
    return result


def _offload(args: argparse.Namespace, store: TierStore) -> ActivationOffload | None:
    if not args.variant.startswith("tierstore-"):
        return None
    budget = args.storage_budget if args.variant == "tierstore-storage" else args.budget
    scope = "checkpoint-inputs" if args.variant == "tierstore-checkpoint" else "saved"
    return ActivationOffload(
        store,
        budget=budget,
        min_bytes=args.min_bytes,
        plan="all",
        device_budget=args.device_budget,
        scope=scope,  # type: ignore[arg-type]
    )


def _around_forward(variant: str) -> AbstractContextManager[Any]:
    """What wraps forward for the peers that need no offloader of ours (tierstore's is attached)."""
    if variant == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if variant == "torchtune":
        from torchtune.training import OffloadActivations

        return OffloadActivations(use_streams=True)
    return nullcontext()


def _digest(model: torch.nn.Module) -> str:
    """The last step's gradients, bit for bit, as one hash."""
    digest = xxhash.xxh64()
    for parameter in model.parameters():
        if parameter.grad is not None:
            digest.update(parameter.grad.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


# -- the run ----------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    disk = probe(open_backend(f"nvme://{directory / 'probe'}"), PROBE_BYTES).bandwidth
    names = variants()
    shapes = [*args.shapes, *(["1x16384"] if args.long else [])]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {shape: {v: [] for v in names} for shape in shapes}
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for shape in shapes:
            for variant in order:
                log(f"{variant} {shape}, repeat {repeat + 1}/{args.repeats} ...")
                runs[shape][variant].append(_run_child(args, directory, variant, shape, repeat))
    summary = {shape: _summary(by_variant, disk.write, disk.read) for shape, by_variant in runs.items()}
    properties = torch.cuda.get_device_properties(0)
    return {
        "benchmark": "activation_offload_gpu",
        "metadata": {
            **metadata(
                directory,
                model={
                    "layers": args.layers,
                    "hidden": args.width,
                    "intermediate": args.intermediate,
                    "heads": args.heads,
                    "vocab": args.vocab,
                    "dtype": "bfloat16",
                    "attention": "sdpa",
                },
                shapes=shapes,
                steps=args.steps,
                steady_steps_from=WARMUP + 1,
                repeats=args.repeats,
                budget_bytes=args.budget,
                storage_budget_bytes=args.storage_budget,
                device_budget_bytes=args.device_budget,
                min_bytes=args.min_bytes,
                variants=names,
                skipped={"torchtune": "not installed"} if "torchtune" not in names else {},
                disk_probe_gb_s={"write": round(disk.write / 1e9, 3), "read": round(disk.read / 1e9, 3)},
            ),
            "device": properties.name,
            "cuda": torch.version.cuda,
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "runs": runs,
        "summary": summary,
        "ratios": {shape: _ratios(figures, long=shape == "1x16384") for shape, figures in summary.items()},
        "targets": TARGETS,
    }


def _run_child(
    args: argparse.Namespace, directory: Path, variant: str, shape: str, repeat: int
) -> dict[str, Any]:
    name = f"{variant}-{shape}-{repeat}"
    output = directory / f"{name}.json"
    command = [*module_command("bench_activations"), "--device", "cuda"]
    command += ["--child", variant, "--shape", shape, "--dir", str(directory / name), "--json", str(output)]
    for option in ("layers", "width", "intermediate", "heads", "vocab", "steps"):
        command += [f"--{option}", str(getattr(args, option))]
    for option in ("budget", "storage_budget", "device_budget", "min_bytes"):
        command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    environment = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False, env=environment, cwd=ROOT)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        return {"variant": variant, "shape": shape, "failed": done.stderr[-3000:]}
    result: dict[str, Any] = json.loads(output.read_text())
    return result


def _summary(by_variant: dict[str, list[dict[str, Any]]], write: float, read: float) -> dict[str, Any]:
    """Each variant's medians over its repeats, and whether its gradients are keep's."""
    keep = [r["gradients_xxh64"] for r in by_variant.get("keep", []) if "failed" not in r]
    summary: dict[str, Any] = {}
    for variant, results in by_variant.items():
        done = [r for r in results if "failed" not in r]
        if not done:
            summary[variant] = {"failed": results[0]["failed"] if results else "not run"}
            continue
        figures: dict[str, Any] = {
            "step_s": spread([r["step_s"] for r in done]),
            "peak_gpu_above_model_bytes": max(r["peak_gpu_above_model_bytes"] for r in done),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in done),
            "bit_identical_to_keep": bool(keep) and all(r["gradients_xxh64"] == keep[0] for r in done),
        }
        if variant.startswith("tierstore-"):
            for name in PER_STEP_STATS:
                figures[f"{name}_per_step"] = statistics.median(r[f"{name}_per_step"] for r in done)
            figures["peak_device_bytes"] = max(r["peak_device_bytes"] for r in done)
            figures["report"] = done[-1]["report"]["line"] if done[-1].get("report") else None
        if variant == "tierstore-storage" and write > 0 and read > 0:
            figures["disk_bound_s"] = round(
                figures["spilled_bytes_per_step"] / write + figures["read_bytes_per_step"] / read, 4
            )
        summary[variant] = figures
    return summary


def _ratios(summary: dict[str, Any], *, long: bool) -> dict[str, float | None]:
    """The targets' ratios, where both sides ran."""

    def step(variant: str) -> float | None:
        figures = summary.get(variant, {})
        return figures["step_s"]["median"] if "step_s" in figures else None

    def memory(variant: str) -> float | None:
        return summary.get(variant, {}).get("peak_gpu_above_model_bytes")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    storage = summary.get("tierstore-storage", {})
    ratios = {
        "host_step_vs_save_on_cpu": ratio(step("tierstore-host"), step("save_on_cpu")),
        "host_step_vs_keep": ratio(step("tierstore-host"), step("keep")),
        "host_memory_vs_save_on_cpu": ratio(memory("tierstore-host"), memory("save_on_cpu")),
        "storage_step_vs_disk_bound": ratio(step("tierstore-storage"), storage.get("disk_bound_s")),
        "checkpoint_memory_vs_recompute": ratio(memory("tierstore-checkpoint"), memory("recompute")),
        "checkpoint_step_vs_recompute": ratio(step("tierstore-checkpoint"), step("recompute")),
    }
    if long:
        ratios["host_step_vs_keep_long"] = ratios["host_step_vs_keep"]
    return ratios


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--device cuda`` beside bench_activations.py's own."""
    parser.add_argument("--intermediate", type=int, default=None, help="cuda: the MLP's width")
    parser.add_argument("--vocab", type=int, default=32000, help="cuda: vocabulary size")
    parser.add_argument("--heads", type=int, default=None, help="cuda: attention heads")
    parser.add_argument(
        "--shapes",
        type=lambda text: [s for s in text.split(",") if s],
        default=["4x1024"],
        help="cuda: batch shapes, sequences x tokens, comma-separated",
    )
    parser.add_argument("--long", action="store_true", help="cuda: also the long sequence 1x16384")
    parser.add_argument(
        "--issue-size",
        action="store_true",
        help="cuda: the issue's Llama (8 layers, hidden 2048, MLP 5632, 16 heads: 542M parameters)",
    )
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
