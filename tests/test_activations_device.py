"""Activation offload on a device, with the device simulated (tierstore.testing.device): what each
copy waits for, when it runs, what memory it holds until when, and the exactness that follows.

The model runs on the CPU as if on a GPU (:class:`SimulatedModelDevice`: every tensor not pinned
is device memory, the caller's stream is the calling thread); the copies between device and host
run only when the test, or a thread that waits for them, runs the copy stream. Inside
``sim.hold()`` no copy runs at all: every copy of a forward then runs after everything that forward
did, the latest a GPU could run it, so a copy that read memory changed after the save would give
backward the changed bytes, and the test sees it. The same on a real GPU:
tests/test_gpu_activations.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.activations import ActivationOffload, Plan
from tierstore.activations.capture import DEVICE_ALIGN
from tierstore.activations.replay import SavedTensor, keep_on_device
from tierstore.backends import open_backend
from torch import nn

from tierstore import Tier, TierStore
from tierstore.testing.device import SimulatedModelDevice

from .helpers import assert_same_gradients, sgd_gradients
from .test_activations import (
    BatchNormTwice,
    CausalLM,
    CellLoop,
    ChunkedGates,
    Recurrent,
    TwoLayers,
    activation_keys,
    assert_all_given_back,
    inputs_of,
    stepped_grads,
)

KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture
def sim() -> SimulatedModelDevice:
    return SimulatedModelDevice()


def store_on(sim: SimulatedModelDevice, directory: Path, **options: object) -> TierStore:
    """A store whose device copies and pinned memory go through ``sim``."""
    store = TierStore([Tier("nvme", open_backend(f"nvme://{directory}"))], cache_budget=0, **options)  # type: ignore[arg-type]
    store._operations.device.runtime = sim
    return store


@pytest.fixture
def store(sim: SimulatedModelDevice, tmp_path: Path) -> Iterator[TierStore]:
    with store_on(sim, tmp_path / "tier") as opened:
        yield opened


def device_grads(
    make: Callable[[], nn.Module],
    inputs: Callable[[int], torch.Tensor],
    offload: ActivationOffload,
    sim: SimulatedModelDevice,
    *,
    steps: int = 3,
    held: bool = True,
) -> list[list[torch.Tensor]]:
    """As ``stepped_grads`` with an offloader, forward held (no copy runs in it) if ``held``."""

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        with sim.hold() if held else contextlib.nullcontext(), offload:
            yield

    torch.manual_seed(0)
    return sgd_gradients(make(), inputs, steps, forward=forward)


def linear_stack() -> nn.Module:
    """Six ``Linear(256, 256)`` and ``tanh``: 512 KiB saved per layer on a batch of 512."""
    return nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)))


def enable_checkpointing(model: nn.Module) -> None:
    """Hugging Face gradient checkpointing, non-reentrant, as a user switches it on (the method's
    name depends on the release)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]


def tokens_of(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(step))


def small_encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


# -- exact on stock modules, the copies run the latest they could -------------------------------------
@pytest.mark.parametrize("plan", ["all", "lifetime"])
@pytest.mark.parametrize(
    ("make", "shape", "min_bytes"),
    [
        (ChunkedGates, (1024, 256), 64 * KIB),
        (lambda: CellLoop(nn.GRUCell), (6, 512, 64), 64 * KIB),
        (lambda: CellLoop(nn.LSTMCell), (6, 512, 64), 64 * KIB),
        (lambda: Recurrent(nn.GRU(64, 256)), (8, 64, 64), 16 * KIB),
        (BatchNormTwice, (32, 64), 0),
        (small_encoder, (8, 32, 64), 16 * KIB),
    ],
    ids=["chunked-gates", "GRUCell", "LSTMCell", "GRU", "batch-norm-twice", "transformer-encoder"],
)
def test_stock_modules_stay_exact_when_every_copy_runs_after_forward(
    store: TierStore,
    sim: SimulatedModelDevice,
    plan: Plan,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    min_bytes: int,
) -> None:
    """No snapshot of what is in autograd's graph: copies read the saved tensors themselves, here
    after forward finished the other chunks of a projection in place, updated BatchNorm's running
    statistics again, and so on; backward still gets exactly what was saved."""
    offload = ActivationOffload(store, budget="64MiB", min_bytes=min_bytes, plan=plan)
    expected = stepped_grads(make, inputs_of(*shape), None, steps=3)
    assert_same_gradients(expected, device_grads(make, inputs_of(*shape), offload, sim))
    stats = offload.stats()
    assert stats["host_bytes"] > 0 and stats["spilled_bytes"] == 0  # host memory held them all
    assert_all_given_back(offload)


