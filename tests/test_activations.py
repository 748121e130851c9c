"""Activation spill (tierstore.activations) on a real NVMe-backend store, CPU only."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict, Unpack

import pytest
import torch
from tierstore.activations import ActivationOffload
from tierstore.backends import open_backend

from tierstore import ConfigError, Tier, TierStore
from tierstore.testing.gpt import GPT, Block

LENGTH = 32
KIB = 1024


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TierStore]:
    with TierStore([Tier("nvme", open_backend(f"nvme://{tmp_path / 'tier'}"))], cache_budget=0) as opened:
        yield opened


class ModelOptions(TypedDict, total=False):
    checkpointed: frozenset[int]
    reentrant: bool


def make_model(dtype: torch.dtype = torch.float32, **options: Unpack[ModelOptions]) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=64, width=64, layers=3, heads=4, length=LENGTH, **options).to(dtype)


def up_weight(model: GPT, index: int) -> torch.Tensor:
    """The weight of block ``index``'s first MLP linear."""
    block = model.blocks[index]
    assert isinstance(block, Block)
    return block.up.weight


def batch(step: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (size, LENGTH + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train_grads(
    model: GPT, offload: ActivationOffload | None, steps: int = 3, size: int = 4
) -> list[list[torch.Tensor]]:
    """Gradients of each step (dropout seeded per step), parameters left unchanged."""
    grads = []
    for step in range(steps):
        tokens, targets = batch(step, size)
        torch.manual_seed(100 + step)
        model.zero_grad(set_to_none=True)
        if offload is None:
            loss = model(tokens, targets)
        else:
            with offload:
                loss = model(tokens, targets)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    return grads


def activation_keys(store: TierStore) -> list[str]:
    return [key for key in store if key.startswith("activations/")]


@pytest.mark.parametrize("plan", ["all", "lifetime"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_bit_identical_with_offload(store: TierStore, plan: str, dtype: torch.dtype) -> None:
    expected = train_grads(make_model(dtype), None)
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan=plan)  # type: ignore[arg-type]
    got = train_grads(make_model(dtype), offload)
    offload.synchronize()
    for step_expected, step_got in zip(expected, got, strict=True):
        for a, b in zip(step_expected, step_got, strict=True):
            assert torch.equal(a, b)
    stats = offload.stats()
    assert stats["spilled_bytes"] > 0 and stats["read_bytes"] + stats["forwarded_bytes"] > 0
    assert stats["peak_resident_bytes"] <= offload.budget
    assert activation_keys(store) == []  # every spilled object deleted once backward consumed it
    assert stats["resident_bytes"] == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradients_bit_identical_with_checkpointed_blocks(store: TierStore, reentrant: bool) -> None:
    options: ModelOptions = {"checkpointed": frozenset({0, 2}), "reentrant": reentrant}
    expected = train_grads(make_model(**options), None)
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="all")
    got = train_grads(make_model(**options), offload)
    for step_expected, step_got in zip(expected, got, strict=True):
        for a, b in zip(step_expected, step_got, strict=True):
            assert torch.equal(a, b)
    assert offload.stats()["spilled_bytes"] > 0


def test_parameters_never_reach_the_store(store: TierStore, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    written: list[int] = []
    put = store.put

    def spy(key: str, tensor: torch.Tensor, **options: bool):  # type: ignore[no-untyped-def]
        written.append(tensor.untyped_storage().data_ptr())
        return put(key, tensor, **options)

    monkeypatch.setattr(store, "put", spy)
    offload = ActivationOffload(store, budget="1MiB", min_bytes=0, plan="all")
    train_grads(model, offload, steps=1)
    assert written and not parameter_storages & set(written)
    stats = offload.stats()
    assert stats["parameter_bytes"] > 0  # the tied embedding/head weight and the linears' weight.t()


def test_one_storage_saved_twice_is_spilled_once(store: TierStore) -> None:
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="all")
    x = torch.randn(64, 128, requires_grad=True)
    w1, w2 = torch.nn.Parameter(torch.randn(128, 128)), torch.nn.Parameter(torch.randn(128, 128))
    with offload:
        hidden = x * 2
        loss = (hidden @ w1).sum() + (hidden @ w2).sum() + (hidden * hidden).sum()
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    recomputed = ((x * 2) @ w1).sum() + ((x * 2) @ w2).sum() + ((x * 2) * (x * 2)).sum()
    recomputed.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    assert torch.equal(expected, x.grad)  # type: ignore[arg-type]
    stats = offload.stats()
    assert stats["deduplicated_bytes"] >= 3 * hidden.nbytes
    assert stats["spilled_tensors"] == 1


def test_resident_bytes_stay_within_a_small_budget(store: TierStore) -> None:
    model = make_model()
    offload = ActivationOffload(store, budget="256KiB", min_bytes="16KiB", plan="all")
    reference = ActivationOffload(store, budget="64MiB", min_bytes="16KiB", plan="none")
    expected = train_grads(make_model(), reference, steps=1)
    got = train_grads(model, offload, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got[0], strict=True))
    assert offload.stats()["peak_resident_bytes"] <= 256 * KIB
    assert offload.stats()["step_saved_bytes"] > 4 * 256 * KIB  # what keeping them all would hold
    assert reference.stats()["kept_bytes"] > 4 * 256 * KIB  # the budget really is a cut


def test_a_failed_backward_leaks_neither_memory_nor_objects(store: TierStore) -> None:
    model = make_model()
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="all")
    tokens, targets = batch(0)

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in backward")

    with offload:
        loss = model(tokens, targets)
        up_weight(model, 1).register_hook(explode)  # type: ignore[no-untyped-call]  # unannotated in torch
    with pytest.raises(ValueError, match="boom"):
        loss.backward()
    del loss
    gc.collect()
    # PyTorch holds a failed backward's graph until the thread's next backward: reset() lets go now.
    offload.reset()
    offload.synchronize()
    assert activation_keys(store) == []
    assert offload.stats()["resident_bytes"] == 0


