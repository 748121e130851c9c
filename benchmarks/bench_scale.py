"""Many small objects: put, flush, reopen, get and delete at 10k to 1M objects (issue 11).

Each case (object size x count) runs in a child process of its own, so its peak RSS is its own:
a persistent store (manifest) over one ``nvme`` tier in ``--dir`` with a 1 GiB cache, then

* ``put``: every object (futures issued in batches, all awaited);
* ``flush``: every dirty object written back to the tier and journaled;
* ``close``: the persistent close (nothing dirty left; the manifest is compacted);
* ``reopen``: opening the store again from its manifest (garbage scan included);
* ``get``: every object read back from the tier (cache misses) and checked;
* ``delete``: every object deleted.

Reported per operation: objects/s and microseconds per object, and for each count the ratio of its
per-object cost to the smallest count's of the same size (flat = about 1). The machine is shared
and small, so figures move by tens of percent between runs; ratios within one run are the point.
Never part of the test suite. Run from the repository root::

    .venv/bin/python -m benchmarks.bench_scale --dir /dev/shm/bench-scale \\
        --output benchmarks/results/scale.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierstore import TierStore

from .common import ROOT, format_size, log, metadata, module_command, parse_size, run_benchmark

OPERATIONS = ("put", "flush", "close", "reopen", "get", "delete")
BATCH = 10_000
"""Futures in flight at once while putting and getting (bounds the caller's own memory)."""


def parse_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive counts, got {text!r}")
    return sorted(counts)


def config(directory: Path, cache_budget: int) -> dict[str, Any]:
    return {
        "cache": {"budget": cache_budget},
        "manifest": str(directory / "manifest"),
        "tiers": [{"name": "nvme", "backend": f"nvme://{directory / 'nvme'}"}],
    }


def run_case(directory: Path, nbytes: int, count: int, cache_budget: int) -> dict[str, Any]:
    """One size and count, in this process: seconds per operation and peak RSS."""
    settings = config(directory, cache_budget)
    source = torch.arange(nbytes, dtype=torch.uint8)
    keys = [f"layer{index % 97}/object{index}" for index in range(count)]
    seconds: dict[str, float] = {}

    def timed(operation: str, action: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = action()
        seconds[operation] = time.perf_counter() - start
        log(f"  {format_size(nbytes)} x {count}: {operation} {seconds[operation]:.2f} s")
        return result

    def put_all(store: TierStore) -> None:
        for first in range(0, count, BATCH):
            for future in [store.put(key, source) for key in keys[first : first + BATCH]]:
                future.result()

    def get_all(store: TierStore) -> None:
        for first in range(0, count, BATCH):
            for future in [store.get(key, cache=False) for key in keys[first : first + BATCH]]:
                if not torch.equal(future.result(), source):
                    raise AssertionError("an object read back differs from what was put")

    store = TierStore.from_config(settings)
    timed("put", lambda: put_all(store))
    timed("flush", store.flush)
    timed("close", store.close)
    store = timed("reopen", lambda: TierStore.from_config(settings))
    if len(store) != count:
        raise AssertionError(f"reopened with {len(store)} objects, expected {count}")
    timed("get", lambda: get_all(store))
    timed("delete", lambda: [store.delete(key) for key in keys])
    store.close()
    files = sum(1 for path in (directory / "nvme").iterdir() if not path.name.startswith("."))
    return {
        "object_bytes": nbytes,
        "objects": count,
        "seconds": {operation: round(seconds[operation], 4) for operation in OPERATIONS},
        "objects_per_s": {operation: round(count / seconds[operation]) for operation in OPERATIONS},
        "us_per_object": {operation: round(1e6 * seconds[operation] / count, 2) for operation in OPERATIONS},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "files_left": files,
    }


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    for nbytes, counts in ((4096, args.counts_4k), (64, args.counts_64)):
        for count in counts:
            case_dir = directory / f"{nbytes}x{count}"
            log(f"case {format_size(nbytes)} x {count} in {case_dir}")
            child = subprocess.run(
                [
                    *module_command("bench_scale"),
                    "--case",
                    str(nbytes),
                    str(count),
                    str(case_dir),
                    str(args.cache_budget),
                ],
                capture_output=True,
                text=True,
                check=False,
                cwd=ROOT,
            )
            sys.stderr.write(child.stderr)
            if child.returncode != 0:
                raise RuntimeError(f"case {nbytes} x {count} failed (exit {child.returncode})")
            cases.append(json.loads(child.stdout))
    for case in cases:
        smallest = min(
            (c for c in cases if c["object_bytes"] == case["object_bytes"]), key=lambda c: c["objects"]
        )
        case["per_object_cost_vs_smallest_count"] = {
            operation: round(case["us_per_object"][operation] / smallest["us_per_object"][operation], 2)
            for operation in OPERATIONS
        }
    return {
        **metadata(directory, benchmark="scale", cache_budget=args.cache_budget),
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--case"]:  # a child: one case, JSON on stdout
        nbytes, count, case_dir, budget = argv[1:5]
        print(json.dumps(run_case(Path(case_dir), int(nbytes), int(count), int(budget))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="data directory (default ./bench-data)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--counts-4k", type=parse_counts, default=parse_counts("10000,100000"))
    parser.add_argument("--counts-64", type=parse_counts, default=parse_counts("10000,100000,1000000"))
    parser.add_argument("--cache-budget", type=parse_size, default=parse_size("1GiB"))
    return run_benchmark(run, parser.parse_args(argv), prefix="scale-", needs_fio=False)


if __name__ == "__main__":
    sys.exit(main())