def test_an_operation_on_tensors_in_the_graph_copies_them_without_a_snapshot(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    offload = ActivationOffload(store, budget="64MiB", min_bytes=64 * KIB, plan="all")
    x = torch.randn(256, 512, requires_grad=True)
    with sim.hold(), offload:
        loss = (x * 2).tanh().exp().sum()  # saves tanh's output and exp's
    loss.backward()  # type: ignore[no-untyped-call]
    stats = offload.stats()
    assert stats["host_bytes"] == 2 * x.nbytes and stats["snapshot_bytes"] == 0


def test_a_tensor_outside_the_graph_written_after_its_save_gives_backward_the_saved_bytes(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    """An input (no grad) saved by ``x * w`` and then written behind autograd's back (``.data``)
    before its copy runs: only such a tensor is snapshotted, so backward gets the bytes at the
    save, as from the offloader on the CPU."""
    offload = ActivationOffload(store, budget="8MiB", min_bytes=0, plan="all")
    saved = torch.randn(256, 256)
    x = saved.clone()
    w = nn.Parameter(torch.randn(256, 256))
    with sim.hold(), offload:
        loss = (x * w).sum()
        x.data.add_(1)  # the copy to host memory has not run yet
    loss.backward()  # type: ignore[no-untyped-call]
    assert torch.equal(w.grad, saved)  # type: ignore[arg-type]
    assert offload.stats()["snapshot_bytes"] == saved.nbytes
    assert_all_given_back(offload)


def test_a_tracked_write_before_the_copy_ends_fails_backward_as_autograd_does(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    """The saved tensor is written in place (autograd counts it) and let go of before backward:
    the version check at the end of its copy still fails backward, as autograd would."""
    offload = ActivationOffload(store, budget="8MiB", min_bytes=0, plan="all")
    x = torch.randn(128, 128, requires_grad=True)
    with sim.hold(), offload:
        hidden = x * 3
        out = hidden.sin()  # saves hidden
        hidden.add_(1)
        del hidden
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()  # type: ignore[no-untyped-call]


# -- ordering: out after the producing kernel, back ahead of the use, waited for only at the use --------
def test_copies_out_follow_the_save_and_copies_back_run_ahead_of_backward(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    offload = ActivationOffload(store, budget="64MiB", min_bytes=256 * KIB, plan="all")
    first, second = nn.Linear(64, 256), nn.Linear(256, 256)
    x = torch.randn(512, 64)  # too small to be taken
    with sim.hold(), offload:
        early = first(x).tanh()  # saves tanh's output
        (copy_stream,) = sim.copy_streams()
        queued = copy_stream.pending()
        assert len(queued) == 4 and queued[0].startswith("wait") and queued[2].startswith("copy")
        sim.run_all()  # the GPU catches up with forward: the first copies end
        late = second(early).sin()  # saves second's output; its copy is still queued at the end
        loss = late.sum()
    stats = offload.stats()
    assert stats["device_kept_bytes"] == 512 * 256 * 4  # the copy that had not ended: no copy back
    ahead = [op for op in copy_stream.pending() if op.startswith("copy")]
    assert ahead and not any(
        op.startswith("wait") for op in copy_stream.pending()[1:]
    )  # read ahead, waiting for nothing
    waits_before = sum(op.startswith("compute: wait") for op in sim.completed)
    loss.backward()
    waits = sum(op.startswith("compute: wait") for op in sim.completed) - waits_before
    assert waits == 2  # at the two uses of the one tensor copied back (tanh's and second's backward)
    assert {stream for _, stream in sim.used_on} == {"compute"}  # restored memory marked as used there
    assert_all_given_back(offload)


def test_device_memory_stays_within_the_device_budget(store: TierStore, sim: SimulatedModelDevice) -> None:
    """Forward waits for the oldest copies out while the device budget is full."""
    budget = 3 * 512 * 256 * 4
    offload = ActivationOffload(store, budget="64MiB", device_budget=budget, min_bytes=64 * KIB, plan="all")

    expected = stepped_grads(linear_stack, inputs_of(512, 256), None, steps=2)
    assert_same_gradients(
        expected, device_grads(linear_stack, inputs_of(512, 256), offload, sim, steps=2, held=False)
    )
    stats = offload.stats()
    assert 0 < stats["peak_device_bytes"] <= budget < stats["step_saved_bytes"]
    assert_all_given_back(offload)


# -- lifetimes: pinned pages and held tensors until each copy's end -------------------------------------
def test_an_entry_let_go_while_its_copy_runs_keeps_its_pinned_pages_until_the_copy_ends(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    """A forward whose output is dropped at once: autograd lets go of every saved tensor while
    their copies to host memory are still queued. The pool memory they copy into, and the saved
    tensors they read, are held until each copy has ended."""
    offload = ActivationOffload(store, budget="8MiB", min_bytes=64 * KIB, plan="all")
    x = torch.randn(512, 256, requires_grad=True)
    with sim.hold():
        with offload:
            (x * 2).tanh().sin().sum()  # discarded, grad enabled
        gc.collect()
        stats = offload.stats()
        assert stats["host_bytes"] > 0
        assert stats["resident_bytes"] == stats["host_bytes"]  # nothing back in the pool yet
        assert stats["device_bytes"] == stats["host_bytes"]  # nor the saved tensors' memory
    offload.synchronize()
    assert offload.stats()["resident_bytes"] == 0 and offload.stats()["device_bytes"] == 0


def test_closing_with_copies_in_flight_waits_for_them_before_freeing(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    offload = ActivationOffload(store, budget="8MiB", min_bytes=64 * KIB, plan="all")
    x = torch.randn(512, 256, requires_grad=True)
    with sim.hold():
        with offload:
            loss = (x * 2).tanh().sum()
        closing = threading.Thread(target=offload.close)
        closing.start()
        closing.join(0.5)
        assert closing.is_alive()  # waiting for the queued copies
        assert any(owner.startswith("activations") for owner in store.memory.held())
    closing.join(30)
    assert not closing.is_alive()
    assert not any(owner.startswith("activations") for owner in store.memory.held())
    assert all(not stream.queue for stream in sim.copy_streams())
    del loss


# -- host memory first, storage beyond it ---------------------------------------------------------------
def test_captures_go_to_host_memory_first_and_the_oldest_to_storage_beyond_it(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    """Eight saves of 512 KiB through a 2 MiB budget: the oldest are spilled as room is needed, so
    the newest (which backward wants first) stay in host memory."""
    offload = ActivationOffload(store, budget="2MiB", min_bytes=64 * KIB, plan="all")
    weights = [nn.Parameter(torch.randn(512, 256) / 16) for _ in range(8)]
    x = torch.randn(512, 256, requires_grad=True)
    with offload:
        hidden = x
        for weight in weights:
            hidden = (hidden * weight).tanh()
        loss = hidden.sum()
    offload.synchronize()
    spilled = sorted(int(key.rsplit("/", 1)[1]) for key in activation_keys(store))
    assert spilled and spilled == list(range(len(spilled)))  # the oldest ones
    assert offload.stats()["spilled_bytes"] == len(spilled) * 512 * KIB
    loss.backward()  # type: ignore[no-untyped-call]
    expected_x = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    hidden = x
    for weight in weights:
        hidden = (hidden * weight).tanh()
    hidden.sum().backward()  # type: ignore[no-untyped-call]
    assert torch.equal(expected_x, x.grad)  # type: ignore[arg-type]
    assert_all_given_back(offload)


# -- alignment ---------------------------------------------------------------------------------------------
def test_a_tensor_copied_back_keeps_its_address_modulo_512_as_cudas_allocator_gives(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    """A view 400 bytes into its storage, saved: backward's copy of it lies 400 bytes past a
    512-byte boundary too (the capture starts at the device allocator's alignment below it)."""
    seen: list[int] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x * 1

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            seen.append(x.data_ptr() % DEVICE_ALIGN)
            return grad

    offload = ActivationOffload(store, budget="8MiB", min_bytes=64 * KIB, plan="all")
    base = torch.randn(64 * 1024 + 100, requires_grad=True)
    with offload:
        view = (base * 2)[100:]
        out = Probe.apply(view)  # type: ignore[no-untyped-call]  # unannotated in torch
        offload.synchronize()  # its copy out ends: backward copies it back rather than keep it
    out.sum().backward()
    assert offload.stats()["restored_bytes"] > 0
    assert seen == [view.storage_offset() * view.element_size() % DEVICE_ALIGN] == [400]
    assert_all_given_back(offload)


# -- the plan on a device's clock ---------------------------------------------------------------------------
def test_the_lifetime_plan_of_a_device_step_is_timed_on_its_clock(
    store: TierStore, sim: SimulatedModelDevice
) -> None:
    offload = ActivationOffload(store, budget="64MiB", min_bytes=64 * KIB, plan="lifetime")
    expected = stepped_grads(TwoLayers, inputs_of(512, 256), None, steps=4)
    assert_same_gradients(
        expected, device_grads(TwoLayers, inputs_of(512, 256), offload, sim, steps=4, held=False)
    )
    assert offload.stats()["plans_built"] == 1
    explained = offload.plan_explain()
    assert "timed on the device's clock" in explained and "#0" in explained
    assert_all_given_back(offload)


def test_keep_on_device_leaves_the_tensors_whose_round_trip_outlasts_their_lifetime() -> None:
    gigabyte = 10**9
    tensors = [
        SavedTensor(gigabyte, 0.0, 1.0),  # 1 s to live, 0.1 s round trip: copied
        SavedTensor(gigabyte, 0.9, 0.95),  # 0.05 s to live: stays
        SavedTensor(gigabyte, 0.8, 0.85),  # stays, if the budget allows
    ]
    assert keep_on_device(tensors, 20 * gigabyte, 20 * gigabyte, 2 * gigabyte) == [1, 2]
    assert keep_on_device(tensors, 20 * gigabyte, 20 * gigabyte, gigabyte) == [1]
    assert keep_on_device(tensors, 0.0, 20 * gigabyte, 2 * gigabyte) == []  # no measured bus


# -- the step report ----------------------------------------------------------------------------------------
def test_the_report_names_what_each_link_moved(store: TierStore, sim: SimulatedModelDevice) -> None:
    offload = ActivationOffload(store, budget="64MiB", min_bytes=64 * KIB, plan="all")
    assert offload.report() is None
    device_grads(TwoLayers, inputs_of(512, 256), offload, sim, steps=2, held=False)
    report = offload.report()
    assert report is not None and report["clock"] == "device" and report["step"] == 2
    links = {link["name"]: link for link in report["links"]}
    assert links["device -> host"]["bytes"] > 0 and links["device -> host"]["gave_bytes_per_s"] > 0
    assert "device -> host" in report["line"] and "waited" in report["line"]


def test_an_offload_that_cannot_be_hidden_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that writes 4 MB/s and a budget of two captures: forward waits for its writes,
    about 0.6 s a step, several times its compute."""
    slow = {"type": "throttle", "inner": f"nvme://{tmp_path}", "write_bytes_per_s": "4MB"}
    with TierStore([Tier("slow", open_backend(slow))], cache_budget=0) as store:
        offload = ActivationOffload(store, budget="1MiB", min_bytes=64 * KIB, plan="all")
        with caplog.at_level(logging.WARNING, logger="tierstore.activations"):
            stepped_grads(linear_stack, inputs_of(512, 256), offload, steps=2)
            offload.report()
        warned = [r for r in caplog.records if "not hidden" in r.getMessage()]
        assert len(warned) == 1 and "host -> storage" in warned[0].getMessage()
        report = offload.report()
        assert report is not None and not report["hidden"] and report["waited_s"] > 0
        offload.close()


# -- checkpointed regions' inputs only, on a device -----------------------------------------------------
def test_checkpoint_inputs_on_a_device_are_exact(store: TierStore, sim: SimulatedModelDevice) -> None:
    offload = ActivationOffload(
        store, budget="64MiB", min_bytes=16 * KIB, plan="all", scope="checkpoint-inputs"
    )

    def checkpointed() -> nn.Module:
        model = CausalLM("llama")
        enable_checkpointing(model.model)
        return model

    expected = stepped_grads(checkpointed, tokens_of, None, steps=2)
    torch.manual_seed(0)
    model = checkpointed()
    attachment = offload.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    got = []
    for step in range(2):
        torch.manual_seed(100 + step)
        optimizer.zero_grad(set_to_none=True)
        with sim.hold():
            loss = model(tokens_of(step)).float().pow(2).mean()
        loss.backward()
        got.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        optimizer.step()
    attachment.remove()
    assert_same_gradients(expected, got)
    stats = offload.stats()
    assert stats["host_bytes"] > 0 and stats["outside_checkpoint_bytes"] > 0
    assert_all_given_back(offload)
