"""A matmul loop on the GPU's compute stream keeps its speed while tensors move through a TierStore
between the GPU and a DRAM tier: the store's copies overlap the compute.

Three variants alternate within each repeat (their order rotates from repeat to repeat):

* ``compute``: bf16 matmuls on the compute stream alone, for ``--seconds``;
* ``traffic``: ``--bytes`` moving through the store alone: objects of ``--object`` bytes put from
  GPU memory (half of the bytes), then read back into GPU memory (the other half), from a thread
  whose current stream is a side stream, as a training job's offload thread does;
* ``both``: the matmul loop while the traffic runs, timed over the traffic's span.

The matmul rate is measured with CUDA events around the kernels (at most two batches queued ahead,
so that the span timed is the traffic's), the traffic's rate as bytes moved over wall time. The
headline is ``compute_kept``: the matmul rate with the traffic over the rate alone (target
>= 0.90). The bytes read back are checked against the bytes put.

    python -m benchmarks.bench_gpu_store --output benchmarks/results/gpu/gpu_store.json
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tierstore.backends import open_backend

from tierstore import Tier, TierStore

from .common import cuda_run, log, metadata, parse_size, positive_int, run_benchmark, spread

VARIANTS = ("compute", "traffic", "both")
TARGET = 0.90
IN_FLIGHT = 4
"""Puts (or gets) in flight at once, each with device memory of its own."""
BATCH = 8
"""Matmuls launched between two checks of the clock."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where an nvme tier keeps its files")
    parser.add_argument("--tier", choices=("dram", "nvme"), default="dram", help="the store's tier")
    parser.add_argument("--bytes", type=parse_size, default=parse_size("4GiB"), help="moved per traffic run")
    parser.add_argument("--object", type=parse_size, default=parse_size("64MiB"), help="bytes of one object")
    parser.add_argument("--cache", type=parse_size, default=parse_size("1GiB"), help="the store's cache")
    parser.add_argument("--matrix", type=positive_int, default=8192, help="side of the square bf16 matrices")
    parser.add_argument("--seconds", type=float, default=2.0, help="how long the matmul loop runs alone")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


class MatmulLoop:
    """``c = a @ b`` on the current (compute) stream, timed by CUDA events."""

    def __init__(self, side: int) -> None:
        self.a = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.flops = 2 * side**3

    def run(self, keep_going: Any) -> float:
        """Launch matmuls while ``keep_going()``; their rate in TFLOP/s."""
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        queued: collections.deque[torch.cuda.Event] = collections.deque()
        count = 0
        start.record()
        while keep_going():
            for _ in range(BATCH):
                torch.matmul(self.a, self.b, out=self.c)
            count += BATCH
            batch_end = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            batch_end.record()
            queued.append(batch_end)
            if len(queued) > 2:  # never more than two batches ahead of the GPU
                queued.popleft().synchronize()
        end.record()
        end.synchronize()
        return count * self.flops / (start.elapsed_time(end) / 1e3) / 1e12


