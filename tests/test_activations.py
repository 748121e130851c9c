"""Activation spill (tierstore.activations) on a real NVMe-backend store, CPU only."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict, Unpack

import pytest
import torch
from tierstore.activations import ActivationOffload, Plan
from tierstore.backends import open_backend
from torch import nn

from tierstore import ConfigError, NamespaceInUseError, Tier, TierStore
from tierstore.app.demo import GPT, Block

from .helpers import assert_same_gradients, sgd_gradients, small_llama_config

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


def assert_all_given_back(offload: ActivationOffload) -> None:
    """Once the copies in flight end, the offloader holds no memory and no object on the store."""
    offload.synchronize()
    stats = offload.stats()
    assert stats["resident_bytes"] == 0 and stats["device_bytes"] == 0
    assert activation_keys(offload.store) == []


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


def test_parameters_never_reach_the_store(store: TierStore) -> None:
    """A wide linear over a short batch: its weight (saved as ``weight.t()``, a view of a
    parameter) is the only saved tensor above ``min_bytes``."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 512)
    offload = ActivationOffload(store, budget="4MiB", min_bytes="256KiB", plan="all")
    with offload:
        loss = layer(torch.randn(4, 1024, requires_grad=True)).sum()
    loss.backward()
    stats = offload.stats()
    assert stats["parameter_bytes"] >= layer.weight.nbytes
    assert stats["spilled_bytes"] == 0 and activation_keys(store) == []


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


@pytest.mark.parametrize("release", ["reset", "next-step"])
def test_a_failed_backward_leaks_neither_memory_nor_objects(store: TierStore, release: str) -> None:
    """PyTorch holds a failed backward's graph until the thread's next backward: ``reset()`` lets
    go of it at once, and otherwise the next step does."""
    model = make_model()
    offload = ActivationOffload(store, budget="1MiB", min_bytes="16KiB", plan="all")
    tokens, targets = batch(0)

    def explode(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in backward")

    hook = up_weight(model, 1).register_hook(explode)  # type: ignore[no-untyped-call]  # unannotated in torch
    with offload:
        loss = model(tokens, targets)
    with pytest.raises(ValueError, match="boom"):
        loss.backward()
    del loss
    hook.remove()
    if release == "reset":
        gc.collect()
        offload.reset()
    else:
        train_grads(model, offload, steps=1)
        gc.collect()
    assert_all_given_back(offload)


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


# -- stock modules and training loops nobody here wrote ----------------------------------------------
# Each runs several steps with and without offload (SGD between steps, so every step sees new
# weights) and needs bit-identical gradients, with the store checksumming reads and without.


@pytest.fixture(params=["always", "off"])
def verified_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TierStore]:
    tier = Tier("nvme", open_backend(f"nvme://{tmp_path / 'tier'}"))
    with TierStore([tier], cache_budget=0, verify=request.param) as opened:
        yield opened


Backward = Callable[[torch.Tensor, nn.Module], None]


def plain_backward(loss: torch.Tensor, model: nn.Module) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated


def backward_twice(loss: torch.Tensor, model: nn.Module) -> None:
    """A retained graph: backward runs twice over the same saved tensors."""
    loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
    loss.backward()  # type: ignore[no-untyped-call]


def gradient_penalty(loss: torch.Tensor, model: nn.Module) -> None:
    """``autograd.grad(create_graph=True)`` then backward through the gradients too."""
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    (loss + sum(g.pow(2).sum() for g in grads)).backward()  # type: ignore[no-untyped-call]


def stepped_grads(
    make: Callable[[], nn.Module],
    inputs: Callable[[int], torch.Tensor],
    offload: ActivationOffload | None,
    steps: int = 4,
    backward: Backward = plain_backward,
) -> list[list[torch.Tensor]]:
    """Gradients of ``steps`` SGD steps of a fresh ``make()`` (seeded) on ``inputs(step)``; with an
    offloader, its resident bytes are checked against the budget after every step."""
    torch.manual_seed(0)
    if offload is None:
        return sgd_gradients(make(), inputs, steps, backward=backward)

    def within_budget() -> None:
        assert offload.stats()["peak_resident_bytes"] <= offload.budget

    return sgd_gradients(
        make(), inputs, steps, forward=lambda: offload, backward=backward, after_step=within_budget
    )


