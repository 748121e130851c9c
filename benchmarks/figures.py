"""The benchmark figures the README and the documentation quote, written from the results' JSON.

Each quoted table lives between markers and is rewritten from ``benchmarks/results/<name>.json``::

    <!-- figures: optimizer -->
    ...
    <!-- /figures: optimizer -->

``python -m benchmarks.figures README.md docs/performance.md`` rewrites them (``make bench`` does,
after the benchmarks); ``tests/test_docs_figures.py`` checks they are current, so a quoted figure
is always the one its JSON holds. Each table starts with the command that regenerates its JSON
(the same line as in the Makefile's ``bench`` target), the date and the machine.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

COMMANDS: dict[str, str] = {
    "nvme": "-m benchmarks.bench_nvme --output benchmarks/results/nvme.json",
    "backends": "-m benchmarks.bench_backends --output benchmarks/results/backends.json",
    "virtual_tier": "-m benchmarks.bench_virtual_tier --output benchmarks/results/virtual_tier.json",
    "optimizer": "-m benchmarks.bench_optimizer --repeats 5 --profile "
    "--output benchmarks/results/optimizer.json",
    "optimizer_scale": "-m benchmarks.bench_optimizer --budget 4GiB --sizes 1GiB,4GiB,16GiB,32GiB --steps 3 "
    "--output benchmarks/results/optimizer_scale.json",
    "mlp_offload_prediction": "-m benchmarks.predict_mlp_offload "
    "--output benchmarks/results/mlp_offload_prediction.json",
    "apollo": "-m benchmarks.bench_apollo --output benchmarks/results/apollo.json",
    "apollo_quality": "-m benchmarks.quality_apollo --output benchmarks/results/apollo_quality.json "
    "--plot benchmarks/results/apollo_quality.png",
    "state_precision": "-m benchmarks.bench_state_precision --output benchmarks/results/state_precision.json",
    "state_precision_quality": "-m benchmarks.quality_state_precision "
    "--output benchmarks/results/state_precision_quality.json "
    "--plot benchmarks/results/state_precision_quality.png",
    "deepspeed": "-m benchmarks.bench_deepspeed --steps 5 --repeats 3 "
    "--output benchmarks/results/deepspeed.json",
    "activations": "-m benchmarks.bench_activations --repeats 3 --output benchmarks/results/activations.json",
    "checkpoint": "-m benchmarks.bench_checkpoint --repeats 3 --remote-mount /tmp/tierstore-remote/mnt "
    "--output benchmarks/results/checkpoint.json",
    "scale": "-m benchmarks.bench_scale --dir /dev/shm/bench-scale --output benchmarks/results/scale.json",
    "fsdp": "-m benchmarks.bench_fsdp --output benchmarks/results/fsdp.json",
    "beyond_memory": "-m benchmarks.bench_beyond_memory --save-steps 3 "
    "--plot benchmarks/results/beyond_memory.png --output benchmarks/results/beyond_memory.json",
}
"""Each benchmark's command line after ``python`` (the project's, in the repository's root), which
writes its JSON."""
SETUP = {"checkpoint": "RFS_SIZE=12G ../shared/tools/remote-tier.sh start"}
"""What a benchmark's command needs running first (the remote tier it drains to)."""


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    """The JSON of benchmark ``name``."""
    data: dict[str, Any] = json.loads((results / f"{name}.json").read_text())
    return data


def _f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _x(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}x"


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def _range(figure: dict[str, float], digits: int = 2) -> str:
    return f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def provenance(name: str, data: dict[str, Any]) -> str:
    """The line under a table's heading: how to regenerate it, when and where it was measured."""
    meta = data.get("metadata", data)
    date = meta.get("date")
    when = f"measured {date[:10]} at {date[11:16]} UTC" if date else "the JSON records no date"
    host = meta.get("host")
    if host:
        where = f"{host['cpus']} CPUs, Linux {host['kernel']}, torch {host['torch']}"
        if "mount" in meta:
            where += f", data on `{meta['mount']}`"
        when += f" on {where}"
    setup = f"`{SETUP[name]}`, then " if name in SETUP else ""
    return f"{setup}`python {COMMANDS[name]}` ({when}; raw data in `benchmarks/results/{name}.json`).\n\n"


