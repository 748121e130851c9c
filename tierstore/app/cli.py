"""Spill PyTorch tensors through a DRAM cache onto NVMe, Zarr and ADIOS2 tiers, train a model whose
optimizer state lives there, and measure what each tier delivers.

The subcommands of the ``tierstore`` command line (the paragraph above is its ``--help``):

* ``tierstore train``: the main job. Train a small GPT-style model whose fp32 optimizer state and
  saved activations are each several times their DRAM budget, with the offloaded AdamW and the
  activation offload on one store over the embedded default config (an NVMe tier in
  ./tierstore-data); print loss, step time, resident activation bytes and GB/s per tier, then a
  short summary (the full report as JSON with ``--json``).
* ``tierstore spill``: spill tensors several times larger than the DRAM budget through the store,
  read every one back, verify it bit for bit, print the throughput of each phase and how many
  bytes actually reached the tiers (none when everything fits in the budget).
* ``tierstore probe CONFIG``: measure (or show the cached, of the same probe size) read and write
  bandwidth of every path, saying which.
* ``tierstore bench CONFIG``: throughput of each path alone and of each tier with all its paths,
  with a progress bar, JSON output and a PNG of GB/s per path over time.
* ``tierstore inspect CONFIG``: open the persistent store a config names, read-only (a process may
  have it open for writing meanwhile), and list its keys with their sizes, its tiers with their
  paths, the bytes they hold and the space free on each.

``train`` and ``spill`` remove the NVMe directory afterwards if they created it (the scratch store
has deleted its objects by then). Bad options are usage errors (exit status 2) naming the option.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .. import __version__
from .._directories import missing_directories, remove_empty
from ..config import default_config, load_config
from ..errors import TierStoreError
from ..store import TierStore
from .arguments import byte_size, positive_byte_size, positive_int
from .bench import plot_timeline, run_bench, run_probe
from .demo import run_training, training_failure
from .inspection import inspect_summary, run_inspect, size_in_words


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tierstore`` command line on ``argv`` (default: the process's arguments); return
    its exit status: 0, 1 when a run fails its own check, 2 for a usage or store error, 130 when
    interrupted."""
    parser = argparse.ArgumentParser(prog="tierstore", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--version",
        action="version",
        version=f"tierstore {__version__} (torch {torch.__version__}, Python {platform.python_version()})",
        help="print tierstore's version (and torch's and Python's) and exit",
    )
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="one of these (COMMAND --help for its options):",
    )
    default_dir = default_config()["tiers"][0]["backend"]["path"]
    command_parsers = {
        "train": _add_train(commands, default_dir),
        "spill": _add_spill(commands, default_dir),
        "probe": _add_probe(commands),
        "bench": _add_bench(commands),
        "inspect": _add_inspect(commands),
    }
    args = parser.parse_args(argv)
    problem = _usage_problem(args)
    if problem is not None:
        command_parsers[args.command].error(problem)
    try:
        run: Callable[[argparse.Namespace], int] = args.run  # the command's, set by its parser
        return run(args)
    except TierStoreError as error:
        print(f"tierstore {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the context managers on the way out have cleaned up
        print(f"tierstore {args.command}: interrupted", file=sys.stderr)
        return 130


def _usage_problem(args: argparse.Namespace) -> str | None:
    """A usage error that no one option shows, found before any work (options that do not fit
    together, an output that could not be written), or None."""
    if args.command == "spill" and args.total % args.object:
        return f"argument --total: {args.total} bytes is not a multiple of --object ({args.object} bytes)"
    if getattr(args, "json", None) not in (None, STDOUT):  # train's, inspect's: a file to write
        problem = _unwritable(Path(args.json))
        if problem is not None:
            return f"argument --json: {problem}"
    if args.command == "bench":  # a report must never be lost to an output it cannot write
        for option, path in (("--output", args.output), ("--plot", args.plot)):
            problem = None if path is None else _unwritable(path)
            if problem is not None:
                return f"argument {option}: {problem}"
        if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
            return "argument --plot: needs matplotlib: pip install 'tierstore[plot]'"
    return None


def _unwritable(path: Path) -> str | None:
    """Why a file could not be written at ``path`` (checked before a long run), or None."""
    parent = path.absolute().parent
    if path.is_dir():
        return f"{path} is a directory"
    if not parent.is_dir():
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


STDOUT = "-"
"""``--json``'s value when given without a path: the JSON document goes to stdout."""


def _add_json(parser: argparse.ArgumentParser, what: str) -> None:
    """Give a command that prints a summary for people the ``--json [PATH]`` option."""
    parser.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        metavar="PATH",
        help=f"{what} as one JSON document: in PATH, or alone on stdout instead of the summary",
    )


