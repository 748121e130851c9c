"""Spill PyTorch tensors through a DRAM cache onto NVMe, Zarr and ADIOS2 tiers, train a model whose
optimizer state lives there, and measure what each tier delivers.

The subcommands of the ``tierstore`` command line (the paragraph above is its ``--help``):

* ``tierstore train``: the main job. Train a small GPT-style model whose fp32 optimizer state and
  saved activations are each several times their DRAM budget, with the offloaded AdamW and the
  activation offload on one store over the embedded default config (an NVMe tier in
  ./tierstore-data); print loss, step time, resident activation bytes and GB/s per tier.
* ``tierstore spill``: spill tensors several times larger than the DRAM budget through the store,
  read every one back, verify it bit for bit, print the throughput of each phase and how many
  bytes actually reached the tiers (none when everything fits in the budget).
* ``tierstore probe CONFIG``: measure (or show the cached, of the same probe size) read and write
  bandwidth of every path, saying which.
* ``tierstore bench CONFIG``: throughput of each path alone and of each tier with all its paths,
  with a progress bar, JSON output and a PNG of GB/s per path over time.

``train`` and ``spill`` remove the NVMe directory afterwards if they created it (the scratch store
has deleted its objects by then). Bad options are usage errors (exit status 2) naming the option.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .backends import open_backend
from .bandwidth import ProbeCache, probe
from .bench import Timeline, measure_path, measure_tier, plot_timeline
from .config import StoreConfig, default_config, load_config, parse_byte_size
from .errors import ConfigError, TierStoreError
from .store import TierStore
from .tier import Tier


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_byte_size(text: str) -> int:
    size = _byte_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, not {text!r}")
    return size


def _whole_words(text: str) -> int:
    """An object size for ``spill``: its tensors are int32 words, so a positive multiple of 4."""
    size = _byte_size(text)
    if size < 4 or size % 4:
        raise argparse.ArgumentTypeError(
            f"must be a positive multiple of 4 bytes (int32 words), not {text!r}"
        )
    return size


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


@contextmanager
def _removed_if_created(directory: Path) -> Iterator[None]:
    """Remove ``directory`` afterwards, with the parents made for it, if this run created it and
    left it empty: a scratch store deletes its objects at close, but not the folder it made."""
    absolute = directory.absolute()
    created = [path for path in (absolute, *absolute.parents) if not path.exists()]  # deepest first
    try:
        yield
    finally:
        for path in created:
            try:
                path.rmdir()
            except OSError:  # not empty (someone else's files), or never made: leave it and above
                break


def demo_tensor(base: torch.Tensor, index: int) -> torch.Tensor:
    """Object ``index``: random int32 words plus ``index``, viewed as fp32 or bf16 alternately.

    Cheap to regenerate for verification, and any misplaced block or object changes its value.
    """
    return base.add(index).view(torch.float32 if index % 2 == 0 else torch.bfloat16)


def run_demo(config: dict[str, Any], total: int, object_bytes: int) -> dict[str, Any]:
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
            pending.append(store.put(f"tensor-{index}", demo_tensor(base, index)))
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


def run_training(
    config: dict[str, Any],
    *,
    layers: int,
    width: int,
    length: int,
    batch: int,
    steps: int,
    sub_group_size: int,
    budget: int,
    activation_budget: int,
    optimizer_name: str = "adamw",
) -> dict[str, Any]:
    """Train a GPT-style model on text that ships with Python, with its fp32 optimizer state
    (:class:`OffloadedAdamW`, or :class:`OffloadedAPOLLO` as APOLLO-Mini for ``"apollo-mini"``;
    ``budget`` bytes of DRAM) and the activations saved for backward
    (:class:`ActivationOffload`, ``activation_budget`` bytes, lifetime plan) both spilled to the
    config's tiers through one store (which caches nothing itself)."""
    from .activations import ActivationOffload  # the workloads sit above the store
    from .optimizer import APOLLO_MINI, OffloadedAdamW, OffloadedAPOLLO, StagedOptimizer
    from .testing.gpt import GPT, apollo_groups, batch_of, byte_corpus

    settings = load_config(config)
    torch.manual_seed(0)
    # fp32 on the CPU: bf16 attention kernels run an order of magnitude slower there.
    model = GPT(vocab=256, width=width, layers=layers, heads=max(1, width // 64), length=length)
    corpus = byte_corpus()
    parameters = sum(p.numel() for p in model.parameters())
    # One DRAM ledger for both workloads: the store holds exactly their two budgets.
    store_settings = settings.model_copy(
        update={
            "cache": settings.cache.model_copy(update={"budget": 0}),
            "memory_budget": budget + activation_budget,
        }
    )
    report: dict[str, Any] = {
        "optimizer": optimizer_name,
        "parameters": parameters,
        "dram_budget_bytes": budget,
        "activation_budget_bytes": activation_budget,
        "tokens_per_step": batch * length,
        "steps": [],
    }
    with TierStore.from_config(store_settings) as store:
        optimizer: StagedOptimizer
        if optimizer_name == "apollo-mini":
            optimizer = OffloadedAPOLLO(
                apollo_groups(model, APOLLO_MINI),
                store,
                lr=1e-3,
                sub_group_size=sub_group_size,
                dram_budget=budget,
                max_grad_norm=1.0,
            )
        else:
            optimizer = OffloadedAdamW(
                model.parameters(),
                store,
                lr=1e-3,
                sub_group_size=sub_group_size,
                dram_budget=budget,
                max_grad_norm=1.0,
            )
        state_bytes = sum(4 * optimizer.state_numel(sg) for sg in optimizer.subgroups)
        report["fp32_state_bytes"] = state_bytes
        report["state_over_budget"] = round(state_bytes / budget, 2)
        offload = ActivationOffload(store, budget=activation_budget, min_bytes="256KiB", plan="lifetime")
        report["subgroups"] = len(optimizer.subgroups)
        report["memory"] = store.stats()["memory"]
        for step in range(steps):
            tokens, targets = batch_of(corpus, step, batch, length)
            before = {t.name: t.bytes_read + t.bytes_written for t in store.tiers}
            started = time.perf_counter()
            with offload:
                loss = model(tokens, targets)
            model.zero_grad(set_to_none=True)
            loss.backward()
            backward_done = time.perf_counter()
            optimizer.step()
            finished = time.perf_counter()
            activations = offload.stats()
            seconds = finished - started
            tiers = {
                t.name: round((t.bytes_read + t.bytes_written - before[t.name]) / seconds / 1e9, 3)
                for t in store.tiers
            }
            entry = {
                "step": step + 1,
                "loss": round(float(loss.detach()), 5),
                "step_s": round(seconds, 3),
                "forward_backward_s": round(backward_done - started, 3),
                "optimizer_step_s": round(finished - backward_done, 3),
                "peak_resident_activation_bytes": activations["step_peak_resident_bytes"],
                "keep_in_memory_activation_bytes": activations["step_saved_bytes"],
                "activation_plan": "lifetime" if activations.get("predicted_step_s") else "profiling",
                "gb_per_s": tiers,
            }
            report["steps"].append(entry)
            print(
                f"step {entry['step']}: loss {entry['loss']:.4f}  step {entry['step_s']:.2f} s "
                f"(fwd+bwd {entry['forward_backward_s']:.2f}, optimizer {entry['optimizer_step_s']:.2f})  "
                f"activations resident {entry['peak_resident_activation_bytes'] / 2**20:.1f} MiB of "
                f"{entry['keep_in_memory_activation_bytes'] / 2**20:.1f} MiB saved "
                f"({entry['activation_plan']})  "
                + "  ".join(f"{name} {gbps} GB/s" for name, gbps in tiers.items()),
                file=sys.stderr,
            )
        offload.close()
        report["activation_stats"] = offload.stats()
        report["activation_plan"] = offload.plan_explain()
    losses = [entry["loss"] for entry in report["steps"]]
    report["loss_decreased"] = losses[-1] < losses[0] if len(losses) > 1 else None  # one step: no trend
    return report


def run_probe(config: StoreConfig, size: int, refresh: bool) -> dict[str, Any]:
    """Bandwidth of every path of every tier, with where each figure came from: measured now, or
    the cache's (a probe of the same ``size`` at most a week old) unless ``refresh``."""
    cache = ProbeCache()
    report: dict[str, Any] = {}
    for index, tier in enumerate(config.tiers):
        for position, path in enumerate(tier.path_configs()):
            identity = json.dumps(path.backend, sort_keys=True, default=str)
            name = path.name or f"{tier.name}.{position}"
            probed = None if refresh else cache.get(identity, size)
            source = "cache"
            if probed is None:
                with open_backend(path.backend, where=f"tiers.{index}.backend") as backend:
                    probed = probe(backend, size)
                cache.put(identity, probed)
                source = "measured"
            report[name] = {
                "tier": tier.name,
                "backend": path.backend,
                **probed.bandwidth.as_gbps(),
                "probe_bytes": probed.nbytes,
                "source": source,
                "measured_at": datetime.fromtimestamp(probed.measured_at, UTC).isoformat(timespec="seconds"),
            }
    return report


def run_bench(config: StoreConfig, size: int, count: int) -> dict[str, Any]:
    """Each path alone, then each tier with all its paths, sampled over time."""
    report: dict[str, Any] = {"object_bytes": size, "objects": count, "tiers": {}}
    series: dict[str, list[tuple[float, float]]] = {}
    offset = 0.0
    for index, tier_config in enumerate(config.tiers):
        tier = Tier.from_config(tier_config, where=f"tiers.{index}")
        try:
            phases = 2 * count * (len(tier.paths) + 1)
            with tqdm(total=phases, desc=tier.name, unit="obj", file=sys.stderr) as bar:
                solo = {}
                with Timeline(tier.paths) as timeline:
                    for path in tier.paths:
                        solo[path.name] = measure_path(path, size, count, progress=bar.update)
                    combined = measure_tier(tier, size, count, progress=bar.update)
            for name, points in timeline.rates().items():
                series[name] = series.get(name, []) + [(t + offset, g) for t, g in points]
            offset = max((t for points in series.values() for t, _ in points), default=offset)
            combined.pop("object_write_seconds")
            report["tiers"][tier.name] = {
                "placement": tier.placement,
                "paths_alone": solo,
                "tier": combined,
                "sum_of_paths_alone": {
                    side: round(sum(figures[side] for figures in solo.values()), 4)
                    for side in ("write_gb_per_s", "read_gb_per_s")
                },
                "stats": tier.stats(),
            }
        finally:
            tier.close()
    report["timeline_gb_per_s"] = series
    return report


def main(argv: Sequence[str] | None = None) -> int:
    default_dir = default_config()["tiers"][0]["backend"]["path"]
    parser = argparse.ArgumentParser(prog="tierstore", description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="one of these (COMMAND --help for its options):",
    )
    train = commands.add_parser(
        "train",
        help="main job: train a GPT with its optimizer state and activations offloaded",
        description="Train a GPT-style model on the standard library's source text with OffloadedAdamW "
        "or APOLLO-Mini (fp32 state several times its DRAM budget) and ActivationOffload (saved "
        "activations several times theirs), over the embedded default config (one NVMe tier); print "
        "loss, step time, resident activation bytes and GB/s.",
    )
    train.add_argument("--dir", type=Path, help=f"directory of the NVMe tier (default ./{default_dir})")
    train.add_argument("--layers", type=_positive_int, default=4, help="transformer blocks (4)")
    train.add_argument("--width", type=_positive_int, default=256, help="model width, 64 per head (256)")
    train.add_argument("--length", type=_positive_int, default=128, help="tokens per sequence (128)")
    train.add_argument("--batch", type=_positive_int, default=8, help="sequences per step (8)")
    train.add_argument("--steps", type=_positive_int, default=6, help="optimizer steps (6)")
    train.add_argument(
        "--sub-group-size", type=_positive_int, default=250_000, help="elements per sub-group (250000)"
    )
    train.add_argument(
        "--dram-budget",
        type=_positive_byte_size,
        default=_byte_size("16MiB"),
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
        type=_positive_byte_size,
        default=_byte_size("24MiB"),
        help="activation bytes held in memory at once: being written, kept, read back (24MiB)",
    )
    demo = commands.add_parser(
        "spill",
        help="spill tensors larger than the DRAM budget and read them back",
        description="Put --total bytes in objects of --object bytes through the store, flush, read "
        "every one back and verify it; report GB/s and the bytes that reached the tiers.",
    )
    where = demo.add_mutually_exclusive_group()
    where.add_argument("--config", type=Path, help="store config (.toml/.json); default: the embedded one")
    where.add_argument(
        "--dir", type=Path, help=f"directory of the default config's NVMe tier (./{default_dir})"
    )
    demo.add_argument(
        "--total",
        type=_positive_byte_size,
        default=_byte_size("1GiB"),
        help="bytes to spill, a multiple of --object (1GiB)",
    )
    demo.add_argument(
        "--object",
        type=_whole_words,
        default=_byte_size("32MiB"),
        help="bytes per object, a multiple of 4 (32MiB)",
    )
    demo.add_argument(
        "--budget",
        type=_byte_size,
        help="DRAM cache budget (default: the config's, 256MiB embedded); 0 sends every object to a tier",
    )
    probe_command = commands.add_parser(
        "probe",
        help="measure each path's read and write bandwidth",
        description="Write and read back a scratch object on every path of every tier; print GB/s, "
        "the probe's object size and whether each figure was measured now or taken from the cache "
        "(~/.cache/tierstore/bandwidth.json: a probe of the same --size at most a week old).",
    )
    probe_command.add_argument("config", type=Path, help="store config (.toml/.json)")
    probe_command.add_argument(
        "--size", type=_positive_byte_size, default=_byte_size("64MiB"), help="probe object size (64MiB)"
    )
    probe_command.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    bench = commands.add_parser(
        "bench",
        help="throughput of each path and of each multi-path tier",
        description="Measure each path alone, then each tier with all its paths; print a JSON report.",
    )
    bench.add_argument("config", type=Path, help="store config (.toml/.json)")
    bench.add_argument(
        "--size", type=_positive_byte_size, default=_byte_size("64MiB"), help="object size (64MiB)"
    )
    bench.add_argument("--objects", type=_positive_int, default=8, help="objects per measurement (8)")
    bench.add_argument("--output", type=Path, help="write the JSON report here too")
    bench.add_argument("--plot", type=Path, help="PNG of GB/s per path over time (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.command == "spill" and args.total % args.object:
        demo.error(
            f"argument --total: {args.total} bytes is not a multiple of --object ({args.object} bytes)"
        )
    if args.command == "bench":  # a report must never be lost to an output it cannot write
        for option, path in (("--output", args.output), ("--plot", args.plot)):
            problem = None if path is None else _unwritable(path)
            if problem is not None:
                bench.error(f"argument {option}: {problem}")
        if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
            bench.error("argument --plot: needs matplotlib: pip install 'tierstore[plot]'")

    try:
        if args.command == "spill":
            return _spill(args)
        if args.command == "train":
            return _train(args)
        settings = load_config(args.config)
        if args.command == "probe":
            report = run_probe(settings, args.size, args.refresh)
        else:
            report = run_bench(settings, args.size, args.objects)
    except TierStoreError as error:
        print(f"tierstore {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the context managers on the way out have cleaned up
        print(f"tierstore {args.command}: interrupted", file=sys.stderr)
        return 130
    if args.command == "bench" and args.plot is not None:
        try:
            plot_timeline(
                report["timeline_gb_per_s"], f"tierstore bench: {args.size >> 20} MiB objects", str(args.plot)
            )
            report["plot"] = str(args.plot)
        except OSError as error:
            report["plot_error"] = f"{args.plot}: {error.strerror or error}"
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if getattr(args, "output", None) is not None:
        try:
            args.output.write_text(text + "\n")
        except OSError as error:
            print(
                f"tierstore bench: the report above was not written to {args.output}: "
                f"{error.strerror or error}",
                file=sys.stderr,
            )
            return 1
    return 0


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


def _train(args: argparse.Namespace) -> int:
    """``train`` with the parsed options: the report (one JSON document) on stdout; a run that
    fails its check (:func:`training_failure`) says why on stderr and ends with status 1."""
    defaults = default_config()
    directory = Path(args.dir or defaults["tiers"][0]["backend"]["path"])
    defaults["tiers"][0]["backend"]["path"] = str(directory)
    with _removed_if_created(directory):
        report = run_training(
            defaults,
            layers=args.layers,
            width=args.width,
            length=args.length,
            batch=args.batch,
            steps=args.steps,
            sub_group_size=args.sub_group_size,
            budget=args.dram_budget,
            activation_budget=args.activation_budget,
            optimizer_name=args.optimizer,
        )
    print(json.dumps(report, indent=2))
    failure = training_failure(report)
    if failure is not None:
        print(f"tierstore train: {failure}", file=sys.stderr)
        return 1
    return 0


def training_failure(report: dict[str, Any]) -> str | None:
    """Why a finished ``train`` run failed its own check, or None: the loss must fall from the first
    step to the last (a one-step run has no trend, and passes)."""
    if report["loss_decreased"] is not False:
        return None
    steps = report["steps"]
    return f"the loss did not decrease over {len(steps)} steps ({steps[0]['loss']} to {steps[-1]['loss']})"


def _spill(args: argparse.Namespace) -> int:
    """``spill``: the report (one JSON document) on stdout, its one-line summary on stderr."""
    config = default_config() if args.config is None else load_config(args.config).model_dump()
    if args.budget is not None:
        config["cache"] = {**config.get("cache", {}), "budget": args.budget}
    if args.config is None:
        directory = Path(args.dir or config["tiers"][0]["backend"]["path"])
        config["tiers"][0]["backend"]["path"] = str(directory)
        with _removed_if_created(directory):
            report = run_demo(config, args.total, args.object)
    else:
        report = run_demo(config, args.total, args.object)
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


if __name__ == "__main__":
    sys.exit(main())
