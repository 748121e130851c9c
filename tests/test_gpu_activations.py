"""Activation offload on a real GPU: every test here is marked ``gpu`` and skips without CUDA (the
same ordering and lifetimes are tested on a simulated device in tests/test_activations_device.py;
the speed and memory are measured by ``python -m benchmarks.bench_activations --device cuda``).

Gradients must be bit-identical to a run without offload: cuBLAS is made deterministic
(``CUBLAS_WORKSPACE_CONFIG``, set before any test runs) and cuDNN too (per test); each reference
is run twice first, so that a kernel that is not deterministic on this node is reported as such
rather than as an offload error.

Run them with ``pytest -m gpu`` on a GPU node, or through the GPU check (``tools/gpu_check.py``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tierstore.activations import PLANS, ActivationOffload, Plan
from tierstore.backends import open_backend
from torch import nn

from tierstore import Tier, TierStore

from .helpers import Gradients, assert_same_gradients, sgd_gradients
from .test_activations import CausalLM, CellLoop, assert_all_given_back
from .test_activations_device import enable_checkpointing

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

MIB = 1 << 20


@pytest.fixture(autouse=True)
def deterministic_cudnn() -> Iterator[None]:
    deterministic, benchmark = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, benchmark


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TierStore]:
    with TierStore([Tier("nvme", open_backend(f"nvme://{tmp_path / 'tier'}"))], cache_budget=0) as opened:
        yield opened


def cuda_grads(
    make: Callable[[], nn.Module],
    inputs: Callable[[int], torch.Tensor],
    offload: ActivationOffload | None,
    steps: int = 3,
) -> Gradients:
    """Gradients of ``steps`` SGD steps of a fresh ``make()`` on the GPU; with an offloader, its
    budgets are checked after every step."""
    torch.manual_seed(0)
    model = make().cuda()
    if offload is None:
        grads = sgd_gradients(model, lambda step: inputs(step).cuda(), steps)
    else:

        def within_budgets() -> None:
            stats = offload.stats()
            assert stats["peak_resident_bytes"] <= offload.budget
            assert stats["peak_device_bytes"] <= offload.device_budget

        grads = sgd_gradients(
            model, lambda step: inputs(step).cuda(), steps, forward=lambda: offload, after_step=within_budgets
        )
    torch.cuda.synchronize()
    return grads


def reference(
    make: Callable[[], nn.Module], inputs: Callable[[int], torch.Tensor], steps: int = 3
) -> Gradients:
    """The gradients without offload (once per model), which must reproduce themselves."""
    key = (make, inputs, steps)
    if key not in REFERENCES:
        first, second = cuda_grads(make, inputs, None, steps), cuda_grads(make, inputs, None, steps)
        assert_same_gradients(
            first, second, "two runs without offload differ: this node's kernels are not deterministic"
        )
        REFERENCES[key] = first
    return REFERENCES[key]


REFERENCES: dict[tuple[object, ...], Gradients] = {}


def inputs_of(*shape: int) -> Callable[[int], torch.Tensor]:
    return lambda step: torch.randn(*shape, generator=torch.Generator().manual_seed(step))


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(step))


def llama() -> nn.Module:
    return CausalLM("llama")


def checkpointed_llama() -> nn.Module:
    model = CausalLM("llama")
    enable_checkpointing(model.model)
    return model


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor], str]] = {
    "llama": (llama, tokens, "64KiB"),
    "GRUCell": (lambda: CellLoop(nn.GRUCell), inputs_of(6, 512, 64), "1MiB"),
    "LSTMCell": (lambda: CellLoop(nn.LSTMCell), inputs_of(6, 512, 64), "1MiB"),
    "transformer-encoder": (encoder, inputs_of(8, 128, 256), "256KiB"),
}


# -- exact, every plan, host memory and storage ---------------------------------------------------------
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", MODELS)
def test_gradients_are_bit_identical_to_no_offload(store: TierStore, name: str, plan: Plan) -> None:
    make, inputs, min_bytes = MODELS[name]
    expected = reference(make, inputs)
    offload = ActivationOffload(store, budget="256MiB", min_bytes=min_bytes, plan=plan)
    assert_same_gradients(expected, cuda_grads(make, inputs, offload))
    stats = offload.stats()
    if plan != "none":
        assert stats["host_bytes"] > 0 and stats["snapshot_bytes"] < stats["host_bytes"]
    assert_all_given_back(offload)


def test_beyond_host_memory_captures_spill_to_storage_exactly(store: TierStore) -> None:
    """A host budget of 1 MiB for a Llama that saves several: the oldest captures go to the store."""
    expected = reference(llama, tokens)
    offload = ActivationOffload(store, budget="1MiB", min_bytes="64KiB", plan="all")
    assert_same_gradients(expected, cuda_grads(llama, tokens, offload))
    stats = offload.stats()
    assert stats["spilled_bytes"] > 0 and stats["read_bytes"] + stats["forwarded_bytes"] > 0
    assert_all_given_back(offload)


@pytest.mark.parametrize("plan", ["all", "lifetime"])
def test_checkpointed_inputs_only_are_exact(store: TierStore, plan: Plan) -> None:
    expected = reference(checkpointed_llama, tokens)
    offload = ActivationOffload(
        store, budget="64MiB", min_bytes="64KiB", plan=plan, scope="checkpoint-inputs"
    )
    torch.manual_seed(0)
    model = checkpointed_llama().cuda()
    attachment = offload.attach(model)
    got = sgd_gradients(model, lambda step: tokens(step).cuda(), 3)
    attachment.remove()
    assert_same_gradients(expected, got)
    assert offload.stats()["host_bytes"] > 0 and offload.stats()["outside_checkpoint_bytes"] > 0
    assert_all_given_back(offload)


def test_a_small_device_budget_bounds_what_the_offloader_holds_on_the_gpu(store: TierStore) -> None:
    expected = reference(llama, tokens)
    offload = ActivationOffload(store, budget="256MiB", device_budget="1MiB", min_bytes="64KiB", plan="all")
    assert_same_gradients(expected, cuda_grads(llama, tokens, offload))
    assert 0 < offload.stats()["peak_device_bytes"] <= MIB
    assert_all_given_back(offload)


# -- lifetimes ------------------------------------------------------------------------------------------
def test_a_forward_whose_output_is_discarded_with_grad_enabled(store: TierStore) -> None:
    """Autograd lets go of every saved tensor while their copies may still run: nothing is freed
    or reused before its copy ends, and the next steps are exact."""
    expected = reference(llama, tokens)
    offload = ActivationOffload(store, budget="256MiB", min_bytes="64KiB", plan="all")
    torch.manual_seed(0)
    model = llama().cuda()
    for _ in range(3):
        with offload:
            model(tokens(0).cuda())  # discarded, grad enabled
    gc.collect()
    assert_all_given_back(offload)
    assert offload.stats()["host_bytes"] > 0
    assert_same_gradients(expected, cuda_grads(llama, tokens, offload))
    assert_all_given_back(offload)


def test_an_offloader_closed_while_copies_are_in_flight(store: TierStore) -> None:
    torch.manual_seed(0)
    model = llama().cuda()
    with torch.no_grad():
        model(tokens(0).cuda())  # cuBLAS's workspace, kept from the first matmul on
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    offload = ActivationOffload(store, budget="256MiB", min_bytes="64KiB", plan="all")
    with offload:
        loss = model(tokens(0).cuda()).float().pow(2).mean()
    offload.close()  # copies to host memory just queued; backward never runs
    assert not any(owner.startswith("activations") for owner in store.memory.held())
    del loss
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline
