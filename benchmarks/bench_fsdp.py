"""FSDP2 training on 2 ranks: torch.optim.AdamW with its state in RAM against tierstore's
FSDPOffloadedAdamW with the state on disk (an NVMe tier per rank under --dir).

Both sides train the same GPT (``tierstore.app.demo.GPT``, no dropout) sharded with ``fully_shard`` over
2 gloo ranks (2 processes each), on the same batches, fp32 parameters (the optimizer state is the
Adam moments: 8 bytes per parameter; ``--setup bf16`` gives bf16 parameters, whose fp32 masters
tierstore keeps in the store too). The sides alternate (A B, B A, ...) ``--repeats`` times. Each rank
reports its peak RSS (the kernel's VmHWM) and the RSS the optimizer's state adds (the peak while the
optimizer is built and during its steps, minus the RSS before it was built, the gradients already
allocated), the step time split (forward + backward, optimizer step; for tierstore also the time
its step spent computing rather than waiting on the store), the bytes its store moved, and the DCP
save and load time of a checkpoint (model + optimizer state; tierstore's streamed through
:func:`tierstore.integrations.fsdp.save` and ``load``, torch's through ``get_state_dict`` +
``dcp.save`` / ``dcp.load`` + ``set_state_dict``) with the peak RSS each adds. Figures are medians
over steady-state steps (every step after the first) and repeats, tierstore's beside torch's as
ratios.

    python -m benchmarks.bench_fsdp --output benchmarks/results/fsdp.json                  # full size
    python -m benchmarks.bench_fsdp --width 512 --layers 4 --steps 4 --repeats 1 --output ... # short
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import ROOT, log, metadata, model_shape, module_command, positive_int, run_benchmark, spread

SIDES = ("torch", "tierstore")


# -- one rank ---------------------------------------------------------------------------------------
def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


HIGHEST_KIB = [0]
"""The process's peak RSS over its whole life: VmHWM is recorded here before each reset."""


