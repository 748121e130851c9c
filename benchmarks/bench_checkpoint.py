"""Checkpoints through DCP: how long training is blocked, how long until the checkpoint is
durable, and how long a load takes, for DCP's own writer and tierstore's, side by side.

The state is a model with AdamW (fp32 weights, ``exp_avg``, ``exp_avg_sq``: ``--tensor``-sized
matrices to ``--state`` bytes in all, plus 64 small biases with their moments, step counts and
``param_groups``), random values. Each repeat runs every variant, the order rotating from repeat
to repeat, on the same disk:

* ``filesystem``: ``dcp.save`` with ``FileSystemWriter`` (DCP's defaults: one thread, files
  fsynced): blocked = committed = durable when it returns;
* ``filesystem_async``: ``dcp.async_save`` to ``FileSystemWriter`` with DCP's ``DefaultStager``
  (a full copy of the state in new CPU memory): blocked until ``async_save`` returns, durable
  when its future resolves;
* ``tierstore``: ``dcp.save`` with ``TieredStorageWriter``: blocked = committed on the fast tier
  (an nvme directory, O_DIRECT); durable once the drain to the persistent tier has committed;
* ``tierstore_async``: ``dcp.async_save`` with the writer as its stager, its ``cache.budget``
  holding the whole state: blocked while the state is copied into that budget;
* ``tierstore_async_budget``: the same with ``--budget`` (a fraction of the state): staging spills
  to the fast tier while the budget is full, so training waits for those writes too;
* ``fio``: fio writing and reading a file of the state's size in the fast tier's directory.

The persistent tier is another directory on the same disk (the drain hard-links the fast tier's
files: nothing is copied), or with ``--remote-mount`` a Zarr tier on that mounted file system
(``../shared/tools/remote-tier.sh start``: sshfs over TCP; the drain reads every object back,
checks it, and writes it over the network), measured for ``tierstore`` in a pass of its own.
Each tierstore writer lives across repeats, as in a training run, after one untimed save that
touches its budget; DCP's stager allocates its copy at every save, as it does by default.

Loads (``dcp.load`` into the same tensors, zeroed first, checked against each tensor's xxHash3)
start with the page cache dropped (root). Targets: ``tierstore_async`` blocked for at most the
time to copy the state into memory (``copy``: ``copy_`` of every tensor into memory allocated and
touched once, timed right before each ``tierstore_async`` save, so that this memory, like the
writer's budget, was last written one repeat earlier: memory left idle that long is slower to
write again here, a virtual machine, as ``copy_after``, the same copy right after the save,
shows), and the fast-tier commit of ``tierstore`` within 1.15x of fio writing the same bytes. Run
from the repository root::

    .venv/bin/python -m benchmarks.bench_checkpoint --output benchmarks/results/checkpoint.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import torch
import xxhash
from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from .common import (
    drop_caches,
    format_size,
    log,
    measure_fio,
    metadata,
    parse_size,
    positive_int,
    run_benchmark,
    spread,
)

TARGETS = {"async_blocked_vs_copy": 1.0, "commit_vs_fio_write": 1.15}
VARIANTS = ("filesystem", "filesystem_async", "tierstore", "tierstore_async", "tierstore_async_budget", "fio")
BIASES = 64

warnings.filterwarnings("ignore", module="torch.distributed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--state", type=parse_size, default=parse_size("3GiB"), help="bytes of state")
    parser.add_argument("--tensor", type=parse_size, default=parse_size("64MiB"), help="bytes of one matrix")
    parser.add_argument(
        "--budget", type=parse_size, default=parse_size("512MiB"), help="tierstore_async_budget's"
    )
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--remote-mount", type=Path, default=None, help="a mounted network file system")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


# -- the state --------------------------------------------------------------------------------------
def make_state(total: int, tensor: int) -> dict[str, Any]:
    """Weights and AdamW moments of ``total // (3 * tensor)`` matrices, and small biases."""
    generator = torch.Generator().manual_seed(0)
    columns = 1024
    rows = tensor // 4 // columns
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for index in range(max(1, total // (3 * rows * columns * 4))):
        name = f"layers.{index}.weight"
        model[name] = torch.randn(rows, columns, generator=generator)
        moments[name] = {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(rows, columns, generator=generator),
            "exp_avg_sq": torch.rand(rows, columns, generator=generator),
        }
    for index in range(BIASES):
        name = f"layers.{index}.bias"
        model[name] = torch.randn(columns, generator=generator)
        moments[name] = {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(columns, generator=generator),
            "exp_avg_sq": torch.rand(columns, generator=generator),
        }
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(model)}]
    return {"model": model, "optim": {"state": moments, "param_groups": groups}}


def tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            found.extend(tensors(value))
    return found


