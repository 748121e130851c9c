"""Benchmark the tierstore NVMe backend against fio on the same directory.

For each size, every repeat measures four figures on the same directory, with the tool order
alternating between repeats (tierstore first on even repeats, fio first on odd ones):

* tierstore write: ``backend.write(...).result()`` of one aligned buffer (O_DIRECT);
* tierstore read: ``backend.read_into(...).result()`` of that object back (O_DIRECT, so cold),
  into a second buffer that is then compared with the original data;
* fio write / read: ``--direct=1 --ioengine=libaio --bs=4M --iodepth=16`` on a file of the same
  size; the timed write job also lays the file out for the read job.

Each tool writes, reads, then deletes its own file, so the other tool always starts on a
directory without it; ``os.sync()`` runs before every measurement. GB/s means 1e9 bytes/s. The
result reports medians over repeats, the tierstore/fio ratios per size, their median over sizes
and the target (ratio >= 0.9).

Run from the repository root (the data goes to a fresh directory under ``./bench-data``, which is
removed at the end; pass ``--dir`` to use another directory on the disk under test)::

    .venv/bin/python benchmarks/bench_nvme.py --output benchmarks/results/nvme.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierstore.backends import Backend, open_backend
from tierstore.buffers import AlignedBuffer
from tierstore.config import parse_byte_size
from tierstore.errors import ConfigError

TARGET_RATIO = 0.9
"""tierstore should reach at least this fraction of fio's bandwidth on every figure."""

FIO_BLOCK = 4 << 20
"""fio's --bs (fio reads "4M" as 4 MiB)."""

FIO_ARGS = [
    "--direct=1",
    "--ioengine=libaio",
    "--bs=4M",
    "--iodepth=16",
    "--numjobs=1",
    "--output-format=json",
]
"""fio options shared by the write and read jobs (plus --name, --filename, --rw, --size)."""

FIGURES = ("tierstore_write", "tierstore_read", "fio_write", "fio_read")

# -- argument parsing ------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Parse ``"64MiB"``, ``"1GiB"``, ``"4096"`` into a positive byte count (argparse type)."""
    try:
        nbytes = parse_byte_size(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    """Parse a comma-separated list of sizes."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(nbytes: int) -> str:
    """``67108864`` -> ``"64MiB"`` (binary units when exact, else bytes)."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory on the disk under test (default: a fresh directory under ./bench-data)",
    )
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64MiB,256MiB,1GiB"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--queue-depth", type=int, default=16, help="tierstore queue_depth")
    parser.add_argument("--chunk", type=parse_size, default=4 << 20, help="tierstore chunk_bytes")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if not args.sizes:
        parser.error("--sizes is empty")
    odd = [format_size(size) for size in args.sizes if size % FIO_BLOCK]
    if odd:  # fio moves whole --bs blocks only, so other sizes would compare different amounts
        parser.error(f"sizes must be multiples of fio's block size (4MiB): {', '.join(odd)}")
    return args


