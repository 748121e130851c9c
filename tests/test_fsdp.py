"""tierstore.integrations.fsdp: FSDPOffloadedAdamW over FSDP2 (``fully_shard``) on CPU and gloo.

Each run is one process per rank (tests/fsdp_worker.py), spawned here with a free port and always
reaped. The reference is FSDP2 + ``torch.optim.AdamW(fused=True)`` (the kernel's arithmetic) on the
same sharded model and data, trained in the same processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .helpers import relative_error, run_ranks

WORKER = Path(__file__).with_name("fsdp_worker.py")
STEPS = 10
Run = tuple[dict[str, Any], list[torch.Tensor]]
"""Rank 0's result and the trained parameters, gathered whole."""
SAVE_AT = 5


def launch(tmp: Path, name: str, world: int = 2, **run: Any) -> Run:
    """Run the worker on ``world`` ranks; rank 0's result and (for training runs) the trained
    parameters, gathered whole."""
    output = tmp / f"{name}.json"
    document = json.dumps({"output": str(output), "steps": STEPS, **run})
    run_ranks([sys.executable, str(WORKER), document], world, timeout=240, env={"OMP_NUM_THREADS": "1"})
    result = json.loads(output.read_text())
    weights = output.with_suffix(".pt")
    return result, (torch.load(weights) if weights.exists() else [])


def largest_error(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    return max(relative_error(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def straight(scratch: Path) -> Run:
    """fp32 on 2 ranks, clip_grad_norm_ on the DTensor gradients, the state on an NVMe tier per
    rank, a DCP checkpoint after step 5, 10 steps; the reference trained beside it."""
    return launch(
        scratch,
        "straight",
        setup="fp32",
        clip="torch",
        reference=True,
        state_dir=str(scratch / "state-straight"),
        sub_group_size=3000,
        save_at=SAVE_AT,
        checkpoint=str(scratch / "checkpoint-2"),
    )


def test_fp32_matches_torch_adamw_with_clip_grad_norm(
    straight: Run,
) -> None:
    result, _ = straight
    assert result["world"] == 2 and result["fp32_shards"]
    assert result["state_keys"][0].startswith("rank0/adamw/")  # this rank's own namespace
    assert result["state_per_element"] == 2  # the moments only: the fp32 shards are the masters
    assert result["max_relative_error"] <= 1e-6
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-6)


def test_own_clipping_takes_the_global_norm(scratch: Path) -> None:
    """max_grad_norm clips by the norm over both ranks' shards (one all-reduce), as clip_grad_norm_
    does: on each step's gradients the clipping coefficient is clip_grad_norm_'s to the rounding of
    the norm (a sum in another order). Every step clips (a norm limit far below the gradients'), so a
    per-rank norm would train visibly differently. The parameters then agree as far as Adam lets
    rounding differences grow, which depends on the model: elements whose true gradient is zero
    train on rounding noise, which Adam turns into steps of about lr (on this GPT the parameters
    agree within 1e-4; on nn.TransformerEncoder, whose in_proj_bias has such elements, not)."""
    result, _ = launch(scratch, "own-clip", setup="fp32", clip="optimizer", reference=True)
    assert len(result["coefficient_errors"]) == STEPS
    assert max(result["coefficient_errors"]) <= 1e-6
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-5)
    assert result["max_relative_error"] <= 1e-4


def test_mixed_precision_policy_stages_the_moments_only(scratch: Path) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16): the sharded parameters stay fp32 and are their own
    masters; bf16 compute, fp32 update, equal to torch's."""
    result, _ = launch(scratch, "mp", setup="mp", clip="torch", reference=True)
    assert result["fp32_shards"] and result["state_per_element"] == 2
    assert result["max_relative_error"] <= 1e-6
    assert result["losses"] == pytest.approx(result["reference_losses"], rel=1e-6)


def test_bf16_model_gets_fp32_masters_in_the_store(scratch: Path, straight: Run) -> None:
    """A bf16-sharded model: fp32 masters and both moments in the store (3 values per element).
    torch's AdamW keeps bf16 state for bf16 parameters, so the reference is the fp32 run and the
    tolerance torch's own bf16 run's distance from it: ours stays as close (closer on average, its
    masters being fp32)."""
    result, ours = launch(scratch, "bf16", setup="bf16", clip="torch", reference=True)
    torch_bf16 = torch.load(scratch / "bf16.reference.pt")
    fp32_result, fp32 = straight
    assert not result["fp32_shards"] and result["state_per_element"] == 3
    ours_apart = [relative_error(a, b) for a, b in zip(ours, fp32, strict=True)]
    torch_apart = [relative_error(a, b) for a, b in zip(torch_bf16, fp32, strict=True)]
    assert max(ours_apart) <= 1.25 * max(torch_apart)
    assert sum(ours_apart) < sum(torch_apart)
    loss_gap = max(abs(a - b) for a, b in zip(result["losses"], fp32_result["losses"], strict=True))
    torch_gap = max(
        abs(a - b) for a, b in zip(result["reference_losses"], fp32_result["losses"], strict=True)
    )
    assert loss_gap <= 1.25 * torch_gap