def _report(command: str, report: dict[str, Any], summary: str, json_path: str | None) -> int:
    """Print ``summary``, or with ``--json`` alone the JSON ``report`` instead; with ``--json PATH``
    write the report there too. Status 1 when that file could not be written (the summary is
    printed first, and says where the report is)."""
    text = json.dumps(report, indent=2, default=str)
    if json_path == STDOUT:
        print(text)
        return 0
    print(summary)
    if json_path is not None:
        return _write_report(command, "the report", text, Path(json_path))
    return 0


def _write_report(command: str, what: str, text: str, path: Path) -> int:
    """Write the JSON document ``text`` to ``path``: status 0, or 1 with a line on stderr that says
    that ``what`` (``"the report"``) was not written there, and why."""
    try:
        path.write_text(text + "\n")
    except OSError as error:
        print(
            f"tierstore {command}: {what} was not written to {path}: {error.strerror or error}",
            file=sys.stderr,
        )
        return 1
    return 0


@contextmanager
def _removed_if_created(directory: Path) -> Iterator[None]:
    """Remove ``directory`` afterwards, with the parents made for it, if this run created it and
    left it empty: a scratch store deletes its objects at close, but not the folder it made."""
    created = missing_directories(directory)
    try:
        yield
    finally:
        remove_empty(created)


# -- train ---------------------------------------------------------------------------------------
_TRAIN_COUNTS: dict[str, tuple[int, str]] = {
    "layers": (4, "transformer blocks"),
    "width": (256, "model width, 64 per head"),
    "length": (128, "tokens per sequence"),
    "batch": (8, "sequences per step"),
    "steps": (6, "optimizer steps"),
    "sub_group_size": (250_000, "elements per sub-group"),
}
"""``train``'s counts, by the keyword of `run_training` each is (and the option, ``--sub-group-size``
for ``sub_group_size``): its default and what it counts."""


def _add_train(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], default_dir: str
) -> argparse.ArgumentParser:
    """Add ``train`` and its options to ``commands``; its parser (whose usage its errors print)."""
    train = commands.add_parser(
        "train",
        help="main job: train a GPT with its optimizer state and activations offloaded",
        description="Train a GPT-style model on the standard library's source text with OffloadedAdamW "
        "or APOLLO-Mini (fp32 state several times its DRAM budget) and ActivationOffload (saved "
        "activations several times theirs), over the embedded default config (one NVMe tier); print "
        "loss, step time, resident activation bytes and GB/s.",
    )
    train.add_argument("--dir", type=Path, help=f"directory of the NVMe tier (default ./{default_dir})")
    for name, (default, meaning) in _TRAIN_COUNTS.items():
        train.add_argument(
            f"--{name.replace('_', '-')}", type=positive_int, default=default, help=f"{meaning} ({default})"
        )
    train.add_argument(
        "--dram-budget",
        type=positive_byte_size,
        default=byte_size("16MiB"),
        help="optimizer DRAM: read-ahead ring, gradient buffer, kept sub-groups (16MiB)",
    )
    train.add_argument(
        "--optimizer",
        choices=["adamw", "apollo-mini"],
        default="adamw",
        help="offloaded AdamW (12 bytes of fp32 state per parameter), or APOLLO-Mini (rank-1 "
        "APOLLO on the blocks' matrices, about 4 bytes per parameter); default adamw",
    )
    train.add_argument(
        "--activation-budget",
        type=positive_byte_size,
        default=byte_size("24MiB"),
        help="activation bytes held in memory at once: being written, kept, read back (24MiB)",
    )
    _add_json(train, "the full report (settings, every step's figures, memory, the activation plan)")
    train.set_defaults(run=_train)
    return train


