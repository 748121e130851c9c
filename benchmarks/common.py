"""Pieces shared by the benchmarks: arguments, data directory, child processes, fio, buffers,
metadata.

The benchmarks are modules of the ``benchmarks`` package, run from the folder that holds it (the
repository's root) as ``python -m benchmarks.<name>``; they import this as ``from .common import ...``.
"""

from __future__ import annotations

import argparse
import contextlib
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

from tierstore.app.arguments import positive_byte_size
from tierstore.app.arguments import positive_int as positive_int  # the scripts take it from here
from tierstore.buffers import AlignedBuffer

ROOT = Path(__file__).resolve().parents[1]
"""The folder that holds the ``benchmarks`` package: the repository's root, or the GPU check's copy."""

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


# -- arguments -------------------------------------------------------------------------------------
parse_size = positive_byte_size
"""``"64MiB"``, ``"1GiB"``, ``"4096"`` as a byte count of at least 1 (argparse type)."""


def parse_fio_sizes(text: str) -> list[int]:
    """Parse a comma-separated, non-empty list of sizes that are whole fio blocks (4 MiB)."""
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("the list of sizes is empty")
    odd = [format_size(size) for size in sizes if size % FIO_BLOCK]
    if odd:  # fio moves whole --bs blocks only, so other sizes would compare different amounts
        raise argparse.ArgumentTypeError(
            f"sizes must be multiples of fio's block size (4MiB): {', '.join(odd)}"
        )
    return sizes


def format_size(nbytes: int) -> str:
    """``67108864`` -> ``"64MiB"`` (binary units when exact, else bytes)."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def argument_parser(doc: str, sizes: str, repeats: int) -> argparse.ArgumentParser:
    """A parser with the options every benchmark has: --dir, --sizes, --repeats, --output."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory on the disk under test (default: a fresh directory under ./bench-data)",
    )
    parser.add_argument("--sizes", type=parse_fio_sizes, default=parse_fio_sizes(sizes))
    parser.add_argument("--repeats", type=positive_int, default=repeats)
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    return parser


# -- running ---------------------------------------------------------------------------------------
def module_command(module: str) -> list[str]:
    """The command that runs the benchmark ``module`` (``"bench_optimizer"``) in a fresh process
    with this interpreter, arguments to follow; run it with ``cwd=ROOT``, where the package is found."""
    return [sys.executable, "-m", f"benchmarks.{module}"]


