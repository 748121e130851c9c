"""Benchmark every tierstore backend (dram, nvme, zarr, adios2) beside fio on one directory.

Each backend is opened with ``open_backend`` with its default options, the disk ones on their
own subdirectory of the data directory (fio uses a subdirectory too). For each size, every
repeat runs each tool once, in an order rotated by one tool per repeat. A backend is measured as:

* ``write``: ``backend.write(...).result()`` of one aligned buffer (zarr and adios2 return once
  the data is in the page cache; nvme writes with O_DIRECT);
* ``write_durable``: the same plus the ``os.sync()`` that follows it, i.e. until the data is on
  disk (null for dram, which is not persistent);
* ``read``: ``backend.read_into(...).result()`` into a second buffer, cold: the page cache is
  dropped before every read (root only; ``caches_dropped`` in the JSON says whether it was), so
  zarr and adios2 read from the disk. The data read is compared with the data written.

fio runs ``--direct=1 --ioengine=libaio --bs=4M --iodepth=16``: a write job, then a read job of
the file it wrote. ``os.sync()`` runs before every measurement; GB/s means 1e9 bytes/s. The result
reports medians over repeats, each disk backend's ratios to fio (write/fio write, write_durable/fio
write, read/fio read) and the targets: zarr >= 0.7x fio on read and write, adios2 >= 0.7x fio on
write, each write target judged twice, on ``write`` and on ``write_durable``, for every size.
The table goes to stderr, the JSON to stdout (and to ``--output``).

Run from the repository root as root (the data goes to a fresh directory under ``./bench-data``,
which is removed at the end; pass ``--dir`` to use another directory on the disk under test)::

    .venv/bin/python -m benchmarks.bench_backends --output benchmarks/results/backends.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tierstore.backends import Backend, open_backend

from tierstore.buffers import AlignedBuffer

from .common import (
    argument_parser,
    check_same,
    drop_caches,
    fill_random,
    format_size,
    log,
    measure_fio,
    metadata,
    run_benchmark,
    timed,
)

BACKENDS = ("dram", "nvme", "zarr", "adios2")
TARGET_RATIO = 0.7
TARGETS = (("zarr", "read"), ("zarr", "write"), ("adios2", "write"))
"""(backend, side) that must reach TARGET_RATIO x fio; a write target is judged on both
``write`` and ``write_durable``."""
FIGURES = ("write", "write_durable", "read")
WARMUP_BYTES = 16 << 20


def backend_spec(name: str, directory: Path) -> str | dict[str, str]:
    path = str(directory / name)
    specs: dict[str, str | dict[str, str]] = {
        "dram": "dram://",
        "nvme": {"type": "nvme", "path": path},
        "zarr": {"type": "zarr", "url": path},
        "adios2": {"type": "adios2", "path": path},
    }
    return specs[name]


def parse_backends(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose among {', '.join(BACKENDS)}; got {text!r}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser(__doc__, sizes="256MiB,1GiB", repeats=3)
    parser.add_argument("--backends", type=parse_backends, default=list(BACKENDS))
    return parser.parse_args(argv)


# -- measurements ----------------------------------------------------------------------------------
def measure_backend(
    backend: Backend, data: AlignedBuffer, readback: AlignedBuffer, nbytes: int
) -> tuple[dict[str, float | None], bool]:
    """GB/s of write, write_durable and cold read, and whether the cache was dropped before the
    read; the read is checked against ``data``."""
    name = f"bench-{nbytes}"
    readback.view(nbytes).zero_()  # not timed; the comparison below must not see stale data
    try:
        os.sync()
        start = time.perf_counter()
        backend.write(name, 0, data.memoryview(nbytes)).result()
        write_s = time.perf_counter() - start
        durable_s = None
        if backend.capabilities.persistent:
            os.sync()
            durable_s = time.perf_counter() - start
        dropped = drop_caches()
        read_s = timed(lambda: backend.read_into(name, 0, readback.memoryview(nbytes)).result())
    finally:
        if backend.exists(name):
            backend.delete(name)
    check_same(readback, data, nbytes, backend.scheme)
    gbps = {
        "write": nbytes / write_s / 1e9,
        "write_durable": None if durable_s is None else nbytes / durable_s / 1e9,
        "read": nbytes / read_s / 1e9,
    }
    return gbps, dropped


def warm_up(backend: Backend) -> None:
    """Write, read and delete one small object (starts adios2's worker, loads zarr's codecs)."""
    data, readback = AlignedBuffer(WARMUP_BYTES), AlignedBuffer(WARMUP_BYTES)
    fill_random(data, WARMUP_BYTES, seed=0)
    backend.write("warmup", 0, data.memoryview(WARMUP_BYTES)).result()
    backend.read_into("warmup", 0, readback.memoryview(WARMUP_BYTES)).result()
    backend.delete("warmup")
    check_same(readback, data, WARMUP_BYTES, f"{backend.scheme} (warm-up)")


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return None if len(known) < len(values) else rounded(statistics.median(known))


def fio_ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, both medians every run has (fio's, and a disk backend's)."""
    assert value is not None and reference is not None, "a disk backend or fio lacks a figure"
    return rounded(value / reference)