class Traffic:
    """Objects put from GPU memory into the store and read back into GPU memory, from a thread
    whose current stream is a side stream."""

    def __init__(self, store: TierStore, total: int, object_bytes: int) -> None:
        self.store = store
        self.count = max(1, total // 2 // object_bytes)
        numel = object_bytes // 2
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.sources = [
            torch.randn(numel, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(IN_FLIGHT)
        ]
        self.outs = [torch.empty(numel, device="cuda", dtype=torch.bfloat16) for _ in range(IN_FLIGHT)]
        self.moved = 2 * self.count * object_bytes
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def run(self) -> float:
        """Move the bytes (blocking); seconds taken."""
        started = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self._windowed(lambda index: self.store.put(f"o{index}", self.sources[index % IN_FLIGHT]))
            self._windowed(lambda index: self.store.get(f"o{index}", out=self.outs[index % IN_FLIGHT]))
            self.stream.synchronize()
        return time.perf_counter() - started

    def _windowed(self, start: Any) -> None:
        """``start(index)`` for every object, at most :data:`IN_FLIGHT` at once (each one's device
        memory is free again once its future has resolved)."""
        in_flight: collections.deque[Any] = collections.deque()
        for index in range(self.count):
            if len(in_flight) == IN_FLIGHT:
                in_flight.popleft().result()
            in_flight.append(start(index))
        for future in in_flight:
            future.result()

    def check(self) -> None:
        """The bytes read back are the bytes put."""
        for index in range(min(self.count, IN_FLIGHT)):
            got = self.store.get(f"o{index}", device="cuda").result()
            if not torch.equal(got, self.sources[index % IN_FLIGHT]):
                raise AssertionError(f"object o{index} read back differs from what was put")


def one_repeat(loop: MatmulLoop, traffic: Traffic, seconds: float, order: list[str]) -> dict[str, float]:
    """Each variant once, in ``order``: the matmul rate (TFLOP/s) and the traffic's (GB/s)."""
    figures: dict[str, float] = {}
    for variant in order:
        torch.cuda.synchronize()
        if variant == "compute":
            deadline = time.perf_counter() + seconds
            figures["compute_tflops"] = loop.run(lambda until=deadline: time.perf_counter() < until)
        elif variant == "traffic":
            figures["traffic_gb_s"] = traffic.moved / traffic.run() / 1e9
        else:
            span: dict[str, float] = {}
            thread = threading.Thread(target=lambda into=span: into.setdefault("s", traffic.run()))
            thread.start()
            figures["both_tflops"] = loop.run(thread.is_alive)
            thread.join()
            figures["both_traffic_gb_s"] = traffic.moved / span["s"] / 1e9
        log(f"  {variant}: {figures}")
    figures["compute_kept"] = figures["both_tflops"] / figures["compute_tflops"]
    return figures


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_store needs a CUDA device (torch.cuda.is_available() is False)")
    url = "dram://" if args.tier == "dram" else f"nvme://{directory / 'nvme'}"
    repeats: list[dict[str, float]] = []
    with TierStore([Tier(args.tier, open_backend(url))], cache_budget=args.cache) as store:
        loop = MatmulLoop(args.matrix)
        traffic = Traffic(store, args.bytes, args.object)
        loop.run(iter([True, True, False]).__next__)  # warm up: cuBLAS's choice, the store's pieces
        traffic.run()
        traffic.check()
        for repeat in range(args.repeats):
            order = list(VARIANTS[repeat % 3 :] + VARIANTS[: repeat % 3])
            log(f"repeat {repeat + 1}/{args.repeats}: {', '.join(order)}")
            repeats.append(one_repeat(loop, traffic, args.seconds, order))
        traffic.check()
        stats = store.stats()

    def median_of(name: str) -> dict[str, float]:
        return spread([figures[name] for figures in repeats])

    kept = median_of("compute_kept")
    return {
        **metadata(
            directory,
            benchmark="gpu_store",
            **cuda_run(),
            config={
                "tier": args.tier,
                "bytes": args.bytes,
                "object_bytes": args.object,
                "objects_each_way": traffic.count,
                "cache_bytes": args.cache,
                "matrix": args.matrix,
                "matmul_seconds_alone": args.seconds,
                "repeats": args.repeats,
            },
        ),
        "summary": {
            "compute_kept": kept["median"],
            "target": TARGET,
            "met": kept["median"] >= TARGET,
            "matmul_tflops_alone": median_of("compute_tflops")["median"],
            "matmul_tflops_with_traffic": median_of("both_tflops")["median"],
            "traffic_gb_s_alone": median_of("traffic_gb_s")["median"],
            "traffic_gb_s_with_matmuls": median_of("both_traffic_gb_s")["median"],
        },
        "spread": {name: median_of(name) for name in repeats[0]},
        "repeats": [{name: round(value, 3) for name, value in figures.items()} for figures in repeats],
        "store": {
            "memory": stats["memory"],
            "writebacks": stats["writebacks"],
            "evictions": stats["evictions"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_benchmark(run, args, "bench-gpu-store-", needs_fio=False)


if __name__ == "__main__":
    raise SystemExit(main())