def assert_exact_with_offload(
    make: Callable[[], nn.Module],
    inputs: Callable[[int], torch.Tensor],
    offload: ActivationOffload,
    steps: int = 4,
    backward: Backward = plain_backward,
) -> None:
    expected = stepped_grads(make, inputs, None, steps, backward)
    assert_same_gradients(expected, stepped_grads(make, inputs, offload, steps, backward))
    offload.synchronize()
    stats = offload.stats()
    assert stats["spilled_bytes"] > 0
    assert stats["overflow_bytes"] == 0 or backward is gradient_penalty
    assert stats["resident_bytes"] == 0 and activation_keys(offload.store) == []


def inputs_of(*shape: int) -> Callable[[int], torch.Tensor]:
    return lambda step: torch.randn(*shape, generator=torch.Generator().manual_seed(step))


class ChunkedGates(nn.Module):
    """The pattern of torch's RNN cells: one projection split with ``unsafe_chunk``, each chunk
    then finished in place (which writes the storage outside the views saved before)."""

    def __init__(self) -> None:
        super().__init__()
        self.projection = nn.Linear(256, 1536)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = self.projection(x).unsafe_chunk(3, 1)
        a.sigmoid_()
        b.sigmoid_()
        c.tanh_()
        return a * b + c


class CellLoop(nn.Module):
    """A decoder loop over ``nn.GRUCell`` or ``nn.LSTMCell``."""

    def __init__(self, cell: type[nn.GRUCell | nn.LSTMCell]) -> None:
        super().__init__()
        self.cell = cell(64, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state: Any = None
        outputs = []
        for t in range(x.shape[0]):
            state = self.cell(x[t], state)
            outputs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outputs)


class Recurrent(nn.Module):
    """``nn.GRU`` (or any stock RNN): its output only."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class BatchNormTwice(nn.Module):
    """One BatchNorm used twice in a forward: its running statistics change between the uses."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(64)
        self.linear = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(self.norm(x)))