def bench_size(backends: dict[str, Backend], directory: Path, nbytes: int, repeats: int) -> dict[str, Any]:
    """All repeats of one size: GB/s per repeat and tool, medians and ratios to fio."""
    data, readback = AlignedBuffer(nbytes), AlignedBuffer(nbytes)
    fill_random(data, nbytes, seed=nbytes)
    tools = ["fio", *backends]
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        order = tools[repeat % len(tools) :] + tools[: repeat % len(tools)]
        gbps: dict[str, dict[str, float | None]] = {}
        dropped = True
        for tool in order:
            if tool == "fio":
                fio = measure_fio(directory / "fio", nbytes)
                gbps[tool] = {"write": fio["fio_write"] / 1e9, "read": fio["fio_read"] / 1e9}
            else:
                gbps[tool], tool_dropped = measure_backend(backends[tool], data, readback, nbytes)
                dropped = dropped and tool_dropped
        gbps = {tool: {key: rounded(value) for key, value in gbps[tool].items()} for tool in order}
        runs.append({"repeat": repeat, "order": order, "caches_dropped": dropped, "gbps": gbps})
        log(
            f"  {format_size(nbytes):>7} #{repeat}: "
            + "  ".join(
                f"{tool} " + "/".join("-" if v is None else f"{v:.2f}" for v in figures.values())
                for tool, figures in gbps.items()
            )
        )
    medians = {
        tool: {key: median([run["gbps"][tool][key] for run in runs]) for key in figures}
        for tool, figures in runs[0]["gbps"].items()
    }
    versus = {
        "write": medians["fio"]["write"],
        "write_durable": medians["fio"]["write"],
        "read": medians["fio"]["read"],
    }  # what each figure of a disk backend is compared with
    ratios = {
        tool: {key: fio_ratio(medians[tool][key], versus[key]) for key in FIGURES}
        for tool in backends
        if backends[tool].capabilities.persistent
    }
    data.free()
    readback.free()
    return {
        "size": format_size(nbytes),
        "bytes": nbytes,
        "median_gbps": medians,
        "ratio_vs_fio": ratios,
        "verified": True,
        "caches_dropped": all(run["caches_dropped"] for run in runs),
        "runs": runs,
    }


def evaluate_targets(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (backend, figure) target: its ratio per size, and whether every size passes."""
    targets = []
    for backend, side in TARGETS:
        if backend not in results[0]["ratio_vs_fio"]:
            continue
        for figure in ("read",) if side == "read" else ("write", "write_durable"):
            by_size = {r["size"]: r["ratio_vs_fio"][backend][figure] for r in results}
            targets.append(
                {
                    "backend": backend,
                    "figure": figure,
                    "versus": f"fio {side}",
                    "min_ratio": TARGET_RATIO,
                    "ratio_by_size": by_size,
                    "passes": all(ratio >= TARGET_RATIO for ratio in by_size.values()),
                }
            )
    return targets


# -- report ----------------------------------------------------------------------------------------
def table(results: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    """The medians, ratios and targets as aligned text."""

    def cells(values: list[Any]) -> str:
        return "".join(f"{'-' if v is None else f'{v:.3f}':>12}" for v in values)

    head = ["write", "durable", "read"]
    lines = [
        f"{'GB/s, median':<16}{''.join(f'{h:>12}' for h in head)}  | "
        + "".join(f"{h + '/fio':>12}" for h in head)
    ]
    for result in results:
        for tool, figures in result["median_gbps"].items():
            ratio = result["ratio_vs_fio"].get(tool, {})
            lines.append(
                f"{result['size']:>7} {tool:<8}"
                + cells([figures.get(key) for key in FIGURES])
                + "  | "
                + cells([ratio.get(key) for key in FIGURES])
            )
    sizes = [result["size"] for result in results]
    lines.append(f"targets: ratio >= {TARGET_RATIO} x fio at every size")
    for target in targets:
        label = f"{target['backend']} {target['figure']} / {target['versus']}"
        ratios = "  ".join(f"{size} {target['ratio_by_size'][size]:.3f}" for size in sizes)
        lines.append(f"  {label:<32} {ratios}  {'PASS' if target['passes'] else 'FAIL'}")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Benchmark every backend and size in ``directory`` and build the result document."""
    started = time.perf_counter()
    specs = {name: backend_spec(name, directory) for name in args.backends}
    meta = metadata(
        directory,
        sizes=[format_size(size) for size in args.sizes],
        sizes_bytes=args.sizes,
        repeats=args.repeats,
        backends=specs,
        order="tools rotated by one per repeat, starting from fio, " + ", ".join(args.backends),
        read="cold: os.sync() and drop_caches before every backend read",
        warmup=f"each backend writes, reads, deletes a {format_size(WARMUP_BYTES)} object first",
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    )
    log(f"backends benchmark in {directory} ({meta['filesystem']}, {meta['mount']})")
    if not drop_caches():
        log("WARNING: cannot drop the page cache (not root?): reads of zarr/adios2 may be warm")
    backends: dict[str, Backend] = {}
    try:
        for name, spec in specs.items():
            backends[name] = open_backend(spec)
            warm_up(backends[name])
        results = [bench_size(backends, directory, size, args.repeats) for size in args.sizes]
    finally:
        for backend in backends.values():
            backend.close()
    targets = evaluate_targets(results)
    meta["caches_dropped"] = all(result["caches_dropped"] for result in results)
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    log(table(results, targets))
    return {
        "benchmark": "backends",
        "metadata": meta,
        "results": results,
        "targets": targets,
        "summary": {f"{target['backend']} {target['figure']}": target["passes"] for target in targets},
    }


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(run, parse_args(argv), prefix="backends-")


if __name__ == "__main__":
    sys.exit(main())