def _train(args: argparse.Namespace) -> int:
    """``train`` with the parsed options: one line per step on stderr, the summary on stdout (or,
    with ``--json``, the report); a run that fails its check (`training_failure`) says why on stderr
    and ends with status 1."""
    defaults = default_config()
    directory = Path(args.dir or defaults["tiers"][0]["backend"]["path"])
    defaults["tiers"][0]["backend"]["path"] = str(directory)
    with _removed_if_created(directory):
        report = run_training(
            defaults,
            **{name: getattr(args, name) for name in _TRAIN_COUNTS},
            budget=args.dram_budget,
            activation_budget=args.activation_budget,
            optimizer_name=args.optimizer,
        )
    status = _report("train", report, _train_summary(report, args.json), args.json)
    failure = training_failure(report)
    if failure is not None:
        print(f"tierstore train: {failure}", file=sys.stderr)
        return 1
    return status


def _train_summary(report: dict[str, Any], json_path: str | None) -> str:
    """What a training run showed, in a few lines: the loss, the optimizer state and the
    activations against their DRAM budgets, the step time and each tier's traffic."""
    steps = report["steps"]
    activations = report["activation_stats"]
    step_seconds = [step["step_s"] for step in steps]
    tiers = {name: [step["gb_per_s"][name] for step in steps] for name in steps[0]["gb_per_s"]}
    lines = [
        f"trained a GPT of {report['parameters'] / 1e6:.2f}M parameters for {len(steps)} steps with "
        f"{report['optimizer']}: loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}",
        f"optimizer state: {size_in_words(report['fp32_state_bytes'])} of fp32 in {report['subgroups']} "
        f"sub-groups, {report['state_over_budget']}x its "
        f"{size_in_words(report['dram_budget_bytes'])} DRAM budget",
        f"activations: {size_in_words(activations['spilled_bytes'])} spilled through the store, at most "
        f"{size_in_words(activations['peak_resident_bytes'])} resident of a "
        f"{size_in_words(report['activation_budget_bytes'])} budget",
        f"steps: {sum(step_seconds) / len(steps):.2f} s on average, {step_seconds[-1]:.2f} s the last; "
        + ", ".join(f"{name} {sum(rates) / len(rates):.3f} GB/s" for name, rates in tiers.items()),
    ]
    if json_path is None:
        lines.append("the full report: tierstore train --json PATH")
    elif json_path != STDOUT:
        lines.append(f"the full report: {json_path}")
    return "\n".join(lines)


# -- spill ---------------------------------------------------------------------------------------
def _add_spill(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], default_dir: str
) -> argparse.ArgumentParser:
    """Add ``spill`` and its options to ``commands``; its parser (whose usage its errors print)."""
    spill = commands.add_parser(
        "spill",
        help="spill tensors larger than the DRAM budget and read them back",
        description="Put --total bytes in objects of --object bytes through the store, flush, read "
        "every one back and verify it; report GB/s and the bytes that reached the tiers.",
    )
    where = spill.add_mutually_exclusive_group()
    where.add_argument("--config", type=Path, help="store config (.toml/.json); default: the embedded one")
    where.add_argument(
        "--dir", type=Path, help=f"directory of the default config's NVMe tier (./{default_dir})"
    )
    spill.add_argument(
        "--total",
        type=positive_byte_size,
        default=byte_size("1GiB"),
        help="bytes to spill, a multiple of --object (1GiB)",
    )
    spill.add_argument(
        "--object",
        type=_whole_words,
        default=byte_size("32MiB"),
        help="bytes per object, a multiple of 4 (32MiB)",
    )
    spill.add_argument(
        "--budget",
        type=byte_size,
        help="DRAM cache budget (default: the config's, 256MiB embedded); 0 sends every object to a tier",
    )
    spill.set_defaults(run=_spill)
    return spill