def trim() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``): the unsharded
    model each rank built before ``fully_shard``, freed since, would otherwise be reused unseen by
    the RSS (torch's optimizer state would fit in it)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak() -> None:
    """Start the kernel's peak-RSS count (VmHWM) again from the current RSS."""
    HIGHEST_KIB[0] = max(HIGHEST_KIB[0], memory_kib("VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")


def rank_main(run: dict[str, Any]) -> None:
    """One rank of one side's run (``--rank-worker``): rank 0 writes the rows to ``run["output"]``."""
    import torch
    import torch.distributed as dist
    from tierstore.backends import open_backend
    from tierstore.integrations import fsdp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.fsdp import fully_shard

    from tierstore import Tier, TierStore
    from tierstore.app.demo import GPT, batch_of, byte_corpus

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(
        vocab=256,
        width=run["width"],
        layers=run["layers"],
        heads=max(1, run["width"] // 64),
        length=run["length"],
        dropout=0.0,
    )
    if run["setup"] == "bf16":
        model = model.to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    parameters = sum(p.numel() for p in model.parameters())
    corpus = byte_corpus()

    def forward_backward(step: int) -> float:
        tokens, targets = batch_of(corpus, step, run["batch"], run["length"])
        tokens, targets = tokens.chunk(world)[rank], targets.chunk(world)[rank]
        started = time.perf_counter()
        model(tokens, targets).backward()
        return time.perf_counter() - started

    first = forward_backward(0)  # the gradients exist before the optimizer does
    trim()
    baseline = memory_kib("VmRSS")
    reset_peak()
    store = None
    if run["side"] == "tierstore":
        directory = Path(run["dir"]) / f"rank{rank}"
        store = TierStore([Tier("state", open_backend(f"nvme://{directory}"))], cache_budget=0)
        optimizer: torch.optim.Optimizer = fsdp.FSDPOffloadedAdamW(
            model, store, lr=1e-4, sub_group_size=run["sub_group_size"], dram_budget=run["dram_budget"]
        )
        state_bytes = sum(4 * optimizer.state_numel(sg) for sg in optimizer.subgroups)  # type: ignore[attr-defined]
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        state_bytes = 8 * sum(fsdp.local_shard(p).numel() for p in model.parameters())
    built = memory_kib("VmRSS")
    highest = memory_kib("VmHWM")  # the process's peak with the optimizer in it, building included
    rows = []
    step_peaks = []
    for step in range(run["steps"]):
        seconds = first if step == 0 else forward_backward(step)
        moved, busy = _moved(store), _busy(store)
        trim()
        before = memory_kib("VmRSS")
        reset_peak()
        started = time.perf_counter()
        optimizer.step()
        done = time.perf_counter()
        step_peaks.append(memory_kib("VmHWM") - before)
        highest = max(highest, memory_kib("VmHWM"))
        optimizer.zero_grad(set_to_none=True)
        row = {
            "step": step + 1,
            "forward_backward_s": seconds,
            "step_s": done - started,
            "bytes_moved": _moved(store) - moved,
        }
        if store is not None:
            row["step_compute_s"] = optimizer.compute_seconds  # type: ignore[attr-defined]
            row["step_device_busy_s"] = _busy(store) - busy
        rows.append(row)
    figures: dict[str, Any] = {
        "parameters": parameters,
        "optimizer_state_bytes_per_rank": state_bytes,
        "rss_before_optimizer_bytes": 1024 * baseline,
        # what building the optimizer made resident (its staging buffers; nothing for torch's)
        "optimizer_built_rss_added_bytes": 1024 * (built - baseline),
        # the most a step raised the RSS above what the process had right before it (torch's first
        # step allocates its whole state); a step can raise it by what the step before gave back
        "optimizer_step_rss_added_bytes": 1024 * max(step_peaks),
        "each_step_rss_added_bytes": [1024 * peak for peak in step_peaks],
        # the optimizer's memory at its peak: the process's highest RSS while building it and
        # during every step, above the RSS before it existed (the gradients already allocated,
        # and the C heap trimmed at both ends, so what forward and backward freed is not counted)
        "optimizer_rss_added_bytes": 1024 * (highest - baseline),
    }
    checkpoint = Path(run["dir"]) / "checkpoint"

    def measured(name: str, action: Callable[[], None]) -> None:
        """``action``'s seconds until every rank is done, and the memory it adds to this rank's
        RSS at its peak, into ``figures``."""
        before = memory_kib("VmRSS")
        reset_peak()
        started = time.perf_counter()
        action()
        dist.barrier()
        figures[f"{name}_s"] = time.perf_counter() - started
        figures[f"{name}_rss_added_bytes"] = 1024 * (memory_kib("VmHWM") - before)

    def torch_state() -> dict[str, Any]:
        """What DCP saves and loads on torch's side: the model's and the optimizer's state dicts."""
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save() -> None:
        if store is not None:
            fsdp.save(checkpoint, model, optimizer)  # type: ignore[arg-type]
        else:
            dcp_save(torch_state(), checkpoint_id=checkpoint)

    def load() -> None:
        if store is not None:
            fsdp.load(checkpoint, model, optimizer)  # type: ignore[arg-type]
        else:
            state = torch_state()
            dcp_load(state, checkpoint_id=checkpoint)
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )

    dist.barrier()
    trim()
    measured("dcp_save", save)
    measured("dcp_load", load)
    figures["peak_rss_bytes"] = 1024 * max(HIGHEST_KIB[0], memory_kib("VmHWM"))
    if store is not None:
        optimizer.close()  # type: ignore[attr-defined]
        store.close()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, **figures})
    if rank == 0:
        Path(run["output"]).write_text(json.dumps({"rows": rows, "ranks": gathered}))
    dist.barrier()
    dist.destroy_process_group()


def _busy(store: Any) -> float:
    """Seconds the store's tier had a request in flight (its paths' busy time), so far."""
    if store is None:
        return 0.0
    paths = store.stats()["tiers"]["state"]["paths"]
    return float(sum(path["busy_seconds"] for path in paths.values()))


def _moved(store: Any) -> int:
    if store is None:
        return 0
    tier = store.stats()["tiers"]["state"]
    return int(tier["bytes_read"] + tier["bytes_written"])