def nvme(data: dict[str, Any]) -> str:
    rows = []
    for result in data["results"]:
        speed, paired = result["median_gbps"], result["paired_ratio"]
        rows.append(
            [
                result["size"],
                _f(speed["tierstore_write"]),
                _f(speed["fio_write"]),
                _x(paired["write"]),
                _f(speed["tierstore_read"]),
                _f(speed["fio_read"]),
                _x(paired["read"]),
            ]
        )
    header = ["size", "tierstore write GB/s", "fio write GB/s", "write ratio", "tierstore read GB/s"]
    header += ["fio read GB/s", "read ratio"]
    return _table(header, rows)


def backends(data: dict[str, Any]) -> str:
    rows = []
    for result in data["results"]:
        for backend, speed in result["median_gbps"].items():
            durable = speed.get("write_durable")
            rows.append(
                [
                    result["size"],
                    backend,
                    _f(speed["write"]),
                    _f(durable) if durable else "",
                    _f(speed["read"]),
                ]
            )
    return _table(["size", "backend", "write GB/s", "durable write GB/s", "read GB/s"], rows)


def virtual_tier(data: dict[str, Any]) -> str:
    emulated, real = data["emulated"], data["summary"]["figures"]
    rows = [
        [
            "3 emulated paths striped, against the sum of the paths alone (round trip)",
            _x(emulated["round_trip_ratio_vs_sum"]),
        ],
        [
            "weighted striping against an equal split of the same paths (write / read)",
            f"{_x(emulated['weighted_speedup']['write'])} / {_x(emulated['weighted_speedup']['read'])}",
        ],
        [
            "objects until a path slowed 4x mid-run is re-weighted",
            str(real["slowdown_recovery_objects"]),
        ],
        [
            "local disk + network file system striped, against their sum alone",
            _x(real["real_aggregate_vs_sum"]),
        ],
    ]
    return _table(["measurement", "figure"], rows)


def optimizer(data: dict[str, Any]) -> str:
    summary = data["summary"]
    rows = [
        [
            "update phase, s/step (median [min-max])",
            _range(summary["tierstore_update_s"]),
            _range(summary["deepspeed_update_s"]),
            _range(summary["device_bound_s"]),
        ],
        [
            "bytes read + written per step",
            _gb(summary["bytes_moved"]["tierstore"]),
            _gb(summary["bytes_moved"]["deepspeed"]),
            _gb(summary["bytes_moved"]["tierstore"]),
        ],
    ]
    table = _table(["", "tierstore", "DeepSpeed", "device bound (fio replay)"], rows)
    ratios = _table(
        ["ratio", "median"],
        [
            ["DeepSpeed's time over tierstore's", _x(summary["speedup_vs_deepspeed"])],
            ["tierstore over its device bound", _x(summary["tierstore_over_device_bound"]["median"], 3)],
            [
                "I/O model's prediction over the measured time",
                _x(summary["predicted_over_measured"]["median"]),
            ],
        ],
    )
    return table + "\n" + ratios


def optimizer_scale(data: dict[str, Any]) -> str:
    rows = []
    for size in data["sizes"]:
        run = size["run"]
        rows.append(
            [
                f"{size['state_bytes'] >> 30} GiB",
                f"{run['kept_in_dram']} / {run['subgroups']}",
                _f(size["update_s"]),
                _gb(size["bytes_moved"]),
                _f(size["s_per_gb"], 3),
                _x(size["over_bound"]),
                _x(size["predicted_over_measured"]),
                _x(size["peak_rss_over_budget_plus_model"], 3),
            ]
        )
    header = ["fp32 state", "kept / sub-groups", "s/step", "moved per step", "s per GB moved"]
    header += ["over its bound", "predicted / measured", "peak RSS / (budget + model)"]
    return _table(header, rows)