def _whole_words(text: str) -> int:
    """An object size for ``spill``: its tensors are int32 words, so a positive multiple of 4."""
    size = byte_size(text)
    if size < 4 or size % 4:
        raise argparse.ArgumentTypeError(
            f"must be a positive multiple of 4 bytes (int32 words), not {text!r}"
        )
    return size


def _spill(args: argparse.Namespace) -> int:
    """``spill``: the report (one JSON document) on stdout, its one-line summary on stderr."""
    config = default_config() if args.config is None else load_config(args.config).model_dump()
    if args.budget is not None:
        config["cache"] = {**config.get("cache", {}), "budget": args.budget}
    if args.config is None:
        directory = Path(args.dir or config["tiers"][0]["backend"]["path"])
        config["tiers"][0]["backend"]["path"] = str(directory)
        with _removed_if_created(directory):
            report = run_spill(config, args.total, args.object)
    else:
        report = run_spill(config, args.total, args.object)
    print(json.dumps(report, indent=2))
    print(_spill_summary(report), file=sys.stderr)
    if not report["verified"]:
        print(
            f"tierstore spill: {len(report['mismatched_objects'])} objects read back differ from what "
            f"was put: {report['mismatched_objects'][:10]}",
            file=sys.stderr,
        )
        return 1
    return 0


def spill_tensor(base: torch.Tensor, index: int) -> torch.Tensor:
    """Object ``index``: random int32 words plus ``index``, viewed as fp32 or bf16 alternately.

    Cheap to regenerate for verification, and any misplaced block or object changes its value.
    """
    return base.add(index).view(torch.float32 if index % 2 == 0 else torch.bfloat16)