# -- the benchmark ----------------------------------------------------------------------------------
def train(side: str, args: argparse.Namespace, directory: Path, repeat: int) -> dict[str, Any]:
    """One side's 2-rank run; its rows (rank 0's) and every rank's figures."""
    run_dir = directory / f"{side}-{repeat}"
    run_dir.mkdir()
    output = run_dir / "result.json"
    document = {
        "side": side,
        "dir": str(run_dir),
        "output": str(output),
        **{k: getattr(args, k) for k in ("width", "layers", "length", "batch", "steps", "setup")},
        "sub_group_size": args.sub_group_size,
        "dram_budget": args.dram_budget,
    }
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = []
    try:
        for rank in range(args.ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(args.ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.ranks)),
            }
            command = [*module_command("bench_fsdp"), "--rank-worker", json.dumps(document)]
            processes.append(
                subprocess.Popen(
                    command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
                )
            )
        logs = [process.communicate()[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, text in zip(processes, logs, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"{side} run failed:\n{text[-3000:]}")
    result: dict[str, Any] = json.loads(output.read_text())
    for row in result["rows"]:
        log(
            f"  {side} step {row['step']}: forward+backward {row['forward_backward_s']:.2f} s, "
            f"optimizer {row['step_s']:.3f} s"
        )
    return result


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
            log(f"{side}, repeat {repeat + 1}/{args.repeats} ...")
            runs[side].append(train(side, args, directory, repeat))

    def steady(side: str, key: str) -> list[float]:
        return [statistics.median(row[key] for row in result["rows"][1:]) for result in runs[side]]

    def per_rank(side: str, key: str) -> list[float]:
        return [max(rank[key] for rank in result["ranks"]) for result in runs[side]]

    seconds = {
        side: {key: spread(steady(side, key)) for key in ("forward_backward_s", "step_s")} for side in SIDES
    }
    for key in ("step_compute_s", "step_device_busy_s"):
        seconds["tierstore"][key] = spread(steady("tierstore", key))
    ours = runs["tierstore"][0]["ranks"]
    state = max(rank["optimizer_state_bytes_per_rank"] for rank in ours)
    memory = {
        side: {
            key: statistics.median(per_rank(side, key))
            for key in (
                "peak_rss_bytes",
                "optimizer_built_rss_added_bytes",
                "optimizer_step_rss_added_bytes",
                "optimizer_rss_added_bytes",
                "dcp_save_rss_added_bytes",
                "dcp_load_rss_added_bytes",
            )
        }
        for side in SIDES
    }
    checkpoint = {
        side: {key: spread(per_rank(side, key)) for key in ("dcp_save_s", "dcp_load_s")} for side in SIDES
    }
    moved = statistics.median(steady("tierstore", "bytes_moved"))

    def over(first: float, second: float) -> float:
        return round(first / max(second, 1e-12), 3)

    ratio = {
        "step_s": over(seconds["tierstore"]["step_s"]["median"], seconds["torch"]["step_s"]["median"]),
        "peak_rss": over(memory["tierstore"]["peak_rss_bytes"], memory["torch"]["peak_rss_bytes"]),
        "optimizer_rss_added": over(
            memory["tierstore"]["optimizer_rss_added_bytes"], memory["torch"]["optimizer_rss_added_bytes"]
        ),
        **{
            key: over(checkpoint["tierstore"][key]["median"], checkpoint["torch"][key]["median"])
            for key in ("dcp_save_s", "dcp_load_s")
        },
    }
    return {
        "benchmark": "fsdp2_training",
        "metadata": {
            **metadata(
                directory,
                parameters=runs["torch"][0]["ranks"][0]["parameters"],
                ranks=args.ranks,
                setup=args.setup,
                **model_shape(args),
                sub_group_size=args.sub_group_size,
                dram_budget_bytes=args.dram_budget,
                tierstore_state_bytes_per_rank=state,
                steps=args.steps,
                repeats=args.repeats,
            ),
            "elapsed_s": round(time.perf_counter() - started, 1),
        },
        "runs": runs,
        "summary": {
            "seconds": seconds,
            "memory_bytes_per_rank": memory,
            "checkpoint_seconds": checkpoint,
            "tierstore_bytes_moved_per_step_per_rank": moved,
            "tierstore_step_gb_per_s": round(moved / seconds["tierstore"]["step_s"]["median"] / 1e9, 3),
            "tierstore_over_torch": ratio,
            # the step against the time the store's device was busy during it (the I/O the state
            # requires, at the rate this device gave it): near 1 is I/O-bound with nothing else
            # in the way
            "tierstore_step_over_device_busy": round(
                seconds["tierstore"]["step_s"]["median"]
                / seconds["tierstore"]["step_device_busy_s"]["median"],
                3,
            ),
            "optimizer_rss_added_over_budget": round(
                memory["tierstore"]["optimizer_rss_added_bytes"] / args.dram_budget, 3
            ),
            "targets": {
                "optimizer_rss_added_over_budget": "<= 1.1",
                "dcp_save_rss_added": "<= one sub-group of state beyond the budget",
            },
        },
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_main(json.loads(sys.argv[2]))
        os._exit(0)  # gloo's threads can abort a normal interpreter exit
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk under test")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--ranks", type=positive_int, default=2)
    parser.add_argument("--setup", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--layers", type=positive_int, default=12)
    parser.add_argument("--width", type=positive_int, default=1536, help="~340M parameters at 12 layers")
    parser.add_argument("--length", type=positive_int, default=32)
    parser.add_argument("--batch", type=positive_int, default=2, help="global batch (split over the ranks)")
    parser.add_argument("--sub-group-size", type=positive_int, default=8_000_000, help="local elements")
    parser.add_argument("--dram-budget", type=positive_int, default=256 << 20, help="bytes per rank")
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--repeats", type=positive_int, default=2)
    args = parser.parse_args()
    return run_benchmark(run, args, "bench-fsdp-", needs_fio=False)


if __name__ == "__main__":
    raise SystemExit(main())