# -- environment -----------------------------------------------------------------------------------
def run_text(command: list[str]) -> str | None:
    """stdout of ``command`` stripped, or None if it cannot run or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return " ".join(done.stdout.split())


@contextmanager
def data_directory(requested: Path | None) -> Iterator[Path]:
    """Yield an empty-or-existing directory for the data and remove what was created in it."""
    if requested is None:
        parent = Path("bench-data").absolute()
        made_parent = not parent.exists()
        parent.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix="nvme-", dir=parent))
        try:
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)
            if made_parent:
                try:
                    parent.rmdir()
                except OSError:  # someone else put something there meanwhile
                    pass
        return
    directory = requested.expanduser().absolute()
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir(directory))
    try:
        yield directory
    finally:  # a user-given directory: remove only what this run created
        if made:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            for name in set(os.listdir(directory)) - before:
                path = directory / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)


# -- measurements ----------------------------------------------------------------------------------
def timed(action: Callable[[], None]) -> float:
    """Seconds taken by ``action`` after an ``os.sync()``."""
    os.sync()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def run_fio(path: Path, rw: str, nbytes: int) -> float:
    """Run one fio job and return its bandwidth in bytes/s (``bw_bytes`` of the job)."""
    command = [
        "fio",
        "--name=bench",
        f"--filename={path}",
        f"--rw={rw}",
        f"--size={nbytes}",
        *FIO_ARGS,
    ]
    os.sync()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {' '.join(command)}\n{done.stderr}")
    report = json.loads(done.stdout[done.stdout.index("{") :])  # fio may print notes first
    job = report["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}: {' '.join(command)}")
    side = "write" if rw == "write" else "read"
    if job[side]["io_bytes"] != nbytes:
        raise RuntimeError(f"fio {rw} moved {job[side]['io_bytes']} bytes, expected {nbytes}")
    return float(job[side]["bw_bytes"])


def measure_fio(directory: Path, nbytes: int) -> dict[str, float]:
    """fio write then read bandwidth (bytes/s) of one file of ``nbytes``; the file is removed."""
    path = directory / f"fio-{nbytes}.dat"
    remove(path)
    try:
        write = run_fio(path, "write", nbytes)  # also lays the file out for the read job
        read = run_fio(path, "read", nbytes)
    finally:
        remove(path)
    return {"fio_write": write, "fio_read": read}


def measure_tierstore(
    backend: Backend, data: AlignedBuffer, readback: AlignedBuffer, nbytes: int
) -> dict[str, float]:
    """tierstore write then read bandwidth (bytes/s); the read is checked against ``data``."""
    name = f"tierstore-{nbytes}"
    readback.view(nbytes).zero_()  # not timed; the comparison below must not see stale data
    try:
        write_s = timed(lambda: backend.write(name, 0, data.memoryview(nbytes)).result())
        read_s = timed(lambda: backend.read_into(name, 0, readback.memoryview(nbytes)).result())
    finally:
        if backend.exists(name):
            backend.delete(name)
    if not torch.equal(readback.view(nbytes), data.view(nbytes)):
        mismatch = int((readback.view(nbytes) != data.view(nbytes)).sum())
        raise AssertionError(
            f"tierstore read back different data: {mismatch} of {nbytes} bytes differ"
        )
    return {"tierstore_write": nbytes / write_s, "tierstore_read": nbytes / read_s}


def fill_random(buffer: AlignedBuffer, nbytes: int, seed: int) -> None:
    """Fill the first ``nbytes`` with pseudo-random bytes in 1..255 (never zero).

    One 16 MiB random block is drawn and copied with a different rotation into each 16 MiB of the
    buffer: incompressible, no two blocks alike, and ~5x faster than drawing every byte.
    """
    block = 16 << 20
    pattern = np.random.default_rng(seed).integers(1, 256, size=block, dtype=np.uint8)
    array = buffer.tensor.numpy()[:nbytes]
    for index, start in enumerate(range(0, nbytes, block)):
        target = array[start : start + block]
        shift = (index * 4099) % block  # 4099 is prime: rotations are never page-aligned
        head = pattern[shift : shift + target.size]
        target[: head.size] = head
        target[head.size :] = pattern[: target.size - head.size]


def bench_size(
    backend: Backend, directory: Path, nbytes: int, repeats: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """All repeats of one size: raw GB/s per repeat, medians and tierstore/fio ratios."""
    data, readback = AlignedBuffer(nbytes), AlignedBuffer(nbytes)
    fill_random(data, nbytes, seed=nbytes)
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        tierstore_first = repeat % 2 == 0
        order = ("tierstore", "fio") if tierstore_first else ("fio", "tierstore")
        figures: dict[str, float] = {}
        for tool in order:
            if tool == "tierstore":
                figures |= measure_tierstore(backend, data, readback, nbytes)
            else:
                figures |= measure_fio(directory, nbytes)
        gbps = {key: figures[key] / 1e9 for key in FIGURES}
        rounded = {key: round(value, 4) for key, value in gbps.items()}
        runs.append({"repeat": repeat, "order": list(order), **rounded})
        log(
            f"  {format_size(nbytes):>7} #{repeat} ({order[0]} first): "
            + "  ".join(f"{key} {gbps[key]:.3f}" for key in FIGURES)
        )
    medians = {key: statistics.median(run[key] for run in runs) for key in FIGURES}
    ratios = {
        "write": medians["tierstore_write"] / medians["fio_write"],
        "read": medians["tierstore_read"] / medians["fio_read"],
    }
    data.free()
    readback.free()
    return {
        "size": format_size(nbytes),
        "bytes": nbytes,
        "median_gbps": {key: round(value, 4) for key, value in medians.items()},
        "ratio": {key: round(value, 4) for key, value in ratios.items()},
        "meets_target": {key: value >= TARGET_RATIO for key, value in ratios.items()},
        "verified": True,
        "runs": runs,
    }


# -- main ------------------------------------------------------------------------------------------
def metadata(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """What was measured, where and with what."""
    mount = run_text(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", str(directory)])
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sizes": [format_size(size) for size in args.sizes],
        "sizes_bytes": args.sizes,
        "repeats": args.repeats,
        "queue_depth": args.queue_depth,
        "chunk": format_size(args.chunk),
        "chunk_bytes": args.chunk,
        "directory": str(directory),
        "filesystem": run_text(["stat", "-f", "-c", "%T", str(directory)]),
        "mount": mount,
        "fio_version": run_text(["fio", "--version"]),
        "fio_args": FIO_ARGS,
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "units": "GB/s = 1e9 bytes/s",
        "order": "tierstore first on even repeats, fio first on odd repeats",
    }


def run(args: argparse.Namespace, directory: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Benchmark every size in ``directory`` and build the result document."""
    if shutil.which("fio") is None:
        raise RuntimeError("fio is not installed (or not on PATH)")
    started = time.perf_counter()
    meta = metadata(args, directory)
    log(f"nvme benchmark in {directory} ({meta['filesystem']}, {meta['mount']})")
    backend = open_backend(
        {
            "type": "nvme",
            "path": str(directory),
            "queue_depth": args.queue_depth,
            "chunk_bytes": args.chunk,
        }
    )
    try:
        if not backend.capabilities.direct_io:
            raise RuntimeError(f"{directory} refuses O_DIRECT; the comparison with fio is void")
        results = [bench_size(backend, directory, size, args.repeats, log) for size in args.sizes]
    finally:
        backend.close()
    summary_ratio = {
        side: round(statistics.median(result["ratio"][side] for result in results), 4)
        for side in ("write", "read")
    }
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    return {
        "benchmark": "nvme",
        "metadata": meta,
        "target": {"ratio": TARGET_RATIO, "meaning": "tierstore/fio >= ratio, read and write"},
        "results": results,
        "summary": {
            "median_ratio": summary_ratio,
            "meets_target": {side: value >= TARGET_RATIO for side, value in summary_ratio.items()},
            "all_sizes_meet_target": all(all(r["meets_target"].values()) for r in results),
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM -> SystemExit, so the data directory is removed as on Ctrl-C or an error.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    with data_directory(args.dir) as directory:
        document = run(args, directory, log)
    text = json.dumps(document, indent=2)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
