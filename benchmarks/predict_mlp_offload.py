"""The I/O model against the MLP-Offload paper's own measurements (no I/O; a prediction, not a run).

MLP-Offload's artifact (SC'25; ``../shared/reference/mlp-offload.md``) reports the update phase and
the iteration of GPT models of 40B-120B parameters on one node (4 GPUs, node-local NVMe and a VAST
parallel file system), for DeepSpeed ZeRO-3 with NVMe offload (the baseline) and for MLP-Offload.
This script predicts MLP-Offload's update phase at each size with :mod:`tierstore.pass_plan` and sets
it beside the measured one.

What the model is given, per size, and where it comes from (the paper's text, with its stated
bandwidths, is not in our reference material, so the bandwidths are the ones its own baseline
measured):

* **NVMe bandwidth**: what the baseline's update moved over its single NVMe path divided by its
  update time (per parameter: fp32 master weights, two moments and the fp32 gradient read, the
  first three written back: 28 bytes);
* **placement**: MLP-Offload's static ratio, one sub-group in three on the parallel file system
  (``dist_opt_ratio=3``), whole sub-groups per path; the artifact's logs show the NVMe path setting
  the pace (its waits about 470 s, the file system's about 25 s at 70B), so the file system's
  bandwidth, which the material does not give, does not enter the prediction;
* **host cache**: the DRAM the 70B run kept (16 of its 82 sub-groups per rank, 164 GB per node),
  the same at every size: those sub-groups skip their write and their next read;
* **compute**: the 70B run's CPU Adam time (3.2 s per update), scaled with the parameters.

The prediction is :func:`tierstore.pass_plan.transfer_seconds` over the two paths with MLP-Offload's
static weights, or the compute where that is longer; the iteration adds the measured forward and
backward. At 280B the artifact has no measurement (the abstract gives only a 2.5x speed-up), so
that row is predicted from the median of the other sizes' NVMe bandwidths, with nothing to compare.

    .venv/bin/python -m benchmarks.predict_mlp_offload --output benchmarks/results/mlp_offload_prediction.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from tierstore.bandwidth import PathSpeed
from tierstore.pass_plan import transfer_seconds

GB = 1e9
STATE_BYTES = 12
"""fp32 master weights and Adam's two moments, per parameter."""
BASELINE_UPDATE_BYTES = 28
"""What DeepSpeed's update moves per parameter: reads those three and the fp32 gradient (16),
writes the three back (12)."""
PFS_SHARE = 1 / 3
"""``dist_opt_ratio=3``: every third sub-group on the parallel file system."""
CACHED_BYTES = 16 / 82 * STATE_BYTES * 70e9
"""Host DRAM holding sub-groups across steps: 16 of 82 per rank at 70B."""
COMPUTE_SECONDS_PER_PARAM = 3.19 / 70e9
"""The 70B run's CPU Adam time per update (per rank, ranks in parallel)."""

MEASURED: dict[str, dict[str, float]] = {
    # Milliseconds, from the artifact's evaluation table: iteration, backward, update.
    "40B": {"params": 40e9, "base_iter": 242_281, "mlp_iter": 101_717, "base_bwd": 27_473, "mlp_bwd": 2_044,
            "base_update": 213_610, "mlp_update": 98_507},
    "52B": {"params": 52e9, "base_iter": 238_598, "mlp_iter": 92_173, "base_bwd": 28_293, "mlp_bwd": 1_833,
            "base_update": 209_336, "mlp_update": 89_407},
    "70B": {"params": 70e9, "base_iter": 370_562, "mlp_iter": 151_338, "base_bwd": 32_905, "mlp_bwd": 2_946,
            "base_update": 336_427, "mlp_update": 147_184},
    "100B": {"params": 100e9, "base_iter": 572_027, "mlp_iter": 275_529, "base_bwd": 68_341, "mlp_bwd": 4_563,
             "base_update": 501_916, "mlp_update": 269_246},
    "120B": {"params": 120e9, "base_iter": 550_361, "mlp_iter": 288_179, "base_bwd": 73_195, "mlp_bwd": 4_201,
             "base_update": 475_480, "mlp_update": 282_331},
}  # fmt: skip
HEADLINE = {"280B": {"params": 280e9, "speedup": 2.5}}
"""The abstract's only figure at 280B: MLP-Offload's iteration 2.5x faster than the baseline's."""


def predicted_update(params: float, nvme: float) -> dict[str, float]:
    """MLP-Offload's update phase: the bytes its placement puts on the NVMe path (the path that sets
    the pace), or its compute where that is longer."""
    moved = max(0.0, STATE_BYTES * params - CACHED_BYTES)  # read, and as much written
    on_nvme = moved * (1 - PFS_SHARE)
    io = transfer_seconds([PathSpeed("nvme", nvme, nvme)], [1.0], on_nvme, on_nvme)
    compute = COMPUTE_SECONDS_PER_PARAM * params
    return {"io_s": io, "compute_s": compute, "update_s": max(io, compute), "moved_gb": 2 * moved / GB}


def predict() -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    bandwidths = []
    for name, measured in MEASURED.items():
        params = measured["params"]
        nvme = BASELINE_UPDATE_BYTES * params / (measured["base_update"] / 1e3)
        bandwidths.append(nvme)
        update = predicted_update(params, nvme)
        other = (measured["mlp_iter"] - measured["mlp_update"]) / 1e3  # forward and backward, measured
        rows.append(
            {
                "model": name,
                "nvme_gb_per_s": round(nvme / GB, 2),
                "moved_gb": round(update["moved_gb"]),
                "predicted_update_s": round(update["update_s"], 1),
                "measured_update_s": measured["mlp_update"] / 1e3,
                "update_predicted_over_measured": round(
                    update["update_s"] / (measured["mlp_update"] / 1e3), 3
                ),
                "predicted_iteration_s": round(update["update_s"] + other, 1),
                "measured_iteration_s": measured["mlp_iter"] / 1e3,
                "iteration_predicted_over_measured": round(
                    (update["update_s"] + other) / (measured["mlp_iter"] / 1e3), 3
                ),
            }
        )
    median_nvme = statistics.median(bandwidths)
    for name, headline in HEADLINE.items():
        params = headline["params"]
        update = predicted_update(params, median_nvme)
        baseline = BASELINE_UPDATE_BYTES * params / median_nvme
        rows.append(
            {
                "model": name,
                "nvme_gb_per_s": round(median_nvme / GB, 2),
                "moved_gb": round(update["moved_gb"]),
                "predicted_update_s": round(update["update_s"], 1),
                "predicted_update_speedup": round(baseline / update["update_s"], 2),
                "stated_iteration_speedup": headline["speedup"],
            }
        )
    errors = [abs(row["update_predicted_over_measured"] - 1) for row in rows if "measured_update_s" in row]
    return {
        "benchmark": "mlp_offload_prediction",
        "source": "../shared/reference/mlp-offload.md (the artifact's evaluation table and 70B logs)",
        "assumptions": {
            "pfs_share": PFS_SHARE,
            "cached_gb_per_node": round(CACHED_BYTES / GB),
            "compute_s_per_gparam": round(COMPUTE_SECONDS_PER_PARAM * 1e9, 4),
            "nvme_bandwidth": "the baseline's update bytes (28 per parameter) over its measured update time",
        },
        "rows": rows,
        "summary": {
            "worst_update_error": round(max(errors), 3),
            "median_update_error": round(statistics.median(errors), 3),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    text = json.dumps(predict(), indent=2)
    if args.output is not None:
        args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