def mlp_offload_prediction(data: dict[str, Any]) -> str:
    rows = []
    for row in data["rows"]:
        measured = row.get("measured_update_s")
        rows.append(
            [
                row["model"],
                _f(row["nvme_gb_per_s"]),
                f"{row['moved_gb']:,}",
                _f(row["predicted_update_s"], 1),
                _f(measured, 1) if measured else "not measured",
                _x(row["update_predicted_over_measured"]) if measured else "",
            ]
        )
    header = ["model", "NVMe GB/s", "GB moved per update", "predicted update s", "measured update s"]
    return _table([*header, "predicted / measured"], rows)


def apollo(data: dict[str, Any]) -> str:
    summary = data["summary"]
    sides = ("apollo_mini", "adamw", "deepspeed")  # the columns, in the header's order
    rows = [
        ["update phase, s/step", *(_f(summary[f"{side}_update_s"]) for side in sides)],
        ["bytes moved per step", *(_gb(summary[f"{side}_bytes_moved"]) for side in sides)],
        ["APOLLO-Mini's speed-up", "", _x(summary["speedup_vs_adamw"]), _x(summary["speedup_vs_deepspeed"])],
    ]
    return _table(["", "APOLLO-Mini", "offloaded AdamW", "DeepSpeed"], rows)


def apollo_quality(data: dict[str, Any]) -> str:
    summary = data["summary"]
    rows = [
        [
            "final loss (mean of the last 20 steps)",
            f"{summary['apollo_mini_final_loss']:.4f}",
            f"{summary['adamw_final_loss']:.4f}",
        ],
        ["APOLLO-Mini over AdamW", _x(summary["apollo_mini_over_adamw"], 3), ""],
        ["fp32 state, relative to AdamW's", _x(summary["state_bytes_vs_adamw"], 3), ""],
    ]
    return _table(["", "APOLLO-Mini", "AdamW"], rows)


def state_precision(data: dict[str, Any]) -> str:
    summary, precision = data["summary"], data["metadata"]["state_precision"]
    sides = {
        "deepspeed": "DeepSpeed ZeRO-Infinity",
        "fp32": "tierstore `fp32`",
        "compressed": f"tierstore `{precision}`",
    }
    rows = [
        [label, _range(summary["update_s"][side]), _gb(summary["bytes_moved_per_step"][side])]
        for side, label in sides.items()
    ]
    table = _table(["update step", "s per step", "bytes moved per step"], rows)
    ratios = [
        [
            f"`{precision}` against DeepSpeed",
            _x(summary["speedup_vs_deepspeed"]),
            summary["targets"]["speedup_vs_deepspeed"],
        ],
        ["`fp32` against DeepSpeed", _x(summary["fp32_speedup_vs_deepspeed"]), ""],
        [f"`{precision}` against `fp32`", _x(summary["speedup_vs_fp32"]), ""],
        [
            f"`{precision}` bytes over `fp32`'s",
            _x(summary["bytes_vs_fp32"], 3),
            summary["targets"]["bytes_vs_fp32"],
        ],
    ]
    return table + "\n" + _table(["ratio", "measured", "target"], ratios)


def state_precision_quality(data: dict[str, Any]) -> str:
    summary = data["summary"]
    rows = [
        [
            model,
            "torch `AdamW(fused=True)`" if name == "torch-adamw" else f"tierstore `{name}`",
            f"{run['final_loss']:.4f}",
            _x(run["final_loss_over_torch"], 4),
            f"{run['final_validation_loss']:.4f}",
            _x(run["final_validation_loss_over_torch"], 4),
            "diverged" if run["diverged"] else "yes" if run["within_target"] else "no",
        ]
        for model, runs in summary.items()
        if model != "fine-tuning"
        for name, run in runs.items()
    ]
    header = ["model", "optimizer", "final loss", "over torch's", "validation loss", "over torch's"]
    table = _table([*header, "within target"], rows)
    if "fine-tuning" not in summary:
        return table
    labels = {
        "torch-adamw-bf16": "torch `AdamW(fused=True)` on the bf16 parameters (no master)",
        "fp32": "tierstore `fp32` (fp32 master weights)",
    }
    fine = [
        [
            labels.get(name, f"tierstore `{name}`"),
            f"{run['start_validation_loss']:.4f}",
            f"{run['final_validation_loss']:.4f}",
            "n/a"
            if run["improvement_over_fp32_masters"] is None
            else _x(run["improvement_over_fp32_masters"], 3),
        ]
        for name, run in summary["fine-tuning"].items()
    ]
    header = ["bf16 fine-tuning", "validation loss before", "after", "improvement over fp32 masters'"]
    return table + "\n" + _table(header, fine)


def deepspeed(data: dict[str, Any]) -> str:
    seconds, speedup = data["summary"]["seconds"], data["summary"]["speedup_vs_deepspeed"]
    rows = [
        [
            phase.removesuffix("_s"),
            _range(seconds["deepspeed"][phase]),
            _range(seconds["tierstore"][phase]),
            _x(speedup[phase]),
        ]
        for phase in ("forward_s", "backward_s", "step_s", "iteration_s")
    ]
    return _table(["s per iteration", "DeepSpeed NVMe offload", "tierstore", "speed-up"], rows)


_ACTIVATION_VARIANTS = {
    "keep": "keep in memory",
    "recompute": "full recompute",
    "tierstore-all": 'tierstore `plan="all"`',
    "tierstore-lifetime": 'tierstore `plan="lifetime"`',
}


def activations(data: dict[str, Any]) -> str:
    tables = []
    for allocator, variants in data["summary"].items():
        ratios = data["ratios"][allocator]
        rows = []
        for variant, label in _ACTIVATION_VARIANTS.items():
            figures = variants[variant]
            ratio = ratios.get(variant, {"step_vs_keep": 1.0, "rss_above_baseline_vs_keep": 1.0})
            rows.append(
                [
                    label,
                    _f(figures["step_s"]),
                    _x(ratio["step_vs_keep"]),
                    f"{figures['rss_above_baseline_bytes'] / 1e6:.0f}",
                    _x(ratio["rss_above_baseline_vs_keep"]),
                ]
            )
        settings = data["metadata"]["allocators"][allocator]
        name = ", ".join(f"`{k}={v}`" for k, v in settings.items()) or "glibc's defaults"
        header = [f"variant ({name})", "step s", "vs keep", "peak RSS above baseline, MB", "vs keep"]
        tables.append(_table(header, rows))
    return "\n".join(tables)


_CHECKPOINT_VARIANTS = {
    "filesystem": "DCP `FileSystemWriter`, `dcp.save`",
    "filesystem_async": "DCP `FileSystemWriter`, `dcp.async_save`",
    "tierstore": "tierstore, `dcp.save`",
    "tierstore_async": "tierstore, `dcp.async_save` (budget holds the state)",
    "tierstore_async_budget": "tierstore, `dcp.async_save`, 512 MiB budget",
}


def checkpoint(data: dict[str, Any]) -> str:
    medians = data["medians"]
    rows = [
        [
            label,
            *(
                _f(medians[variant][phase]["median"])
                for phase in ("blocked_s", "commit_s", "durable_s", "load_s")
            ),
        ]
        for variant, label in _CHECKPOINT_VARIANTS.items()
    ]
    table = _table(
        ["seconds (median)", "training blocked", "committed (first tier)", "durable", "load"], rows
    )
    ratio = data["ratios"]["commit_vs_fio_write"]["median"]
    blocked = data["ratios"]["async_blocked_vs_copy"]["median"]
    return (
        table + f"\nThe first tier's commit takes {_x(ratio)} the time fio takes to write the same bytes; "
        f"`dcp.async_save` blocks training {_x(blocked)} the time a plain copy of the state into "
        "memory takes, timed beside it.\n"
    )