class PackedThenGRU(nn.Module):
    """A bidirectional LSTM over packed sequences of several lengths, then a GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 128, bidirectional=True)
        self.gru = nn.GRU(256, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor([20, 18, 15, 10] * (x.shape[1] // 4))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        hidden, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0])
        return self.gru(hidden)[0]


@pytest.mark.parametrize("plan", ["all", "lifetime"])
def test_chunks_finished_in_place_after_the_save(verified_store: TierStore, plan: Plan) -> None:
    offload = ActivationOffload(verified_store, min_bytes="1MiB", plan=plan)
    assert_exact_with_offload(ChunkedGates, inputs_of(1024, 256), offload)


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: Recurrent(nn.GRU(64, 512)), (8, 256, 64)),
        (lambda: CellLoop(nn.GRUCell), (6, 512, 64)),
        (lambda: CellLoop(nn.LSTMCell), (6, 512, 64)),
    ],
    ids=["GRU", "GRUCell", "LSTMCell"],
)
def test_stock_recurrent_modules_with_the_defaults(
    verified_store: TierStore, make: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    assert_exact_with_offload(make, inputs_of(*shape), ActivationOffload(verified_store))


@pytest.mark.parametrize("plan", ["all", "lifetime"])
def test_batch_norm_used_twice(verified_store: TierStore, plan: Plan) -> None:
    offload = ActivationOffload(verified_store, budget="1MiB", min_bytes=0, plan=plan)
    assert_exact_with_offload(BatchNormTwice, inputs_of(32, 64), offload)


@pytest.mark.parametrize("plan", ["all", "lifetime"])
def test_packed_bidirectional_lstm_then_gru(verified_store: TierStore, plan: Plan) -> None:
    offload = ActivationOffload(verified_store, budget="16MiB", min_bytes=0, plan=plan)
    assert_exact_with_offload(PackedThenGRU, inputs_of(20, 16, 32), offload)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


@pytest.mark.parametrize("plan", ["all", "lifetime"])
@pytest.mark.parametrize("backward", [backward_twice, gradient_penalty], ids=["retain_graph", "penalty"])
def test_graphs_that_read_saved_tensors_again(
    verified_store: TierStore, plan: Plan, backward: Backward
) -> None:
    offload = ActivationOffload(verified_store, budget="4MiB", min_bytes="64KiB", plan=plan)
    assert_exact_with_offload(TwoLayers, inputs_of(512, 256), offload, steps=5, backward=backward)


def test_the_defaults_on_a_model_with_nothing_to_spill(verified_store: TierStore) -> None:
    """No saved tensor reaches min_bytes on a fresh store: the plan is to spill nothing."""
    offload = ActivationOffload(verified_store)
    expected = stepped_grads(TwoLayers, inputs_of(8, 256), None, steps=6)
    got = stepped_grads(TwoLayers, inputs_of(8, 256), offload, steps=6)
    assert all(
        torch.equal(a, b) for s, t in zip(expected, got, strict=True) for a, b in zip(s, t, strict=True)
    )
    stats = offload.stats()
    assert stats["plans_built"] == 1 and stats["spilled_bytes"] == 0 and stats["small_bytes"] > 0


def test_two_offloaders_on_one_store_with_default_arguments(verified_store: TierStore) -> None:
    offloads = [ActivationOffload(verified_store, plan="all") for _ in range(2)]
    assert offloads[0].namespace != offloads[1].namespace
    makes: list[Callable[[], nn.Module]] = [ChunkedGates, lambda: CellLoop(nn.GRUCell)]
    inputs = [inputs_of(1024, 256), inputs_of(4, 512, 64)]
    expected = [stepped_grads(make, batch, None) for make, batch in zip(makes, inputs, strict=True)]
    models = []
    for make in makes:
        torch.manual_seed(0)
        models.append(make())
    for step in range(4):  # the two models' steps interleave: both forwards, then both backwards
        losses = []
        for model, offload, batch in zip(models, offloads, inputs, strict=True):
            model.zero_grad(set_to_none=True)
            with offload:
                losses.append(model(batch(step)).float().pow(2).mean())
        for loss, model, want in zip(losses, models, expected, strict=True):
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            assert all(torch.equal(g, w) for g, w in zip(grads, want[step], strict=True))  # type: ignore[arg-type]
            with torch.no_grad():
                torch._foreach_add_(list(model.parameters()), grads, alpha=-0.01)  # type: ignore[arg-type]
    assert all(offload.stats()["spilled_bytes"] > 0 for offload in offloads)


def test_a_namespace_is_claimed_once_per_store(store: TierStore) -> None:
    offload = ActivationOffload(store, namespace="spill")
    with pytest.raises(NamespaceInUseError, match="'spill'"):
        ActivationOffload(store, namespace="spill")
    with pytest.raises(NamespaceInUseError, match="'spill'"):
        ActivationOffload(store, namespace="spill/inner")
    offload.close()
    ActivationOffload(store, namespace="spill").close()  # given back at close


def test_different_views_of_the_same_bytes_are_spilled_once(store: TierStore) -> None:
    """``x`` and ``x.view(...)`` share one capture; disjoint chunks cost their own bytes each."""
    offload = ActivationOffload(store, budget="4MiB", min_bytes="16KiB", plan="all")
    x = torch.randn(256, 768, requires_grad=True)
    with offload:
        hidden = x * 2
        q, k, v = hidden.chunk(3, dim=1)
        loss = hidden.sin().sum() + hidden.view(-1).cos().sum() + (q * k).sum() + (k * v).sum()
    loss.backward()  # type: ignore[no-untyped-call]
    stats = offload.stats()
    # hidden's range once (for its sin and its flat view's cos), then q, k (saved by both
    # products) and v, each its own third: twice hidden's bytes in all.
    assert stats["spilled_bytes"] == 2 * hidden.nbytes
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    hidden = x * 2
    q, k, v = hidden.chunk(3, dim=1)
    (hidden.sin().sum() + hidden.view(-1).cos().sum() + (q * k).sum() + (k * v).sum()).backward()  # type: ignore[no-untyped-call]
    assert torch.equal(expected, x.grad)  # type: ignore[arg-type]


class ConvNet(nn.Module):
    """Convolutions, BatchNorm and pooling: saved tensors that backward uses out of save order."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.head = nn.Linear(32 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class CausalLM(nn.Module):
    """A Hugging Face causal LM built from a config (random weights, nothing downloaded): logits."""

    def __init__(self, family: str) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        if family == "llama":
            self.model = transformers.LlamaForCausalLM(small_llama_config())
        else:
            config = transformers.GPT2Config(
                vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
            )
            self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