def fingerprint(state: dict[str, Any]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy().data) for t in tensors(state)]


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def copy_targets(state: dict[str, Any]) -> list[torch.Tensor]:
    """Memory for a copy of every tensor of the state, allocated and touched once."""
    targets = [torch.empty_like(t) for t in tensors(state)]
    for target in targets:
        target.fill_(0)
    return targets


def copy_seconds(state: dict[str, Any], targets: list[torch.Tensor]) -> float:
    """Copying the state into ``targets`` (memory already touched): the least any staging can
    cost."""
    started = time.perf_counter()
    for target, source in zip(targets, tensors(state), strict=True):
        target.copy_(source)
    return time.perf_counter() - started


# -- variants ---------------------------------------------------------------------------------------
def tier_config(directory: Path, budget: int, persistent: str) -> dict[str, Any]:
    return {
        "cache": {"budget": budget},
        "tiers": [
            {"name": "fast", "backend": f"nvme://{directory / 'fast'}"},
            {"name": "persistent", "backend": persistent},
        ],
    }


class Tierstore:
    """One writer kept across repeats (warmed by an untimed save), and a reader per load."""

    def __init__(self, config: dict[str, Any], state: dict[str, Any], *, asynchronous: bool) -> None:
        self.config = config
        self.asynchronous = asynchronous
        self.writer = TieredStorageWriter(config, keep={"fast": 1, "persistent": 1})
        self.saves = 0
        self.save(state)

    def save(self, state: dict[str, Any]) -> dict[str, float]:
        self.saves += 1
        name = f"tierstore://bench-{self.saves}"
        started = time.perf_counter()
        if self.asynchronous:
            saving = async_save(state, checkpoint_id=name, storage_writer=self.writer)
            blocked = time.perf_counter() - started
            assert isinstance(saving, Future)
            saving.result()
        else:
            save(state, checkpoint_id=name, storage_writer=self.writer)
            blocked = time.perf_counter() - started
        committed = time.perf_counter() - started
        self.writer.wait_durable()
        return {"blocked_s": blocked, "commit_s": committed, "durable_s": time.perf_counter() - started}

    def load(self, state: dict[str, Any]) -> None:
        with TieredStorageReader(self.config) as reader:
            load(state, storage_reader=reader)

    def close(self) -> None:
        self.writer.close()


def filesystem_save(state: dict[str, Any], path: Path, *, asynchronous: bool) -> dict[str, float]:
    shutil.rmtree(path, ignore_errors=True)
    started = time.perf_counter()
    if asynchronous:
        stager = DefaultStager(StagingOptions(False, False, False, False))  # what async_save makes itself
        saving = async_save(state, storage_writer=FileSystemWriter(path), async_stager=stager)
        blocked = time.perf_counter() - started
        assert isinstance(saving, Future)
        saving.result()
        stager.close()
    else:
        save(state, storage_writer=FileSystemWriter(path))
        blocked = time.perf_counter() - started
    done = time.perf_counter() - started
    return {"blocked_s": blocked, "commit_s": done, "durable_s": done}


def timed_load(state: dict[str, Any], expected: list[int], read: Callable[[dict[str, Any]], None]) -> float:
    """Seconds to load into ``state`` (zeroed first, caches dropped), checked against ``expected``."""
    for tensor in tensors(state):
        tensor.zero_()
    drop_caches()
    started = time.perf_counter()
    read(state)
    seconds = time.perf_counter() - started
    if fingerprint(state) != expected:
        raise AssertionError("a load read back different data")
    return seconds


