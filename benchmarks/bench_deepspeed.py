"""Full DeepSpeed ZeRO-3 training iterations: DeepSpeed's own NVMe offload against tierstore's.

Both sides train the integration's example GPT (``tierstore.integrations.deepspeed.example``) in
their own process, with the same model, batch and DRAM budget (DeepSpeed's ``buffer_count`` x
sub-group bytes; tierstore's ``dram_budget`` set to the same number), their optimizer state on the
same disk directory. DeepSpeed uses its pipelined swapper (the faster of its two). The sides
alternate (A B, B A, ...), ``--repeats`` times each; each repeat gives the median of its
steady-state steps (every step after the first), and each figure is the median over repeats with
their min and max. The linear layers multiply in fp32 by default (``--matmul-dtype``): on a
CPU without native bf16 the bf16 backward alone takes ~35 s a step here, which no storage layer
changes; weights and gradients stay bf16, so both sides move the same bytes as in bf16 training.

    python -m benchmarks.bench_deepspeed --output benchmarks/results/deepspeed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import log, metadata, model_shape, positive_int, run_benchmark, spread

PHASES = ("forward_s", "backward_s", "step_s", "iteration_s")

EXAMPLE_DEFAULTS = {
    "layers": 8,
    "width": 1024,
    "length": 32,
    "batch": 2,
    "sub_group_size": 8_000_000,
    "buffer_count": 12,  # DeepSpeed's minimum with Adam
    "steps": 6,
}
"""The example's options that this benchmark takes and passes on, by the keyword each is (the option
``--sub-group-size`` for ``sub_group_size``, here and in the example), with the benchmark's default."""


def option(name: str) -> str:
    """The command-line option of the keyword ``name``: ``--sub-group-size`` for ``sub_group_size``."""
    return f"--{name.replace('_', '-')}"


def train(side: str, args: argparse.Namespace, directory: Path, repeat: int) -> list[dict[str, Any]]:
    output = directory / f"{side}-{repeat}.json"
    command = [
        sys.executable,
        "-m",
        "tierstore.integrations.deepspeed.example",
        "--offload",
        side,
        "--nvme",
        str(directory / f"{side}-{repeat}"),
        *(word for name in EXAMPLE_DEFAULTS for word in (option(name), str(getattr(args, name)))),
        "--heads",
        str(args.width // 64),
        "--pipeline",
        "--matmul-dtype",
        args.matmul_dtype,
        "--json",
        str(output),
    ]
    child = subprocess.run(command, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"{side} run failed:\n{child.stdout[-3000:]}")
    document = json.loads(output.read_text())
    rows: list[dict[str, Any]] = document["rows"]
    for row in rows:
        log(f"  {side} step {row['step']}: " + ", ".join(f"{p} {row[p]:.2f}" for p in PHASES))
    args.parameters = document["parameters"]
    return rows


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    runs: dict[str, list[list[dict[str, Any]]]] = {"deepspeed": [], "tierstore": []}
    for repeat in range(args.repeats):
        sides = ["deepspeed", "tierstore"] if repeat % 2 == 0 else ["tierstore", "deepspeed"]
        for side in sides:
            log(f"{side}, repeat {repeat + 1}/{args.repeats} ...")
            runs[side].append(train(side, args, directory, repeat))
    per_repeat = {  # each repeat's median over its steady-state steps (every step after the first)
        side: {
            phase: [statistics.median(row[phase] for row in rows[1:]) for rows in repeats] for phase in PHASES
        }
        for side, repeats in runs.items()
    }
    speedups = {
        phase: round(
            statistics.median(per_repeat["deepspeed"][phase])
            / statistics.median(per_repeat["tierstore"][phase]),
            3,
        )
        for phase in PHASES
    }
    return {
        "benchmark": "deepspeed_training_iteration",
        "metadata": {
            **metadata(
                directory,
                parameters=args.parameters,
                fp32_state_bytes=12 * args.parameters,
                dram_budget_bytes=args.buffer_count * 4 * args.sub_group_size,
                **model_shape(args),
                sub_group_size=args.sub_group_size,
                steps=args.steps,
                repeats=args.repeats,
                matmul_dtype=args.matmul_dtype,
            ),
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "runs": runs,
        "summary": {
            "seconds": {
                side: {p: spread(v) for p, v in phases.items()} for side, phases in per_repeat.items()
            },
            "speedup_vs_deepspeed": speedups,
            "targets": {"step_s": ">= 1.0", "iteration_s": ">= 1.5"},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None)
    for name, default in EXAMPLE_DEFAULTS.items():
        parser.add_argument(
            option(name), type=positive_int, default=default, help=f"passed on to the example ({default})"
        )
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument(
        "--matmul-dtype",
        choices=["bfloat16", "float32"],
        default="float32",
        help="the linear layers' matmul dtype (weights, gradients and optimizer traffic stay bf16/fp32 "
        "as in bf16 training): float32 because a CPU without native bf16 takes up to 270x longer "
        "for backward's bf16 GEMMs, which would bury the storage in compute",
    )
    args = parser.parse_args()
    return run_benchmark(run, args, prefix="deepspeed-", needs_fio=False)


if __name__ == "__main__":
    sys.exit(main())