def run_captured(
    command: list[str], what: str, *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (in ``cwd``, with the environment ``env`` or this process's) to its end, its
    stdout and stderr captured as text; a non-zero exit raises ``RuntimeError`` saying that ``what``
    failed, with the end of its stderr."""
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=cwd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_benchmark(
    run: Callable[[argparse.Namespace, Path], dict[str, Any]],
    args: argparse.Namespace,
    prefix: str,
    *,
    needs_fio: bool = True,
) -> int:
    """Call ``run(args, directory)`` in a data directory, print its JSON and save it to --output."""
    if needs_fio and shutil.which("fio") is None:
        raise RuntimeError("fio is not installed (or not on PATH)")
    # SIGTERM -> SystemExit, so the data directory is removed as on Ctrl-C or an error.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with data_directory(args.dir, prefix) as directory:
        document = run(args, directory)
    text = json.dumps(document, indent=2)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    print(text)
    return 0


def run_variant_or_benchmark(
    child: Callable[[argparse.Namespace], dict[str, Any]],
    run: Callable[[argparse.Namespace, Path], dict[str, Any]],
    args: argparse.Namespace,
    prefix: str,
    *,
    needs_fio: bool,
) -> int:
    """Run one variant in a child process of the benchmark, or the benchmark itself.

    Args:
        child: runs the variant ``args.variant`` and returns its figures.
        run: the benchmark, as :func:`run_benchmark` calls it.
        args: the command line; in a child (``--child VARIANT``, as the benchmark starts one), the
            figures go to the file ``args.json``.
        prefix: the data directory's prefix (:func:`run_benchmark`).
        needs_fio: whether the benchmark needs fio (:func:`run_benchmark`).
    """
    if args.child is None:
        return run_benchmark(run, args, prefix, needs_fio=needs_fio)
    args.variant = args.child
    args.json.write_text(json.dumps(child(args)))
    return 0


@contextmanager
def data_directory(requested: Path | None, prefix: str = "bench-") -> Iterator[Path]:
    """Yield an empty-or-existing directory for the data and remove what was created in it."""
    if requested is None:
        parent = Path("bench-data").absolute()
        made_parent = not parent.exists()
        parent.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)
            if made_parent:
                with contextlib.suppress(OSError):  # someone else put something there meanwhile
                    parent.rmdir()
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


# -- measurements ----------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements (seconds or ratios), rounded for the JSON."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def timed(action: Callable[[], None]) -> float:
    """Seconds taken by ``action`` after an ``os.sync()``."""
    os.sync()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def drop_caches() -> bool:
    """``os.sync()``, then drop the page cache (root only); whether it could be dropped."""
    os.sync()
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
    except OSError:  # e.g. a read-only /proc/sys in a container
        return False
    return True


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
    job = _fio(command)["jobs"][0]
    side = "write" if rw == "write" else "read"
    if job[side]["io_bytes"] != nbytes:
        raise RuntimeError(f"fio {rw} moved {job[side]['io_bytes']} bytes, expected {nbytes}")
    return float(job[side]["bw_bytes"])


def measure_fio(directory: Path, nbytes: int) -> dict[str, float]:
    """fio write then read bandwidth (bytes/s) of one file of ``nbytes``; the file is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"fio-{nbytes}.dat"
    path.unlink(missing_ok=True)
    try:
        write = run_fio(path, "write", nbytes)  # also lays the file out for the read job
        read = run_fio(path, "read", nbytes)
    finally:
        path.unlink(missing_ok=True)
    return {"fio_write": write, "fio_read": read}


WRITE_LAG = 2
"""Files the update bound's write job runs behind its read job, over the same files: tierstore
writes each new version of a sub-group into the blocks of a version deleted moments before (the
nvme backend recycles deleted files), so its reads and writes share one set of files."""


def measure_update_bound(
    directory: Path,
    *,
    read_bytes: int,
    write_bytes: int,
    files: int,
    request_bytes: int,
    in_flight: int,
    beside: list[str] | None = None,
) -> dict[str, float]:
    """The device's limit for an update phase's I/O, replayed by fio: ``read_bytes`` read from
    ``files`` files while ``write_bytes`` are written, both at once, O_DIRECT, ``request_bytes``
    per request and ``in_flight`` requests in flight in all (half each way).

    The writes go to the same files as the reads, :data:`WRITE_LAG` files behind, so the replay
    touches as much of the disk as the update does (its files and their recycled versions): on this
    virtual disk a footprint twice as large is slower per byte once it outgrows the host's cache.
    The files are laid out first (not timed), so the writes overwrite written blocks as tierstore's
    do. The replay runs twice and the faster one is the bound: right after laying out tens of GB
    this virtual disk is slow for a while (its host writes them back), which is the layout's cost,
    not the device's limit. Returns the seconds until both jobs are done (the bound) and each
    direction's GB/s while they ran together.

    With ``beside``, one more replay runs with that command started beside it (see
    :func:`_replay_beside`: the update's own compute, say) and ``bound_with_compute_s`` is the longer
    of the two: on this VM the disk's I/O shares the cores and the memory bus with the update's
    kernels, so a step that must both move its bytes and compute can at best overlap them
    perfectly, which is what two independent processes do."""
    directory.mkdir(parents=True, exist_ok=True)
    depth = max(1, in_flight // 2)
    request_bytes = max(4096, request_bytes // 4096 * 4096)
    names = [f"update.{index}" for index in range(files)]
    lag = min(WRITE_LAG, files - 1)
    per_file = max(request_bytes, -(-max(read_bytes, write_bytes) // files) // request_bytes * request_bytes)

    def job(name: str, rw: str, order: list[str], total: int) -> list[str]:
        return [
            f"--name={name}",
            f"--rw={rw}",
            f"--directory={directory}",
            f"--filename={':'.join(order)}",
            f"--filesize={per_file}",
            f"--size={per_file * files}",
            f"--io_size={max(request_bytes, total // request_bytes * request_bytes)}",
            "--file_service_type=sequential",
            f"--iodepth={depth}",
        ]

    common = ["fio", "--direct=1", "--ioengine=libaio", f"--bs={request_bytes}", "--output-format=json"]
    replay = [
        *common,
        *job("update-read", "read", names, read_bytes),
        *job("update-write", "write", names[files - lag :] + names[: files - lag], write_bytes),
    ]
    try:
        _fio([*common, *job("layout", "write", names, per_file * files)])
        os.sync()
        idle = min((_replay_seconds(_fio(replay)) for _ in range(2)), key=lambda run: run["bound_s"])
        if beside is None:
            return idle
        shared, other = _replay_beside(replay, beside)
    finally:
        for path in directory.glob("update.*"):
            path.unlink(missing_ok=True)
    return {
        **idle,
        "replay_with_compute_s": shared["bound_s"],
        "compute_beside_s": other,
        "bound_with_compute_s": max(shared["bound_s"], other),
    }


def _replay_seconds(report: dict[str, Any]) -> dict[str, Any]:
    """The bound from an update replay's fio report: until both jobs are done."""
    jobs = {job["jobname"]: job for job in report["jobs"]}
    reading, writing = jobs["update-read"]["read"], jobs["update-write"]["write"]
    return {
        "bound_s": round(max(reading["runtime"], writing["runtime"]) / 1e3, 3),
        "read_gb_per_s": round(reading["bw_bytes"] / 1e9, 3),
        "write_gb_per_s": round(writing["bw_bytes"] / 1e9, 3),
        "bytes_read": reading["io_bytes"],
        "bytes_written": writing["io_bytes"],
    }


def _replay_beside(replay: list[str], command: list[str]) -> tuple[dict[str, Any], float]:
    """Run the fio ``replay`` with ``command`` beside it: the command prints ``ready`` once set up,
    starts its timed work on a line from its stdin (sent just before fio starts) and ends by
    printing its seconds. Returns the replay's figures and those seconds."""
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{' '.join(command)} did not get ready (exit status {child.wait()})")
        child.stdin.write("go\n")
        child.stdin.flush()
        shared = _replay_seconds(_fio(replay))
        output, _ = child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed (exit status {child.returncode})")
        return shared, float(output.split()[-1])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


FIO_HUGE_PAGES = 128
"""Huge pages reserved while fio runs, for its I/O buffers (256 MiB: iodepth x block size)."""


def _fio(command: list[str]) -> dict[str, Any]:
    """Run fio with its I/O buffers on huge pages, as tierstore's are (see ``tierstore.buffers``):
    on 4 KiB pages the block layer splits each 4 MiB request into ~512 KiB pieces, which on this
    machine's disk costs 3-4x in bandwidth and would make fio no baseline at all."""
    with _reserved_huge_pages(FIO_HUGE_PAGES) as reserved:
        if not reserved:
            log("warning: no huge pages for fio's buffers (needs root): its requests will be split")
        memory = ["--iomem=shmhuge"] if reserved else []  # global: before the first --name
        done = subprocess.run(
            [command[0], *memory, *command[1:]], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {' '.join(command)}\n{done.stderr}")
    report: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])  # fio may print notes first
    for job in report["jobs"]:
        if job.get("error"):
            raise RuntimeError(f"fio job {job['jobname']} error {job['error']}: {' '.join(command)}")
    return report


@contextmanager
def _reserved_huge_pages(count: int) -> Iterator[bool]:
    """Raise ``vm.nr_hugepages`` to ``count`` for the duration (root only), then restore it;
    yields whether that many are reserved."""
    control = Path("/proc/sys/vm/nr_hugepages")
    before = int(control.read_text())
    try:
        if before < count and os.geteuid() == 0:
            with contextlib.suppress(OSError):
                control.write_text(f"{count}\n")
        yield int(control.read_text()) >= count
    finally:
        if int(control.read_text()) != before:
            control.write_text(f"{before}\n")


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


def check_same(readback: AlignedBuffer, data: AlignedBuffer, nbytes: int, who: str) -> None:
    """Raise AssertionError unless the first ``nbytes`` of both buffers are equal."""
    if not torch.equal(readback.view(nbytes), data.view(nbytes)):
        mismatch = int((readback.view(nbytes) != data.view(nbytes)).sum())
        raise AssertionError(f"{who} read back different data: {mismatch} of {nbytes} bytes differ")


# -- metadata --------------------------------------------------------------------------------------
def run_text(command: list[str]) -> str | None:
    """stdout of ``command`` stripped, or None if it cannot run or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return " ".join(done.stdout.split())


def cuda_run() -> dict[str, Any]:
    """A GPU benchmark's own metadata: the command that ran it (``python -m benchmarks.<name> ...``)
    and the device and CUDA it ran on."""
    spec = sys.modules["__main__"].__spec__
    assert spec is not None, "a benchmark runs as a module: python -m benchmarks.<name>"
    return {
        "command": " ".join(["python", "-m", spec.name, *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
    }


def model_shape(args: argparse.Namespace) -> dict[str, int]:
    """A training benchmark's model in its metadata: ``--layers`` blocks of ``--width``, fed
    ``--batch`` sequences of ``--length`` tokens a step."""
    return {"layers": args.layers, "width": args.width, "tokens_per_step": args.batch * args.length}


def metadata(directory: Path, **fields: Any) -> dict[str, Any]:
    """Date, the benchmark's own ``fields``, then where and with what it ran."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **fields,
        "directory": str(directory),
        "filesystem": run_text(["stat", "-f", "-c", "%T", str(directory)]),
        "mount": run_text(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", str(directory)]),
        "fio_version": run_text(["fio", "--version"]),
        "fio_args": FIO_ARGS,
        "host": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "units": "GB/s = 1e9 bytes/s",
    }