@pytest.mark.parametrize("plan", ["all", "lifetime"])
@pytest.mark.parametrize(
    ("make", "inputs", "budget"),
    [
        (lambda: CausalLM("llama"), lambda step: torch.randint(0, 128, (4, 64)), "1MiB"),
        (lambda: CausalLM("gpt2"), lambda step: torch.randint(0, 128, (2, 64)), "300KiB"),
        (ConvNet, inputs_of(16, 3, 32, 32), "2MiB"),
    ],
    ids=["llama", "gpt2", "convnet"],
)
def test_the_budget_holds_when_backward_reads_out_of_order(
    store: TierStore,
    plan: Plan,
    make: Callable[[], nn.Module],
    inputs: Callable[[int], torch.Tensor],
    budget: str,
) -> None:
    """Backward asks for tensors out of the read-ahead order while read-ahead fills the budget
    (every saved tensor spilled, the smallest too): room is made (read-ahead dropped, or waited
    for), never taken beyond the budget."""
    offload = ActivationOffload(store, budget=budget, min_bytes=0, plan=plan)
    assert_exact_with_offload(make, inputs, offload, steps=3)
    stats = offload.stats()
    assert stats["step_saved_bytes"] > offload.budget  # the budget really is a cut
    assert stats["peak_resident_bytes"] <= offload.budget


def test_an_operation_needing_more_than_the_budget_at_once_overflows_and_says_so(store: TierStore) -> None:
    """``a * b`` saves both 256 KiB factors and backward needs them at the same time: a 300 KiB
    budget cannot hold both, so the second is read into ordinary memory, counted and warned of,
    and the pool itself never goes over."""
    offload = ActivationOffload(store, budget="300KiB", min_bytes="16KiB", plan="all")

    class Product(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.first(x).tanh() * self.second(x).sin()

    with pytest.warns(RuntimeWarning, match="A budget of at least"):
        expected = stepped_grads(Product, inputs_of(1024, 64), None, steps=2)
        got = stepped_grads(Product, inputs_of(1024, 64), offload, steps=2)
    for want, have in zip(expected, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True))
    stats = offload.stats()
    assert stats["overflow_bytes"] >= 256 * KIB and stats["peak_resident_bytes"] <= offload.budget


PEAK_RSS_CHILD = """
import json, sys, tempfile
import torch
from tierstore import Tier, TierStore
from tierstore.activations import ActivationOffload
from tierstore.backends import open_backend

torch.manual_seed(0)
layers = [(torch.nn.Parameter(torch.randn(512)), torch.nn.Parameter(torch.randn(512))) for _ in range(12)]
saved = 0
with tempfile.TemporaryDirectory(dir=sys.argv[2]) as directory:
    with TierStore([Tier("disk", open_backend(f"nvme://{directory}"))], cache_budget=0) as store:
        offload = ActivationOffload(store, budget="64MiB", plan=sys.argv[1])
        for step in range(3):
            x = torch.randn(16384, 512, requires_grad=True)
            with offload:
                hidden = x
                for weight, bias in layers:
                    hidden = torch.tanh(hidden * weight + bias)
                loss = hidden.sum()
            loss.backward()
            saved = max(saved, offload.stats()["step_saved_bytes"])
        offload.close()
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"peak_rss": peak, "saved": saved}))
"""


def test_offload_lowers_the_process_peak_rss(tmp_path: Path) -> None:
    """The process's own high-water mark (VmHWM), each variant in a fresh process: spilling
    ~420 MiB of saved activations through a 64 MiB budget must cut the peak by at least half of
    what it moves out of memory. The tensors are 32 MiB: glibc serves those with maps of their
    own and unmaps them when freed, so the peak is what the process really holds, not what a
    fragmented heap keeps of memory freed long ago."""
    import json
    import subprocess
    import sys

    def peak(plan: str) -> dict[str, int]:
        done = subprocess.run(
            [sys.executable, "-c", PEAK_RSS_CHILD, plan, str(tmp_path)],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        result: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
        return result

    keep, spilled = peak("none"), peak("all")
    moved_out = spilled["saved"] - 64 * 2**20
    assert moved_out > 300 * 2**20
    assert spilled["peak_rss"] <= keep["peak_rss"] - moved_out // 2, (keep, spilled)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (device -> pinned pool -> tier)"
)
@pytest.mark.parametrize("plan", ["all", "lifetime"])
def test_cuda_tensors_go_through_the_pinned_pool_on_a_side_stream(store: TierStore, plan: Plan) -> None:
    def on_device() -> nn.Module:
        return CellLoop(nn.GRUCell).cuda()

    def batch(step: int) -> torch.Tensor:
        return inputs_of(6, 512, 64)(step).cuda()

    offload = ActivationOffload(store, plan=plan)
    assert_exact_with_offload(on_device, batch, offload)
    assert offload.stats()["peak_resident_bytes"] > 0
