"""Opening a checkpoint writer or reader with few and with many checkpoints held: the time must
not grow with the count.

For each durable tier (``--durable``: an nvme directory, a Zarr store on a local path) and each
count of ``--held`` checkpoints, a config of a fast nvme tier and that durable tier is filled by
one writer (``--checkpoint``-byte checkpoints, the fast tier keeping its default 2, the durable
tier all of them), which then closes, as at the end of a training job. Each repeat then times,
on every config in turn (the order rotating from repeat to repeat, so the disk's drift falls on
all alike):

* ``writer_open``: ``TieredStorageWriter(config)``, what a training job pays before its first save
  (it collects what earlier writers left, and opens its data store);
* ``reader_open``: ``TieredStorageReader(config, name)`` of the oldest checkpoint, which only the
  durable tier holds (what ``dcp.load`` of a named checkpoint pays before reading);
* ``listing``: ``reader.checkpoints()``, which reads every commit record: it grows with the count
  by nature, shown for scale.

The peer of each figure is the same figure with the fewest checkpoints held: reported per durable
tier are the medians, and the ratio of the most to the fewest held, repeat by repeat. Target: the
writer's and the reader's open within 1.25x of their peer. The checkpoints can be tiny: what grows
is their count. Run from the repository root::

    .venv/bin/python -m benchmarks.bench_checkpoint_open --output benchmarks/results/checkpoint_open.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter
from torch.distributed.checkpoint.state_dict_saver import save

from .common import format_size, log, metadata, parse_size, positive_int, run_benchmark, spread

TARGET = 1.25
"""The most a writer's or a reader's open may take with the most checkpoints held, against the fewest."""
FIGURES = ("writer_open", "reader_open", "listing")
DURABLE_URLS = {"nvme": "nvme://{path}", "zarr": "zarr+file://{path}"}

warnings.filterwarnings("ignore", module="torch.distributed")


def parse_counts(text: str) -> list[int]:
    """``"10,200"``: at least two counts of checkpoints, each at least 1."""
    counts = sorted({positive_int(part) for part in text.split(",") if part.strip()})
    if len(counts) < 2:
        raise argparse.ArgumentTypeError("give at least two different counts, as 10,200")
    return counts


def parse_durable(text: str) -> list[str]:
    """``"nvme,zarr"``: durable tiers of :data:`DURABLE_URLS`."""
    kinds = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [kind for kind in kinds if kind not in DURABLE_URLS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(DURABLE_URLS)}")
    return kinds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--held", type=parse_counts, default=parse_counts("10,200"), help="checkpoints held")
    parser.add_argument("--durable", type=parse_durable, default=parse_durable("nvme,zarr"))
    parser.add_argument(
        "--checkpoint", type=parse_size, default=parse_size("256KiB"), help="bytes of one checkpoint"
    )
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def tier_config(directory: Path, durable: str) -> dict[str, Any]:
    return {
        "cache": {"budget": "64MiB"},
        "tiers": [
            {"name": "fast", "backend": f"nvme://{directory / 'fast'}"},
            {"name": "durable", "backend": DURABLE_URLS[durable].format(path=directory / "durable")},
        ],
    }


def fill(config: dict[str, Any], count: int, nbytes: int) -> None:
    """Save ``count`` checkpoints ``step-<n>`` of ``nbytes`` each with one writer, then close it."""
    state = {"weights": torch.ones(max(nbytes // 4, 1))}
    with TieredStorageWriter(config) as writer:
        for step in range(count):
            save(state, checkpoint_id=f"step-{step}", storage_writer=writer, no_dist=True)
        writer.wait_durable()


def measure(config: dict[str, Any]) -> dict[str, float]:
    """Milliseconds of each of :data:`FIGURES`, once."""
    started = time.perf_counter()
    writer = TieredStorageWriter(config)
    writer_open = time.perf_counter() - started
    writer.close()
    started = time.perf_counter()
    reader = TieredStorageReader(config, "step-0")
    reader_open = time.perf_counter() - started
    if reader.tier != "durable":
        raise AssertionError(f"step-0 was read from tier {reader.tier!r}, not from the durable tier alone")
    started = time.perf_counter()
    reader.checkpoints()
    listing = time.perf_counter() - started
    reader.close()
    return {"writer_open": writer_open * 1e3, "reader_open": reader_open * 1e3, "listing": listing * 1e3}


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    meta = metadata(
        directory,
        benchmark="checkpoint_open",
        held=args.held,
        durable=args.durable,
        checkpoint_bytes=format_size(args.checkpoint),
        repeats=args.repeats,
        target=TARGET,
    )
    configs: dict[tuple[str, int], dict[str, Any]] = {}
    for durable in args.durable:
        for count in args.held:
            config = tier_config(directory / f"{durable}-{count}", durable)
            log(f"filling the {durable} config with {count} checkpoints")
            started = time.perf_counter()
            fill(config, count, args.checkpoint)
            log(f"  {time.perf_counter() - started:.1f} s")
            configs[durable, count] = config
    order = list(configs)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        shift = repeat % len(order)
        figures = {}
        for durable, count in order[shift:] + order[:shift]:
            figures[f"{durable}-{count}"] = measure(configs[durable, count])
        log(f"repeat {repeat + 1}: {figures}")
        runs.append(figures)
    return {**meta, **summary(runs, args), "runs": runs}


def summary(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    fewest, most = args.held[0], args.held[-1]
    medians: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    meets: dict[str, bool] = {}
    for durable in args.durable:
        medians[durable] = {
            figure: {
                count: spread([run[f"{durable}-{count}"][figure] for run in runs]) for count in args.held
            }
            for figure in FIGURES
        }
        ratios[durable] = {}
        for figure in FIGURES:
            ratio = [run[f"{durable}-{most}"][figure] / run[f"{durable}-{fewest}"][figure] for run in runs]
            ratios[durable][f"{figure}_{most}_vs_{fewest}"] = spread(ratio)
            if figure != "listing":
                meets[f"{durable}_{figure}"] = statistics.median(ratio) <= TARGET
    return {"medians_ms": medians, "ratios": ratios, "meets_target": meets}


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(run, parse_args(argv), prefix="checkpoint-open-", needs_fio=False)


if __name__ == "__main__":
    sys.exit(main())