def fsdp(data: dict[str, Any]) -> str:
    summary = data["summary"]
    memory, seconds, ratio = (
        summary["memory_bytes_per_rank"],
        summary["seconds"],
        summary["tierstore_over_torch"],
    )
    checkpoint = summary["checkpoint_seconds"]

    def mb(value: float) -> str:
        return f"{value / 1e6:.1f} MB"

    rows = [
        [
            "RSS the optimizer adds",
            mb(memory["torch"]["optimizer_rss_added_bytes"]),
            mb(memory["tierstore"]["optimizer_rss_added_bytes"]),
            _x(ratio["optimizer_rss_added"]),
        ],
        [
            "peak RSS of the process",
            mb(memory["torch"]["peak_rss_bytes"]),
            mb(memory["tierstore"]["peak_rss_bytes"]),
            _x(ratio["peak_rss"]),
        ],
        [
            "optimizer step, s",
            _f(seconds["torch"]["step_s"]["median"], 3),
            _f(seconds["tierstore"]["step_s"]["median"], 3),
            _x(ratio["step_s"]),
        ],
        [
            "DCP save of model and optimizer, s",
            _f(checkpoint["torch"]["dcp_save_s"]["median"]),
            _f(checkpoint["tierstore"]["dcp_save_s"]["median"]),
            _x(ratio["dcp_save_s"]),
        ],
        [
            "DCP load of model and optimizer, s",
            _f(checkpoint["torch"]["dcp_load_s"]["median"]),
            _f(checkpoint["tierstore"]["dcp_load_s"]["median"]),
            _x(ratio["dcp_load_s"]),
        ],
        [
            "RSS a DCP save adds",
            mb(memory["torch"]["dcp_save_rss_added_bytes"]),
            mb(memory["tierstore"]["dcp_save_rss_added_bytes"]),
            "",
        ],
    ]
    table = _table(
        ["per rank", "FSDP2 + torch AdamW (state in RAM)", "FSDP2 + tierstore", "tierstore / torch"], rows
    )
    budget = data["metadata"]["dram_budget_bytes"]
    return table + (
        f"\nThe optimizer's RSS is {_x(summary['optimizer_rss_added_over_budget'])} its DRAM budget of "
        f"{mb(budget)}; its step takes {_x(summary['tierstore_step_over_device_busy'])} the time the "
        "store's disk was busy during it.\n"
    )


def scale(data: dict[str, Any]) -> str:
    phases = ("put", "flush", "close", "reopen", "get", "delete")
    rows = [
        [f"{case['objects']:,}", f"{case['object_bytes']} B"]
        + [f"{case['objects_per_s'][phase]:,}" for phase in phases]
        + [f"{case['peak_rss_bytes'] / 1e9:.2f} GB"]
        for case in data["cases"]
    ]
    return _table(["objects", "size", *(f"{phase} obj/s" for phase in phases), "peak RSS"], rows)


def beyond_memory(data: dict[str, Any]) -> str:
    peer, ours = data["summary"]["zero-infinity"], data["summary"]["tierstore"]
    resume = data["resume"]

    def both(key: str, digits: int = 2) -> list[str]:
        return [_f(peer[key], digits), _f(ours[key], digits), _x(peer[key] / ours[key])]

    rows = [
        ["iteration, s", *both("iteration_s")],
        ["optimizer step, s", *both("step_s")],
        ["bytes read per step", _gb(peer["read_bytes"]), _gb(ours["read_bytes"]), ""],
        ["save: training blocked, s", *both("save_blocked_s")],
        [
            "resume in a new process, s",
            _f(resume["zero-infinity"]["resume_s"], 1),
            _f(resume["tierstore"]["resume_s"], 1),
            _x(resume["zero-infinity"]["resume_s"] / resume["tierstore"]["resume_s"]),
        ],
        ["peak RSS", _gb(peer["peak_rss_bytes"]), _gb(ours["peak_rss_bytes"]), ""],
    ]
    return _table(
        ["", "ZeRO-Infinity (DeepSpeed's NVMe offload)", "tierstore", "ZeRO-Infinity / tierstore"], rows
    )


