"""Recompute and offload combined (``scope="checkpoint-inputs"``), and the drop-ins that reach a
model without an edit of its training loop (``ActivationOffload.attach``): exact gradients on a
stock module stack under ``torch.utils.checkpoint`` and on a Hugging Face Llama under its own
gradient checkpointing, on the CPU and a real store; FSDP2 on two gloo ranks."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from tierstore.activations import ActivationOffload, Plan
from tierstore.backends import open_backend
from torch import nn

from tierstore import ConfigError, Tier, TierStore

from .helpers import assert_same_gradients, run_ranks, sgd_gradients
from .test_activations import CausalLM, activation_keys, stepped_grads
from .test_activations_device import enable_checkpointing, tokens_of

KIB = 1 << 10
WIDTH, BLOCKS = 128, 4
FSDP_WORKER = Path(__file__).with_name("fsdp_activations_worker.py")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TierStore]:
    with TierStore([Tier("nvme", open_backend(f"nvme://{tmp_path / 'tier'}"))], cache_budget=0) as opened:
        yield opened


Checkpoint = Callable[..., torch.Tensor]


class Stack(nn.Module):
    """Pre-norm residual MLP blocks of stock modules, each a checkpointed region."""

    def __init__(self, checkpoint: Checkpoint | None, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(WIDTH),
                nn.Linear(WIDTH, 4 * WIDTH),
                nn.GELU(),
                nn.Dropout(0.1),
                nn.Linear(4 * WIDTH, WIDTH),
            )
            for _ in range(BLOCKS)
        )
        self.head = nn.Linear(WIDTH, 16)
        self.checkpoint = checkpoint
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x
        for block in self.blocks:
            if self.checkpoint is None:
                hidden = hidden + block(hidden)
            else:
                hidden = hidden + self.checkpoint(block, hidden, use_reentrant=self.reentrant)
        return self.head(hidden)


def stack_inputs(step: int) -> torch.Tensor:
    return torch.randn(16, 64, WIDTH, generator=torch.Generator().manual_seed(step), requires_grad=True)


@pytest.mark.parametrize("plan", ["all", "lifetime"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_only_the_inputs_of_checkpointed_regions_leave_and_gradients_stay_exact(
    store: TierStore, plan: Plan, reentrant: bool
) -> None:
    offload = ActivationOffload(
        store, budget="8MiB", min_bytes=64 * KIB, plan=plan, scope="checkpoint-inputs"
    )
    recomputed = stepped_grads(
        lambda: Stack(torch.utils.checkpoint.checkpoint, reentrant), stack_inputs, None, steps=4
    )
    plain = stepped_grads(lambda: Stack(None, reentrant), stack_inputs, None, steps=4)
    got = stepped_grads(lambda: Stack(offload.checkpoint, reentrant), stack_inputs, offload, steps=4)
    assert_same_gradients(recomputed, got)
    assert_same_gradients(plain, got)  # recompute itself changes no bit here
    offload.synchronize()
    stats = offload.stats()
    region_input = 16 * 64 * WIDTH * 4
    taken = stats["spilled_bytes"] + stats["kept_bytes"]  # (a lifetime plan may keep some in memory)
    assert taken == 4 * BLOCKS * region_input  # the blocks' inputs, every step, and nothing else
    assert stats["outside_checkpoint_bytes"] > 0  # the head's input stayed where autograd keeps it
    assert stats["resident_bytes"] == 0 and activation_keys(store) == []


def test_checkpoint_outside_the_block_is_torchs_alone(store: TierStore) -> None:
    offload = ActivationOffload(store, budget="8MiB", min_bytes=0, plan="all", scope="checkpoint-inputs")
    model = Stack(offload.checkpoint, reentrant=False)
    model(stack_inputs(0)).sum().backward()
    assert offload.stats()["spilled_bytes"] == 0 and offload.stats()["steps"] == 0


@pytest.mark.parametrize("scope", ["checkpoint-inputs", "saved"])
def test_a_hugging_face_llama_under_its_gradient_checkpointing(store: TierStore, scope: str) -> None:
    """``attach`` enters the block at each forward, and with the ``checkpoint-inputs`` scope marks
    the inputs of the decoder layers' regions (HF's checkpointing function, wrapped)."""

    def checkpointed() -> nn.Module:
        model = CausalLM("llama")
        enable_checkpointing(model.model)
        return model

    expected = stepped_grads(checkpointed, tokens_of, None, steps=3)
    offload = ActivationOffload(store, budget="4MiB", min_bytes=16 * KIB, plan="all", scope=scope)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = checkpointed()
    attachment = offload.attach(model)
    assert_same_gradients(expected, sgd_gradients(model, tokens_of, 3))
    stats = offload.stats()
    layers, hidden = 2, 4 * 64 * 64 * 4  # two decoder layers; hidden states of (4, 64, 64) fp32
    if scope == "checkpoint-inputs":
        assert stats["spilled_bytes"] == 3 * layers * hidden and stats["outside_checkpoint_bytes"] > 0
    else:  # the layers' inputs and what is saved around the regions (the norm, the head, the loss)
        assert stats["spilled_bytes"] > 3 * layers * hidden and stats["outside_checkpoint_bytes"] == 0
    attachment.remove()
    functions = [
        m._gradient_checkpointing_func
        for m in model.modules()
        if "_gradient_checkpointing_func" in m.__dict__
    ]
    assert functions and not any(hasattr(f, "tierstore_offload") for f in functions)
    offload.synchronize()
    assert activation_keys(store) == []


def test_an_attached_module_leaves_the_block_when_its_forward_raises(store: TierStore) -> None:
    offload = ActivationOffload(store, budget="4MiB", min_bytes=0, plan="all")
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    attachment = offload.attach(model)
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 32))  # wrong width
    model(torch.randn(256, 64)).sum().backward()  # a new step: the failed one's block was left
    with torch.no_grad():
        model(torch.randn(256, 64))  # nothing to save: no step
    with offload:  # the caller's own block: the attached forward does not enter another
        model(torch.randn(256, 64)).sum().backward()
    assert offload.stats()["steps"] == 3 and offload.stats()["spilled_bytes"] > 0
    attachment.remove()
    model(torch.randn(256, 64)).sum().backward()
    assert offload.stats()["steps"] == 3


def test_bad_scope_and_device_budget_name_the_field(store: TierStore) -> None:
    with pytest.raises(ConfigError, match="scope"):
        ActivationOffload(store, scope="everything")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device_budget"):
        ActivationOffload(store, device_budget="lots")


# -- FSDP2 ----------------------------------------------------------------------------------------------
def launch_fsdp(tmp_path: Path, world: int = 2) -> dict[str, Any]:
    """Run the FSDP2 worker on ``world`` gloo ranks; rank 0's result."""
    output = tmp_path / "result.json"
    command = [sys.executable, str(FSDP_WORKER), str(tmp_path), str(output)]
    run_ranks(command, world, timeout=240, env={"OMP_NUM_THREADS": "1"})
    result: dict[str, Any] = json.loads(output.read_text())
    return result


def test_an_fsdp2_model_trains_exactly_with_offload_on_two_ranks(tmp_path: Path) -> None:
    result = launch_fsdp(tmp_path)
    assert result["world"] == 2
    assert result["losses"] == result["reference_losses"]
    assert result["gradients_equal"] and result["spilled_bytes"] > 0 and result["parameter_bytes"] > 0