def test_the_next_step_frees_what_a_failed_backward_held(store: TierStore) -> None:
    model = make_model()
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="all")
    tokens, targets = batch(0)
    hook = up_weight(model, 1).register_hook(lambda grad: 1 / 0)  # type: ignore[no-untyped-call]  # as above
    with offload:
        loss = model(tokens, targets)
    with pytest.raises(ZeroDivisionError):
        loss.backward()
    del loss
    hook.remove()
    train_grads(model, offload, steps=1)
    gc.collect()
    offload.synchronize()
    assert activation_keys(store) == []
    assert offload.stats()["resident_bytes"] == 0


def test_a_failed_forward_leaks_neither_memory_nor_objects(store: TierStore) -> None:
    model = make_model()
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="all")
    tokens, targets = batch(0)
    with pytest.raises(ValueError, match="batch_size"), offload:
        model(tokens, targets[:, :3])  # wrong target shape: cross_entropy raises after the blocks
    gc.collect()
    offload.synchronize()
    assert offload.stats()["spilled_bytes"] > 0
    assert activation_keys(store) == []
    assert offload.stats()["resident_bytes"] == 0
    train_grads(model, offload, steps=1)  # the hooks were removed and the offloader still works


@pytest.mark.parametrize("min_bytes", [0, "1GiB"], ids=["spilled", "kept"])
def test_in_place_change_after_save_fails_backward_as_autograd_does(
    store: TierStore, min_bytes: object
) -> None:
    def run(offload: ActivationOffload | None) -> None:
        x = torch.randn(64, 64, requires_grad=True)
        hidden = x * 3
        if offload is None:
            out = hidden.sin()
        else:
            with offload:
                out = hidden.sin()  # saves hidden
        hidden.add_(1)
        out.sum().backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(None)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(ActivationOffload(store, budget="1MiB", min_bytes=min_bytes, plan="all"))  # type: ignore[arg-type]


def test_lifetime_plan_reused_then_rebuilt_when_the_batch_changes(store: TierStore) -> None:
    model = make_model()
    offload = ActivationOffload(store, budget="512KiB", min_bytes="16KiB", plan="lifetime")
    expected = train_grads(make_model(), None, steps=4)
    got = train_grads(model, offload, steps=4)
    assert all(
        torch.equal(a, b) for s, t in zip(expected, got, strict=True) for a, b in zip(s, t, strict=True)
    )
    assert offload.stats()["plans_built"] == 1  # profiled in steps 1 and 2, built once, reused
    explained = offload.plan_explain()
    assert "predicted step" in explained and "spill" in explained
    train_grads(model, offload, steps=2, size=2)  # new batch shape: profiles again...
    assert offload.stats()["plans_built"] == 1
    train_grads(model, offload, steps=1, size=2)  # ...then builds a new plan
    assert offload.stats()["plans_built"] == 2
    assert offload.stats()["peak_resident_bytes"] <= 512 * KIB


def test_lifetime_plan_keeps_the_last_layers_when_the_budget_allows(store: TierStore) -> None:
    model = make_model()
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="lifetime")
    train_grads(model, offload, steps=3)
    stats = offload.stats()
    assert 0 < stats["planned_keep_bytes"] <= 1 << 20
    explained = offload.plan_explain().splitlines()
    decisions = [line.rsplit(": ", 1)[1] for line in explained if line.lstrip().startswith("#")]
    assert "spill" in decisions
    assert decisions[-1].startswith("keep")  # the last tensor saved is used first: kept


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"budget": -1}, "budget"),
        ({"budget": True}, "budget"),
        ({"budget": "lots"}, "budget"),
        ({"min_bytes": -5}, "min_bytes"),
        ({"plan": "sometimes"}, "plan"),
    ],
)
def test_bad_arguments_name_the_field(store: TierStore, options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ActivationOffload(store, **options)  # type: ignore[arg-type]


def test_budget_below_the_largest_spilled_tensor_is_a_config_error(store: TierStore) -> None:
    offload = ActivationOffload(store, budget="8KiB", min_bytes=0, plan="all")
    tokens, targets = batch(0)
    with pytest.raises(ConfigError, match="budget"), offload:
        make_model()(tokens, targets)
    gc.collect()
    offload.synchronize()
    assert activation_keys(store) == []


def test_scratch_objects_are_not_journaled(tmp_path: Path) -> None:
    def open_store() -> TierStore:
        tier = Tier("nvme", open_backend(f"nvme://{tmp_path / 'tier'}"))
        return TierStore([tier], cache_budget=1 << 20, manifest=tmp_path / "manifest")

    with open_store() as store:
        store.put("kept", torch.arange(10)).result()
        store.put("scratch", torch.arange(10), scratch=True).result()
        assert store.info("scratch").cached is False  # never a write-back copy
        store.flush()
        store.put("kept", torch.arange(5), scratch=True).result()  # a scratch version un-journals it
    with open_store() as store:
        assert store.keys() == []
    assert len(list((tmp_path / "tier").iterdir())) == 0  # collected at open
