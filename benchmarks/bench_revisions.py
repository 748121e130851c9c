"""The working tree against an earlier revision, on the hot paths: a change's "no slower" check.

Two workloads, each run by the benchmark of the revision under test, in a fresh process per run,
alternating between the revisions (A B, B A, ...) so that the disk's drift between runs falls on
both alike:

* **update**: the offloaded optimizer's update phase (``bench_optimizer --side tierstore``):
  ``--state`` bytes of fp32 AdamW state in sub-groups through an NVMe (O_DIRECT) tier under
  ``--budget`` of DRAM. Figure: seconds per step, median of the steps after the first.
* **activations**: activation offload of a small GPT (``bench_activations --child
  tierstore-lifetime``). Figure: seconds per training step, median of the steps after warm-up.

The earlier revision is checked out in a temporary git worktree and imported from a tree of links
laid out as the installed package (its folders map to ``tierstore.*`` as the package's do), with
the same interpreter and libraries. Each revision runs its benchmarks as modules of its
``benchmarks`` package, or, in a revision from before that package, as the scripts
``benchmarks/<name>.py``. Reported per workload: each revision's median, min and max
over repeats, the bytes each run moved, and the working tree's median over the base's (below 1: faster).

    .venv/bin/python -m benchmarks.bench_revisions --base HEAD --output benchmarks/results/revisions.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .common import (
    ROOT,
    format_size,
    log,
    metadata,
    parse_size,
    positive_int,
    run_benchmark,
    run_captured,
    spread,
)

PACKAGE_FOLDERS = ("backends", "optimizer", "activations", "checkpoint", "integrations")
"""Top-level folders installed as ``tierstore.<name>`` (pyproject's package-dir)."""
ACTIVATION_WARMUP = 2


@contextmanager
def revision_tree(revision: str) -> Iterator[tuple[Path, Path]]:
    """Check ``revision`` out in a temporary worktree; yield (its root, its import tree: its package
    laid out as installed, and its ``benchmarks``)."""
    with tempfile.TemporaryDirectory(prefix="tierstore-revision-") as scratch:
        root, imports = Path(scratch) / "tree", Path(scratch) / "imports"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(root), revision],
            check=True,
        )
        try:
            package = imports / "tierstore"
            package.mkdir(parents=True)
            for entry in (root / "tierstore").iterdir():
                (package / entry.name).symlink_to(entry)
            for folder in PACKAGE_FOLDERS:
                if (root / folder).is_dir():
                    (package / folder).symlink_to(root / folder)
            (imports / "benchmarks").symlink_to(root / "benchmarks")
            yield root, imports
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(root)], check=True)


def update_arguments(args: argparse.Namespace, directory: Path) -> list[str]:
    """``bench_optimizer``'s arguments for one run of tierstore's update phase in ``directory``."""
    sizes = {"state": args.state, "budget": args.budget, "numel": args.numel, "steps": args.steps}
    return ["--side=tierstore", f"--dir={directory}", *(f"--{name}={value}" for name, value in sizes.items())]


def activations_arguments(args: argparse.Namespace, directory: Path) -> list[str]:
    """``bench_activations``' arguments for one child run of tierstore's lifetime plan in ``directory``."""
    files = [f"--json={directory / 'result.json'}", f"--dir={directory / 'tier'}"]
    return ["--child=tierstore-lifetime", *files, f"--steps={args.steps + ACTIVATION_WARMUP}"]


def update_figures(stdout: str, directory: Path) -> tuple[float, int]:
    steps = json.loads(stdout.strip().splitlines()[-1])["steps"][1:]
    moved = sum(step["bytes_read"] + step["bytes_written"] for step in steps)
    return statistics.median(step["update_s"] for step in steps), moved


def activation_figures(stdout: str, directory: Path) -> tuple[float, int]:
    rows = json.loads((directory / "result.json").read_text())["rows"][ACTIVATION_WARMUP:]
    moved = sum(int(row["spilled_bytes"] + row["read_bytes"]) for row in rows)
    return statistics.median(row["step_s"] for row in rows), moved


Figures = Callable[[str, Path], tuple[float, int]]
"""A run's figures from its standard output and its directory: seconds per step, and the bytes its
measured steps moved (the same on both revisions, or they did not do the same work)."""
WORKLOADS: dict[str, tuple[str, Callable[[argparse.Namespace, Path], list[str]], Figures]] = {
    "update": ("bench_optimizer", update_arguments, update_figures),
    "activations": ("bench_activations", activations_arguments, activation_figures),
}
"""Each workload: the benchmark that runs it, its arguments for a run in a folder, its figures."""


def benchmark_command(module: str, root: Path, imports: Path | None) -> tuple[list[str], Path]:
    """How the revision at ``root`` runs its benchmark ``module``, and the folder to run it in.

    A module of its ``benchmarks`` package, run from the folder that leads to the revision's package:
    its import tree (``imports``, which holds its ``benchmarks`` too) or, for the working tree, its
    root. (From a worktree's root, its bare ``tierstore/`` folder would be imported instead of the
    import tree, and its subpackages found in the working tree's installed package.) In a revision
    from before the package, the script ``benchmarks/<module>.py``, from ``root``.
    """
    if not (root / "benchmarks" / "__init__.py").is_file():
        return [sys.executable, f"benchmarks/{module}.py"], root
    return [sys.executable, "-m", f"benchmarks.{module}"], imports or root


def run_once(
    workload: str, args: argparse.Namespace, root: Path, imports: Path | None, scratch: Path
) -> tuple[float, int]:
    """One run of ``workload`` with the benchmark and the package of ``root``."""
    module, arguments, figure = WORKLOADS[workload]
    command, folder = benchmark_command(module, root, imports)
    environment = dict(os.environ)
    if imports is not None:  # ahead of the installed (editable) package of the working tree
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(imports), os.environ.get("PYTHONPATH")])
        )
    with tempfile.TemporaryDirectory(prefix=f"{workload}-", dir=scratch) as directory:
        done = run_captured(
            [*command, *arguments(args, Path(directory))],
            f"{workload} at {root}",
            cwd=folder,
            env=environment,
        )
        return figure(done.stdout, Path(directory))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the earlier revision (default: HEAD)")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each revision, alternating")
    parser.add_argument(
        "--workloads", default="update,activations", help="comma-separated: update,activations"
    )
    parser.add_argument(
        "--state", type=parse_size, default=parse_size("4GiB"), help="update: fp32 state bytes"
    )
    parser.add_argument("--budget", type=parse_size, default=parse_size("1GiB"), help="update: DRAM budget")
    parser.add_argument("--numel", type=positive_int, default=32 << 20, help="update: elements per sub-group")
    parser.add_argument("--steps", type=positive_int, default=3, help="measured steps per run")
    args = parser.parse_args()
    workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads: {', '.join(unknown)} (choose from {', '.join(WORKLOADS)})")
    args.workloads = workloads
    return run_benchmark(compare, args, prefix="revisions-", needs_fio=False)


def compare(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Each workload on both revisions, alternating; the document :func:`main` prints."""
    base = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.base],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    results: dict[str, Any] = {}
    with revision_tree(args.base) as (base_root, base_imports):
        sides = {"base": (base_root, base_imports), "working": (ROOT, None)}
        for workload in args.workloads:
            seconds: dict[str, list[float]] = {"base": [], "working": []}
            moved: dict[str, list[int]] = {"base": [], "working": []}
            for repeat in range(args.repeats):
                order = ["base", "working"] if repeat % 2 == 0 else ["working", "base"]
                for side in order:
                    root, imports = sides[side]
                    step_seconds, step_bytes = run_once(workload, args, root, imports, scratch)
                    seconds[side].append(step_seconds)
                    moved[side].append(step_bytes)
                    log(f"{workload} {side} run {repeat + 1}: {step_seconds:.3f} s, {step_bytes} bytes")
            results[workload] = {
                "base_s": spread(seconds["base"]),
                "working_s": spread(seconds["working"]),
                "base_bytes_moved": moved["base"],
                "working_bytes_moved": moved["working"],
                "working_over_base": round(
                    statistics.median(seconds["working"]) / statistics.median(seconds["base"]), 3
                ),
            }
    return {
        **metadata(scratch, base=base, repeats=args.repeats),
        "update": {"state": format_size(args.state), "budget": format_size(args.budget), "numel": args.numel},
        "results": results,
    }


if __name__ == "__main__":
    sys.exit(main())