def run_spill(config: dict[str, Any], total: int, object_bytes: int) -> dict[str, Any]:
    """Put ``total`` bytes in objects of ``object_bytes`` (a multiple of 4 dividing ``total``),
    flush, read back, verify; return figures, with the bytes that reached the tiers."""
    count = total // object_bytes
    settings = load_config(config)
    report: dict[str, Any] = {
        "objects": count,
        "object_bytes": object_bytes,
        "total_bytes": count * object_bytes,
        "cache_budget_bytes": int(settings.cache.budget),
    }
    base = torch.randint(
        -(2**31),
        2**31 - 1,
        (object_bytes // 4,),
        dtype=torch.int32,
        generator=torch.Generator().manual_seed(0),
    )
    with TierStore.from_config(settings) as store:
        started = time.perf_counter()
        pending = []
        for index in tqdm(range(count), desc="put", unit="obj", leave=False):
            pending.append(store.put(f"tensor-{index}", spill_tensor(base, index)))
            if len(pending) > 4:  # keep a few puts in flight; each borrows its tensor
                pending.pop(0).result()
        for future in pending:
            future.result()
        store.flush()
        write_seconds = time.perf_counter() - started

        started = time.perf_counter()
        mismatches = []
        for index in tqdm(range(count), desc="get", unit="obj", leave=False):
            got = store.get(f"tensor-{index}").result()
            if not torch.equal(got.view(torch.int32), base.add(index)):
                mismatches.append(index)
        read_seconds = time.perf_counter() - started
        stats = store.stats()
    moved = count * object_bytes
    report.update(
        put_and_flush_gb_per_s=round(moved / write_seconds / 1e9, 3),
        get_and_verify_gb_per_s=round(moved / read_seconds / 1e9, 3),
        tier_bytes_written=sum(tier["bytes_written"] for tier in stats["tiers"].values()),
        tier_bytes_read=sum(tier["bytes_read"] for tier in stats["tiers"].values()),
        verified=not mismatches,
        mismatched_objects=mismatches,
        stats=stats,
    )
    return report


def _spill_summary(report: dict[str, Any]) -> str:
    """One line that says how many bytes moved to and from the tiers: with everything inside the
    DRAM budget the reads are memory copies, not tier throughput."""
    total, budget = report["total_bytes"], report["cache_budget_bytes"]
    cache = f"{total / budget:.1f}x the DRAM budget" if budget else "no DRAM cache"
    moved = (
        f"{report['tier_bytes_written'] / 2**30:.2f} GiB written to the tiers, "
        f"{report['tier_bytes_read'] / 2**30:.2f} GiB read back from them"
    )
    if not report["tier_bytes_read"]:
        moved += " (every read was served from DRAM: lower --budget to read from a tier)"
    return (
        f"spilled {total / 2**30:.2f} GiB ({report['objects']} objects, {cache}); {moved}: "
        f"put+flush {report['put_and_flush_gb_per_s']} GB/s, get+verify "
        f"{report['get_and_verify_gb_per_s']} GB/s, verified={report['verified']}"
    )


# -- probe ---------------------------------------------------------------------------------------
def _add_probe(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``probe`` and its options to ``commands``; its parser (whose usage its errors print)."""
    probe_command = commands.add_parser(
        "probe",
        help="measure each path's read and write bandwidth",
        description="Write and read back a scratch object on every path of every tier; print GB/s, "
        "the probe's object size and whether each figure was measured now or taken from the cache "
        "(~/.cache/tierstore/bandwidth.json: a probe of the same --size at most a week old).",
    )
    probe_command.add_argument("config", type=Path, help="store config (.toml/.json)")
    probe_command.add_argument(
        "--size", type=positive_byte_size, default=byte_size("64MiB"), help="probe object size (64MiB)"
    )
    probe_command.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    probe_command.set_defaults(run=_probe)
    return probe_command


def _probe(args: argparse.Namespace) -> int:
    """``probe``: the report (one JSON document) on stdout."""
    report = run_probe(load_config(args.config), args.size, args.refresh)
    print(json.dumps(report, indent=2, default=str))
    return 0


# -- bench ---------------------------------------------------------------------------------------
def _add_bench(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``bench`` and its options to ``commands``; its parser (whose usage its errors print)."""
    bench = commands.add_parser(
        "bench",
        help="throughput of each path and of each multi-path tier",
        description="Measure each path alone, then each tier with all its paths; print a JSON report.",
    )
    bench.add_argument("config", type=Path, help="store config (.toml/.json)")
    bench.add_argument(
        "--size", type=positive_byte_size, default=byte_size("64MiB"), help="object size (64MiB)"
    )
    bench.add_argument("--objects", type=positive_int, default=8, help="objects per measurement (8)")
    bench.add_argument("--output", type=Path, help="write the JSON report here too")
    bench.add_argument("--plot", type=Path, help="PNG of GB/s per path over time (needs matplotlib)")
    bench.set_defaults(run=_bench)
    return bench


def _bench(args: argparse.Namespace) -> int:
    """``bench``: the report (one JSON document) on stdout, and in ``--output``; the plot in
    ``--plot``. A report that cannot be written to its file is still printed, with status 1."""
    report = run_bench(load_config(args.config), args.size, args.objects)
    if args.plot is not None:
        try:
            plot_timeline(
                report["timeline_gb_per_s"], f"tierstore bench: {args.size >> 20} MiB objects", str(args.plot)
            )
            report["plot"] = str(args.plot)
        except OSError as error:
            report["plot_error"] = f"{args.plot}: {error.strerror or error}"
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.output is not None:
        return _write_report("bench", "the report above", text, args.output)
    return 0


# -- inspect -------------------------------------------------------------------------------------
def _add_inspect(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``inspect`` and its options to ``commands``; its parser (whose usage its errors print)."""
    inspect_command = commands.add_parser(
        "inspect",
        help="list a persistent store's keys, sizes and tiers, read-only",
        description="Open the persistent store CONFIG names read-only (nothing is written, and a "
        "process may have it open meanwhile) and list its keys with their sizes, dtypes, shapes and "
        "tiers, its tiers with their paths, the bytes they hold and the space free on each.",
    )
    inspect_command.add_argument("config", type=Path, help="store config (.toml/.json) with a manifest")
    _add_json(inspect_command, "the listing")
    inspect_command.set_defaults(run=_inspect)
    return inspect_command


def _inspect(args: argparse.Namespace) -> int:
    """``inspect``: the listing on stdout (or, with ``--json``, as one JSON document)."""
    report = run_inspect(load_config(args.config), args.config)
    return _report("inspect", report, inspect_summary(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