# -- main -------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    state = make_state(args.state, args.tensor)
    nbytes = state_bytes(state)
    expected = fingerprint(state)
    whole = -(-nbytes // (64 << 20)) * (64 << 20) + (256 << 20)  # the state and its packs
    meta = metadata(
        directory,
        state=format_size(nbytes),
        state_bytes=nbytes,
        tensors=len(tensors(state)),
        repeats=args.repeats,
        budget_bytes={
            "tierstore_async": whole,
            "tierstore_async_budget": args.budget,
            "tierstore": args.budget,
        },
        order="variants rotate by one place each repeat",
        steady_state=(
            "each tierstore variant keeps one writer across repeats, as a training loop saves "
            "repeatedly with one writer; an untimed first save touches its staging budget, so "
            "every timed save is a steady-state one"
        ),
        copy=(
            "copy_s (what async_blocked_vs_copy divides by): copy_ of every tensor into memory "
            "allocated and touched once, timed right before each tierstore_async save, that memory "
            "like the writer's budget last written one repeat earlier; copy_after_s: the same copy "
            "right after the save, into memory written a moment before"
        ),
    )
    log(f"checkpoint benchmark: {format_size(nbytes)} of state in {directory} ({meta['mount']})")
    persistent = f"nvme://{directory / 'persistent'}"
    writers = {
        "tierstore": Tierstore(
            tier_config(directory / "sync", args.budget, persistent + "-sync"), state, asynchronous=False
        ),
        "tierstore_async": Tierstore(
            tier_config(directory / "async", whole, persistent + "-async"), state, asynchronous=True
        ),
        "tierstore_async_budget": Tierstore(
            tier_config(directory / "budget", args.budget, persistent + "-budget"), state, asynchronous=True
        ),
    }
    targets = copy_targets(state)
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
            figures: dict[str, Any] = {"repeat": repeat, "order": list(order)}
            for variant in order:
                if variant == "fio":
                    bandwidth = measure_fio(directory / "fio", -(-nbytes // (4 << 20)) * (4 << 20))
                    figures["fio"] = {
                        "write_s": nbytes / bandwidth["fio_write"],
                        "read_s": nbytes / bandwidth["fio_read"],
                    }
                elif variant.startswith("filesystem"):
                    path = directory / "filesystem"
                    figures[variant] = filesystem_save(state, path, asynchronous=variant.endswith("async"))
                    reader = FileSystemReader(path)
                    figures[variant]["load_s"] = timed_load(
                        state, expected, partial(load, storage_reader=reader)
                    )
                    shutil.rmtree(path)
                else:
                    writer = writers[variant]
                    before = copy_seconds(state, targets) if variant == "tierstore_async" else None
                    figures[variant] = writer.save(state)
                    if before is not None:
                        figures |= {"copy_s": before, "copy_after_s": copy_seconds(state, targets)}
                    figures[variant]["load_s"] = timed_load(state, expected, writer.load)
                log(
                    f"  #{repeat} {variant}: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in figures[variant].items())
                )
            runs.append(_rounded(figures))
    finally:
        for writer in writers.values():
            writer.close()
        del targets
    remote = (
        remote_pass(args, directory, state, expected)
        if args.remote_mount
        else {"skipped": "no --remote-mount"}
    )
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    return {
        "benchmark": "checkpoint",
        "metadata": meta,
        "targets": TARGETS,
        **summary(runs, nbytes),
        "remote": remote,
        "runs": runs,
    }


def remote_pass(
    args: argparse.Namespace, directory: Path, state: dict[str, Any], expected: list[int]
) -> dict[str, Any]:
    """``tierstore`` with its persistent tier on the mounted network file system (Zarr)."""
    remote = args.remote_mount / f"tierstore-bench-{time.monotonic_ns()}"
    writer = Tierstore(
        tier_config(directory / "remote", args.budget, f"zarr+file://{remote}"), state, asynchronous=False
    )
    try:
        runs = []
        for repeat in range(args.repeats):
            figures = writer.save(state)
            with TieredStorageReader({**writer.config, "tiers": writer.config["tiers"][1:]}) as reader:
                figures["load_persistent_s"] = timed_load(
                    state, expected, partial(load, storage_reader=reader)
                )
            log(f"  remote #{repeat}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
            runs.append(_rounded(figures))
    finally:
        writer.close()
        shutil.rmtree(remote, ignore_errors=True)
    return {"mount": str(args.remote_mount), "medians": _medians(runs), "runs": runs}


def summary(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    medians = {variant: _medians([run[variant] for run in runs]) for variant in VARIANTS}
    copy = statistics.median(run["copy_s"] for run in runs)
    blocked = [run["tierstore_async"]["blocked_s"] / run["copy_s"] for run in runs]
    commit = [run["tierstore"]["commit_s"] / run["fio"]["write_s"] for run in runs]
    return {
        "medians": {"copy_s": round(copy, 3), **medians},
        "gb_per_s": {
            variant: round(nbytes / medians[variant]["commit_s"]["median"] / 1e9, 3)
            for variant in VARIANTS
            if variant != "fio"
        },
        "ratios": {
            "async_blocked_vs_copy": spread(blocked),
            "commit_vs_fio_write": spread(commit),
        },
        "meets_target": {
            "async_blocked_vs_copy": statistics.median(blocked) <= TARGETS["async_blocked_vs_copy"],
            "commit_vs_fio_write": statistics.median(commit) <= TARGETS["commit_vs_fio_write"],
        },
    }


def _medians(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {key: spread([run[key] for run in runs]) for key in runs[0]}


def _rounded(figures: dict[str, Any]) -> dict[str, Any]:
    return {
        key: round(value, 3)
        if isinstance(value, float)
        else _rounded(value)
        if isinstance(value, dict)
        else value
        for key, value in figures.items()
    }


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(run, parse_args(argv), prefix="checkpoint-")


if __name__ == "__main__":
    sys.exit(main())