def headline(results: Path = RESULTS) -> str:
    """The README's table: one line per workload, tierstore beside its peer in the same run."""
    opt, ds, ckpt = load("optimizer", results), load("deepspeed", results), load("checkpoint", results)
    bm, act = load("beyond_memory", results), load("activations", results)
    rows = [
        [
            f"optimizer update phase, {opt['metadata']['state_bytes'] >> 30} GiB of fp32 state, "
            f"{opt['metadata']['dram_budget_bytes'] >> 30} GiB DRAM (s/step)",
            _f(opt["summary"]["tierstore_update_s"]["median"]),
            f"DeepSpeed {_f(opt['summary']['deepspeed_update_s']['median'])}",
            _x(opt["summary"]["speedup_vs_deepspeed"]),
        ],
        [
            f"DeepSpeed ZeRO-3 training iteration, {ds['metadata']['parameters'] / 1e6:.0f}M parameters (s)",
            _f(ds["summary"]["seconds"]["tierstore"]["iteration_s"]["median"]),
            f"DeepSpeed NVMe offload {_f(ds['summary']['seconds']['deepspeed']['iteration_s']['median'])}",
            _x(ds["summary"]["speedup_vs_deepspeed"]["iteration_s"]),
        ],
        [
            f"{bm['metadata']['parameters'] / 1e9:.2f}B-parameter Llama beyond memory, Trainer iteration (s)",
            _f(bm["summary"]["tierstore"]["iteration_s"]),
            f"ZeRO-Infinity {_f(bm['summary']['zero-infinity']['iteration_s'])}",
            _x(bm["summary"]["zero-infinity"]["iteration_s"] / bm["summary"]["tierstore"]["iteration_s"]),
        ],
        [
            f"DCP checkpoint of {_gb(ckpt['metadata']['state_bytes'])}, training blocked by `async_save` (s)",
            _f(ckpt["medians"]["tierstore_async"]["blocked_s"]["median"]),
            f"`FileSystemWriter` {_f(ckpt['medians']['filesystem_async']['blocked_s']['median'])}",
            _x(
                ckpt["medians"]["filesystem_async"]["blocked_s"]["median"]
                / ckpt["medians"]["tierstore_async"]["blocked_s"]["median"]
            ),
        ],
        [
            "activation offload, step time (s) against full recompute",
            _f(act["summary"]["default"]["tierstore-lifetime"]["step_s"]),
            f"recompute {_f(act['summary']['default']['recompute']['step_s'])}",
            _x(
                act["summary"]["default"]["recompute"]["step_s"]
                / act["summary"]["default"]["tierstore-lifetime"]["step_s"]
            ),
        ],
    ]
    return _table(["workload", "tierstore", "baseline, same run", "speed-up"], rows)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "nvme": nvme,
    "backends": backends,
    "virtual_tier": virtual_tier,
    "optimizer": optimizer,
    "optimizer_scale": optimizer_scale,
    "mlp_offload_prediction": mlp_offload_prediction,
    "apollo": apollo,
    "apollo_quality": apollo_quality,
    "state_precision": state_precision,
    "state_precision_quality": state_precision_quality,
    "deepspeed": deepspeed,
    "activations": activations,
    "checkpoint": checkpoint,
    "scale": scale,
    "fsdp": fsdp,
    "beyond_memory": beyond_memory,
}


def render(name: str, results: Path = RESULTS) -> str:
    """The block for marker ``name``: a benchmark's provenance and tables, or the headline table."""
    if name == "headline":
        return headline(results)
    data = load(name, results)
    return provenance(name, data) + RENDERERS[name](data)


MARKER = re.compile(
    r"<!-- figures: (?P<name>[a-z_]+) -->\n(?P<body>.*?)<!-- /figures: (?P=name) -->", re.DOTALL
)


def update(text: str, results: Path = RESULTS) -> str:
    """``text`` with every figures block rewritten from its JSON."""

    def rewrite(found: re.Match[str]) -> str:
        name = found["name"]
        return f"<!-- figures: {name} -->\n{render(name, results)}<!-- /figures: {name} -->"

    return MARKER.sub(rewrite, text)


def blocks(text: str) -> list[str]:
    """The names of the figures blocks in ``text``, in order."""
    return [found["name"] for found in MARKER.finditer(text)]


def outside_blocks(text: str) -> str:
    """``text`` without its figures blocks: the prose, which must quote no figure."""
    return MARKER.sub("", text)


def main(arguments: list[str]) -> int:
    """``python -m benchmarks.figures FILE...``: rewrite each file's figures blocks."""
    for argument in arguments:
        path = Path(argument)
        path.write_text(update(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