def test_model_mixing_sharded_and_unsharded_modules(scratch: Path) -> None:
    """Only the blocks sharded: the embeddings, final norm and head stay plain tensors, replicated
    (their gradients averaged over the ranks, as replicate() would); each rank stages their whole
    state, and they stay identical on every rank."""
    result, _ = launch(scratch, "mixed", setup="fp32", mixed=True, reference=True)
    assert result["replicated"] == 4  # token and position embeddings (the head is tied), final norm
    assert result["replica_spread"] == 0.0
    assert result["max_relative_error"] <= 1e-6


def test_dcp_resume_on_two_ranks_is_exact(scratch: Path, straight: Run) -> None:
    """dcp.load of step 5 in new processes continues as the uninterrupted run did, to the bit, and
    streams the state into the store without reading it back or writing a sub-group twice."""
    reference, trained = straight
    result, resumed = launch(
        scratch, "resume-2", setup="fp32", clip="torch", resume=True, checkpoint=str(scratch / "checkpoint-2")
    )
    assert result["losses"] == reference["losses"][SAVE_AT:]
    assert largest_error(resumed, trained) == 0.0
    # the checkpoint rewrites every sub-group whole: none is read first, each is written once
    moved = result["load_bytes"]
    assert (moved["read"], moved["written"]) == (0, moved["state"])


def test_dcp_resume_on_one_rank_reshards(scratch: Path, straight: Run) -> None:
    """Saved on 2 ranks, loaded on 1: the state is resharded like the parameters. One rank sums
    the same global batch's gradients in another order, so the run agrees to fp32 rounding."""
    reference, trained = straight
    result, resumed = launch(
        scratch,
        "resume-1",
        world=1,
        setup="fp32",
        clip="torch",
        resume=True,
        checkpoint=str(scratch / "checkpoint-2"),
        state_dir=str(scratch / "state-resume-1"),
    )
    assert result["losses"][0] == reference["losses"][SAVE_AT]  # the restored model, same batch
    assert result["losses"] == pytest.approx(reference["losses"][SAVE_AT:], rel=1e-5)
    assert largest_error(resumed, trained) <= 1e-4


def test_dcp_one_rank_to_two_reshards(scratch: Path) -> None:
    """Saved on 1 rank, loaded on 2: each rank streams its rows of the state into its store."""
    common: dict[str, Any] = {"setup": "fp32", "clip": "torch", "checkpoint": str(scratch / "checkpoint-1")}
    straight, trained = launch(scratch, "one-rank", world=1, save_at=SAVE_AT, **common)
    result, resumed = launch(scratch, "resume-from-1", resume=True, **common)
    assert result["losses"][0] == straight["losses"][SAVE_AT]
    assert result["losses"] == pytest.approx(straight["losses"][SAVE_AT:], rel=1e-5)
    assert largest_error(resumed, trained) <= 1e-4


@pytest.mark.parametrize(("setup", "eager"), [("bf16", False), ("mp", True)])
def test_resume_on_two_ranks_is_exact_for_each_setup(scratch: Path, setup: str, eager: bool) -> None:
    """A bf16 model (its fp32 masters checkpointed with the moments) through the streaming
    save/load; the MixedPrecisionPolicy setup through torch's own get_state_dict / dcp.save /
    dcp.load / set_state_dict (no streaming planner, the state dict materialised): to the bit."""
    checkpoint = str(scratch / f"checkpoint-{setup}")
    common: dict[str, Any] = {"setup": setup, "clip": "torch", "eager": eager, "checkpoint": checkpoint}
    straight, trained = launch(scratch, f"{setup}-straight", save_at=SAVE_AT, **common)
    result, resumed = launch(scratch, f"{setup}-resumed", resume=True, **common)
    assert result["losses"] == straight["losses"][SAVE_AT:]
    assert largest_error(resumed, trained) == 0.0


