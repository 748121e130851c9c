"""The ``tierstore`` command line.

``tierstore demo`` spills a set of tensors several times larger than the DRAM budget through the
store (embedded default config: DRAM cache over an NVMe tier in ./tierstore-data), reads every one
back, verifies it bit for bit and prints the throughput of each phase.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .config import default_config, load_config, parse_byte_size
from .errors import ConfigError, TierStoreError
from .store import TierStore


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def demo_tensor(base: torch.Tensor, index: int) -> torch.Tensor:
    """Object ``index``: random int32 words plus ``index``, viewed as fp32 or bf16 alternately.

    Cheap to regenerate for verification, and any misplaced block or object changes its value.
    """
    return base.add(index).view(torch.float32 if index % 2 == 0 else torch.bfloat16)


def run_demo(config: dict[str, Any], total: int, object_bytes: int) -> dict[str, Any]:
    """Put ``total`` bytes in objects of ``object_bytes``, flush, read back, verify; return figures."""
    count = max(1, total // object_bytes)
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
        verified=not mismatches,
        mismatched_objects=mismatches,
        stats=stats,
    )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="spill tensors larger than the DRAM budget and read them back")
    where = demo.add_mutually_exclusive_group()
    where.add_argument("--config", type=Path, help="store config (.toml/.json); default: the embedded one")
    where.add_argument("--dir", type=Path, help="directory of the default config's NVMe tier")
    demo.add_argument("--total", type=_byte_size, default=_byte_size("1GiB"), help="bytes to spill (1GiB)")
    demo.add_argument("--object", type=_byte_size, default=_byte_size("32MiB"), help="object size (32MiB)")
    args = parser.parse_args(argv)

    config = default_config() if args.config is None else load_config(args.config).model_dump()
    if args.dir is not None:
        config["tiers"][0]["backend"]["path"] = str(args.dir)
    try:
        report = run_demo(config, args.total, args.object)
    except TierStoreError as error:
        print(f"tierstore demo: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    print(
        f"spilled {report['total_bytes'] / 2**30:.2f} GiB ({report['objects']} objects, "
        f"{report['total_bytes'] / report['cache_budget_bytes']:.1f}x the DRAM budget): "
        f"put+flush {report['put_and_flush_gb_per_s']} GB/s, get+verify "
        f"{report['get_and_verify_gb_per_s']} GB/s, verified={report['verified']}"
    )
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