@pytest.mark.parametrize("eager", [False, True])
def test_compressed_state_resumes_from_dcp_to_the_bit(scratch: Path, eager: bool) -> None:
    """A bf16 model with 8-bit moments and compensated masters (sub-groups of 3000 elements: blocks
    straddle parameters), saved after step 5 by fsdp.save or get_state_dict + dcp.save and loaded
    in new processes: each rank's store holds the bytes it saved, and training continues to the
    bit; loaded on one rank instead, the state is encoded on that rank's blocks and training
    continues within the format's error."""
    checkpoint = str(scratch / f"checkpoint-int8-{eager}")
    common: dict[str, Any] = {
        "setup": "bf16",
        "clip": "torch",
        "eager": eager,
        "checkpoint": checkpoint,
        "state_precision": "int8-compensated",
    }
    straight, trained = launch(scratch, f"int8-{eager}-straight", save_at=SAVE_AT, **common)
    result, resumed = launch(scratch, f"int8-{eager}-resumed", resume=True, **common)
    assert result["loaded_digests"] == straight["saved_digests"]
    assert len(set(straight["saved_digests"])) == 2  # two ranks, two different stores
    assert result["losses"] == straight["losses"][SAVE_AT:]
    assert largest_error(resumed, trained) == 0.0
    if not eager:
        return
    one, _ = launch(scratch, "int8-resumed-on-one", world=1, resume=True, **common)
    # one rank takes the whole batch's mean in another order, in bf16
    assert one["losses"] == pytest.approx(straight["losses"][SAVE_AT:], rel=1e-3)


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_checkpoints_pass_between_torchs_fused_adamw_and_ours(scratch: Path, world: int) -> None:
    """torch's documented DCP calls, both ways: torch's fused AdamW resumes a checkpoint of
    FSDPOffloadedAdamW (written by fsdp.save or by get_state_dict + dcp.save) with get_state_dict +
    dcp.load + set_state_dict, staying on its fused kernel, and FSDPOffloadedAdamW resumes torch's
    (stock calls, or fsdp.load); each continues as torch's fused AdamW trained straight through, to
    the bit."""
    found, _ = launch(
        scratch,
        f"interop-{world}",
        world=world,
        scenario="interop",
        setup="fp32",
        save_at=SAVE_AT,
        checkpoint=str(scratch / f"interop-{world}"),
    )
    assert found["world"] == world
    for name in (
        "torch from ours (fsdp.save)",
        "torch from ours (dcp.save)",
        "ours from torch (dcp.load)",
        "ours from torch (fsdp.load)",
    ):
        assert found[name] == {"losses_equal": True, "largest_difference": 0.0}, name
    assert found["torch from ours (fsdp.save): fused"] == [True]
    assert found["torch from ours (dcp.save): fused"] == [True]


def test_bad_setups_raise_typed_errors_naming_the_problem(scratch: Path) -> None:
    found, _ = launch(scratch, "errors", world=1, scenario="errors")
    expected = {
        "apollo": ("ConfigError", "whole matrices"),
        "plain_adamw_on_dtensors": ("ConfigError", "FSDPOffloadedAdamW"),
        "cpu_offload_policy": ("FSDPSetupError", "CPUOffloadPolicy"),
        "no_dtensor": ("FSDPSetupError", "not sharded"),
        "column_sharded": ("FSDPSetupError", "dimension other than 0"),
        "mixed_dtypes": ("FSDPSetupError", "mix fp32 and low-precision"),
    }
    for case, (error, words) in expected.items():
        assert found[case][0] == error, (case, found[case])
        assert words in found[case][1], (case, found[case])


def test_peak_rss_of_step_and_save_stays_below_the_state(scratch: Path) -> None:
    """A fresh process, a 4-block bf16 GPT whose state (masters and moments, ~39 MB) is ~5x the
    8 MiB budget, on an NVMe tier: the kernel's peak-RSS count shows the step and a streamed DCP
    save adding well under the state's size."""
    figures, _ = launch(
        scratch,
        "rss",
        world=1,
        scenario="rss",
        state_dir=str(scratch / "state-rss"),
        checkpoint=str(scratch / "checkpoint-rss"),
        sub_group_size=262_144,
        dram_budget=8 << 20,
    )
    state = figures["state_bytes"]
    assert state > 4 * figures["dram_budget"]
    assert figures["step2_peak_increase_bytes"] < state / 2
    assert figures["save_peak_increase_bytes"] < state / 2


def test_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    """``python -m tierstore.integrations.fsdp.example``: the resumed losses are the straight run's."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "tierstore.integrations.fsdp.example", "--steps", "4", "--save-at", "2"]
    command += ["--width", "64", "--layers", "2", "--length", "32", "--json", str(report)]
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    child = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False, env=environment)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    document = json.loads(report.read_text())
    assert document["resume_matches"] is True
    assert [row["step"] for row in document["resumed"]] == [3, 4]
    assert document["straight"][1]["checkpoint_state_bytes"] > 0
