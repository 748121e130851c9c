"""OffloadedAdamW against torch.optim.AdamW (foreach=False), with its state in real tiers."""

import json
import time
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from tierstore.optimizer import OffloadedAdamW, StaleMasterWeightsError, gradients, partition
from tierstore.optimizer.partition import KERNEL_ALIGNMENT

from tierstore import BufferMismatchError, CapacityError, ConfigError, StoreClosedError, TierStore

from .helpers import (
    PLAIN_LOOP,
    TrainingLoop,
    assert_resume_equals_uninterrupted,
    make_store,
    relative_error,
    train_against_reference,
    train_side_by_side,
    twin_parameters,
)

SHAPES = [(37, 13), (1000,), (7,), (300, 3), (4097,)]  # sizes off every alignment
FP32_STATE = 8
"""Bytes of state per fp32 parameter: its two moments (it is its own master weights)."""


def run_pair(
    store: TierStore,
    *,
    grad_dtype: torch.dtype,
    loop: TrainingLoop = PLAIN_LOOP,
    weight_decay: float = 0.1,
    **options: object,
) -> tuple[OffloadedAdamW, list[torch.nn.Parameter]]:
    model, reference = twin_parameters(SHAPES, grad_dtype)
    optimizer = OffloadedAdamW(
        model,
        store,
        lr=1e-2,
        weight_decay=weight_decay,
        max_grad_norm=loop.max_grad_norm,
        **options,  # type: ignore[arg-type]
    )
    expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=weight_decay, foreach=False)
    train_against_reference(optimizer, model, expected, reference, loop)
    return optimizer, reference


def assert_matches(optimizer: OffloadedAdamW, reference: list[torch.nn.Parameter]) -> None:
    for got, expected in zip(optimizer.master_params(), reference, strict=True):
        assert relative_error(got, expected) <= 1e-6
        torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dram", "nvme"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_policy", ["none", "static", "model"])
def test_matches_torch_adamw(tmp_path: Path, kind: str, grad_dtype: torch.dtype, cache_policy: str) -> None:
    with make_store(tmp_path, kind) as store:
        optimizer, reference = run_pair(
            store,
            grad_dtype=grad_dtype,
            sub_group_size=1500,
            cache_policy=cache_policy,
            dram_budget=12 * 4 * 1500 + 4 * 1500,  # 2 in flight + 2 kept + the gradient buffer
        )
        assert_matches(optimizer, reference)
        assert optimizer.step_count == 20


@pytest.mark.parametrize(("max_grad_norm", "weight_decay"), [(None, 0.0), (1.0, 0.1), (0.01, 0.0)])
def test_clipping_and_weight_decay(tmp_path: Path, max_grad_norm: float | None, weight_decay: float) -> None:
    with make_store(tmp_path, "dram") as store:
        optimizer, reference = run_pair(
            store,
            grad_dtype=torch.bfloat16,
            loop=TrainingLoop(max_grad_norm=max_grad_norm),
            weight_decay=weight_decay,
            sub_group_size=999,
        )
        assert_matches(optimizer, reference)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_gradients_converted_a_small_chunk_at_a_time_match_torch_adamw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_grad_norm: float | None
) -> None:
    """Chunks of 64 elements cut every parameter (and the norm's pieces) at odd places; the DRAM
    budget then reserves a 64-element gradient buffer, not a sub-group's."""
    monkeypatch.setattr(gradients, "GRADIENT_CHUNK", 64)
    with make_store(tmp_path, "nvme") as store:
        optimizer, reference = run_pair(
            store,
            grad_dtype=torch.bfloat16,
            loop=TrainingLoop(steps=5, max_grad_norm=max_grad_norm),
            sub_group_size=1500,
        )
        assert_matches(optimizer, reference)
        assert optimizer.stager.working_bytes == 2 * optimizer.stager.slot_bytes + 4 * 64


def test_parameters_cut_across_sub_groups_and_chunks_match_torchs_fused_adamw_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 parameters of sizes off every alignment, cut by 1000-element sub-groups and 256-element
    gradient chunks: each piece gets the vector lanes it gets in torch's fused kernel over the
    whole parameter (cuts fall on :data:`KERNEL_ALIGNMENT`), so the weights are equal to the bit."""
    monkeypatch.setattr(gradients, "GRADIENT_CHUNK", 256)
    model, reference = twin_parameters(SHAPES, torch.float32)
    with make_store(tmp_path, "dram") as store:
        optimizer = OffloadedAdamW(model, store, lr=1e-2, weight_decay=0.1, sub_group_size=1000)
        cut = [
            piece
            for sg in optimizer.subgroups
            for piece in sg.pieces
            if piece.length < model[piece.param].numel()
        ]
        assert cut and all(piece.param_offset % KERNEL_ALIGNMENT == 0 for piece in cut)
        expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, fused=True)
        train_against_reference(optimizer, model, expected, reference, TrainingLoop(steps=10))
        for got, want in zip(optimizer.master_params(), reference, strict=True):
            assert torch.equal(got, want.detach())


def test_a_step_measures_its_own_compute_time_for_the_io_model(tmp_path: Path) -> None:
    with make_store(tmp_path, "nvme") as store:
        optimizer, _ = run_pair(
            store, grad_dtype=torch.bfloat16, loop=TrainingLoop(steps=1), sub_group_size=1500
        )
        for param in optimizer.params:
            param.grad = torch.ones_like(param)
        started = time.perf_counter()
        optimizer.step()
        wall = time.perf_counter() - started
        assert 0.0 < optimizer.compute_seconds < wall


def test_loss_scaling_skips_overflowing_steps(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        optimizer, reference = run_pair(
            store,
            grad_dtype=torch.float16,
            loop=TrainingLoop(max_grad_norm=1.0, grad_scale=1024.0, overflow_at=7),
            sub_group_size=2000,
        )
        assert optimizer.skipped_steps == 1 and optimizer.step_count == 19
        assert_matches(optimizer, reference)


def test_model_parameters_follow_the_master_weights(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        optimizer, _ = run_pair(
            store, grad_dtype=torch.bfloat16, loop=TrainingLoop(steps=3), sub_group_size=700
        )
        for param, master in zip(optimizer.params, optimizer.master_params(), strict=True):
            assert torch.equal(param.detach(), master.to(torch.bfloat16))


def test_parameters_without_gradients_are_left_alone(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        frozen, trained = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(10))
        optimizer = OffloadedAdamW([frozen, trained], store, sub_group_size=15, weight_decay=0.5)
        trained.grad = torch.ones(10)
        optimizer.step()
        assert torch.equal(frozen.detach(), torch.ones(10))
        assert not torch.equal(trained.detach(), torch.ones(10))


def test_param_groups_keep_their_own_hyperparameters(tmp_path: Path) -> None:
    torch.manual_seed(1)
    a, b = torch.nn.Parameter(torch.randn(500)), torch.nn.Parameter(torch.randn(300))
    ra, rb = (torch.nn.Parameter(p.detach().clone()) for p in (a, b))
    with make_store(tmp_path, "dram") as store:
        groups = [{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.001, "weight_decay": 0.0}]
        optimizer = OffloadedAdamW(groups, store, sub_group_size=256)
        expected = torch.optim.AdamW(
            [{"params": [ra], "lr": 0.1}, {"params": [rb], "lr": 0.001, "weight_decay": 0.0}], foreach=False
        )
        assert {sg.group for sg in optimizer.subgroups} == {0, 1}
        for _ in range(5):
            for p, r in ((a, ra), (b, rb)):
                p.grad = torch.randn(p.shape)
                r.grad = p.grad.clone()
            optimizer.step()
            expected.step()
        for got, want in zip(optimizer.master_params(), (ra, rb), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)


def test_save_load_continue_equals_uninterrupted(tmp_path: Path) -> None:
    def make(params: list[torch.nn.Parameter], store: TierStore, namespace: str) -> OffloadedAdamW:
        budget = 12 * 4 * 1500 + 4 * 1500
        return OffloadedAdamW(params, store, sub_group_size=1500, dram_budget=budget, namespace=namespace)

    checkpoint = assert_resume_equals_uninterrupted(tmp_path, SHAPES, make)
    assert set(checkpoint["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master_param"}


def test_cached_subgroups_skip_their_reads_and_writes(tmp_path: Path) -> None:
    sub_group_size, state_bytes = 1024, FP32_STATE * 1024  # two pages of state per sub-group
    with make_store(tmp_path, "dram") as store:
        params = [torch.nn.Parameter(torch.randn(10 * sub_group_size))]  # 10 sub-groups
        optimizer = OffloadedAdamW(
            params,
            store,
            sub_group_size=sub_group_size,
            prefetch_depth=2,
            dram_budget=5 * state_bytes + 4 * sub_group_size,  # 2 in flight + 3 kept
        )
        tier = store.tiers[0]
        for step in range(4):
            params[0].grad = torch.randn(params[0].shape)
            read, written = tier.bytes_read, tier.bytes_written
            optimizer.step()
            optimizer.stager.wait_writes()  # the step's last write-backs go on after it returns
            moved = ((tier.bytes_read - read) // state_bytes, (tier.bytes_written - written) // state_bytes)
            assert moved == ((10, 7) if step == 0 else (7, 7)), (step, moved)
        assert store.stats()["cache_bytes"] == 0  # the optimizer manages its own DRAM
        held = sum(buffer.numel() * 4 for buffer in optimizer.stager.buffers) + optimizer._grad.numel() * 4
        assert held <= optimizer.stager.dram_budget


def test_bad_configuration(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        param = torch.nn.Parameter(torch.randn(1000))
        with pytest.raises(CapacityError, match="below the working set"):
            OffloadedAdamW([param], store, sub_group_size=1000, dram_budget=1000)
        with pytest.raises(BufferMismatchError, match="contiguous"):
            OffloadedAdamW([torch.nn.Parameter(torch.randn(4, 4).t())], store)
        optimizer = OffloadedAdamW([param], store, sub_group_size=1000, namespace="x")
        param.grad = torch.ones(1000)
        with pytest.raises(ConfigError, match="grad_scale"):
            optimizer.step(grad_scale=0.0)
        with pytest.raises(BufferMismatchError, match="shape"):
            optimizer.load_state_dict(
                {
                    "param_groups": optimizer.state_dict()["param_groups"],
                    "state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)}},
                }
            )


def test_partition_arithmetic() -> None:
    subgroups = partition([[(0, 5), (1, 7)], [(2, 3)]], sub_group_size=4)
    assert [sg.numel for sg in subgroups] == [4, 4, 4, 3]
    assert [sg.group for sg in subgroups] == [0, 0, 0, 1]
    assert subgroups[1].pieces[0].param == 0 and subgroups[1].pieces[1].param == 1
    assert sum(p.length for sg in subgroups for p in sg.pieces) == 15
    with pytest.raises(ValueError):
        partition([[(0, 1)]], 0)


def test_uneven_subgroups_are_kept_by_bytes_within_the_budget(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        large = 1536  # 3 pages of state
        params = [torch.nn.Parameter(torch.randn(n)) for n in (large, 10, 10, 10, 10, 10, 10)]
        groups = OffloadedAdamW(
            [{"params": [p]} for p in params],
            store,
            sub_group_size=large,
            dram_budget=3 * FP32_STATE * large + 4 * large,  # room for one large sub-group beside the ring
            namespace="groups",
        )
        assert len(groups.subgroups) == 7  # one per group: one large, six tiny
        room = groups.stager.dram_budget - groups.stager.working_bytes
        counts = []
        for _ in range(4):
            for param in params:
                param.grad = torch.randn(param.shape)
            groups.step()
            kept = groups.stager.resident.values()
            assert sum(-(-buffer.numel() * 4 // 4096) * 4096 for buffer in kept) <= -(-room // 4096) * 4096
            counts.append(len(kept))
        assert max(counts) == 3  # by bytes, three tiny ones fit where the large one would


def uneven_pass_bytes(tmp_path: Path, cache_policy: str) -> tuple[int, list[torch.Tensor]]:
    """Bytes a step moves in steady state over sub-groups [s, s, s, LARGE, s, s] with room for five
    small ones, and the master weights after 6 steps."""
    small, large = 1024, 4096  # elements: 2 and 8 pages of AdamW state
    with make_store(tmp_path, "dram") as store:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (small, small, small, large, small, small)]
        optimizer = OffloadedAdamW(
            [{"params": [p]} for p in params],
            store,
            sub_group_size=large,
            dram_budget=2 * FP32_STATE * large
            + 4 * large
            + 5 * FP32_STATE * small,  # ring, gradients, 5 small
            cache_policy=cache_policy,  # type: ignore[arg-type]
            namespace=cache_policy,
        )
        moved = 0
        for step in range(6):
            generator = torch.Generator().manual_seed(step)
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            tier = store.tiers[0]
            before = tier.bytes_read + tier.bytes_written
            optimizer.step()
            optimizer.stager.wait_writes()  # the last write-backs run on past the step
            if step >= 2:
                moved += tier.bytes_read + tier.bytes_written - before
        return moved, optimizer.master_params()


def test_the_model_keeps_more_of_uneven_subgroups_than_static_and_moves_fewer_bytes(tmp_path: Path) -> None:
    model_moved, model_result = uneven_pass_bytes(tmp_path, "model")
    static_moved, static_result = uneven_pass_bytes(tmp_path, "static")
    # static stops at the large sub-group (2 or 3 small ones kept, alternately); the model steps
    # over it and keeps all five small ones for good: only the large one moves, 2 x 32 KiB a step
    assert model_moved == 4 * 2 * FP32_STATE * 4096
    assert static_moved > model_moved
    for got, want in zip(model_result, static_result, strict=True):
        assert torch.equal(got, want)  # the policy changes what moves, never the arithmetic


SKIPPING_SHAPES = [(700,), (90, 10), (300,), (50,)]  # sub-groups of 1000: the 90x10 one straddles two


def skipping_grads(step: int) -> list[bool]:
    """Which parameters get a gradient on ``step``: each skips on its own schedule, and the last
    has none until step 3."""
    return [step % 3 != 1, step % 2 == 0, step % 4 != 2, step >= 3]


def train_skipping(
    optimizer: OffloadedAdamW, params: list[torch.nn.Parameter], steps: range, reference: Any = None
) -> None:
    """Steps with the gradients of :func:`skipping_grads` (``None`` elsewhere); ``reference`` (a
    torch AdamW over fp32 copies) takes the same ones."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]
        present = skipping_grads(step)
        for param, grad, has in zip(params, grads, present, strict=True):
            param.grad = grad if has else None
        optimizer.step()
        if reference is not None:
            for param, grad, has in zip(reference.param_groups[0]["params"], grads, present, strict=True):
                param.grad = grad.float() if has else None
            reference.step()


def skipping_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(3)
    return [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in SKIPPING_SHAPES]


@pytest.mark.parametrize("kind", ["dram", "nvme"])
def test_parameters_skipping_steps_match_torch_adamw(tmp_path: Path, kind: str) -> None:
    """torch counts steps per parameter (bias correction) and leaves a parameter without a
    gradient untouched, weight decay included: so does OffloadedAdamW, also within one sub-group
    whose pieces have different counts and for a parameter split across two sub-groups."""
    with make_store(tmp_path, kind) as store:
        params = skipping_params()
        reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        optimizer = OffloadedAdamW(params, store, lr=1e-2, weight_decay=0.1, sub_group_size=1000)
        expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=False)
        assert [[piece.param for piece in sg.pieces] for sg in optimizer.subgroups] == [[0, 1], [1, 2, 3]]
        train_skipping(optimizer, params, range(8), expected)
        torch_steps = [int(expected.state[p]["step"]) if p in expected.state else 0 for p in reference]
        assert optimizer.param_steps == torch_steps == [5, 4, 6, 5]
        assert optimizer.step_count == 8
        assert_matches(optimizer, reference)
        for param, want in zip(params, reference, strict=True):
            assert torch.equal(param.detach(), want.detach().bfloat16())


def test_a_parameter_first_trained_late_starts_its_own_bias_correction(tmp_path: Path) -> None:
    """Two steps without a gradient, then one: the first update has step count 1 (about lr per
    element, as torch's), not 3; and no weight decay before it."""
    with make_store(tmp_path, "dram") as store:
        late, early = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))
        optimizer = OffloadedAdamW([early, late], store, lr=0.1, weight_decay=0.5, sub_group_size=16)
        for step in range(3):
            early.grad = torch.ones(8)
            late.grad = torch.ones(8) if step == 2 else None
            optimizer.step()
            if step < 2:
                assert torch.equal(late.detach(), torch.ones(8))
        assert optimizer.param_steps == [3, 1]
        # step count 1: m_hat / sqrt(v_hat) = 1, so 1 - lr * weight_decay - lr
        torch.testing.assert_close(late.detach(), torch.full((8,), 1 - 0.1 * 0.5 - 0.1), rtol=0, atol=1e-6)


def test_an_overflowing_step_counts_for_no_parameter(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        params = skipping_params()
        optimizer = OffloadedAdamW(params, store, sub_group_size=1000)
        train_skipping(optimizer, params, range(2))
        before = list(optimizer.param_steps)
        params[0].grad = torch.full(params[0].shape, float("inf")).bfloat16()
        params[1].grad = None
        optimizer.step()
        assert optimizer.skipped_steps == 1 and optimizer.param_steps == before


def test_skipping_parameters_save_load_continue_bit_identical(tmp_path: Path) -> None:
    """Per-parameter step counts survive state_dict/load_state_dict and HDF5 snapshots."""
    with make_store(tmp_path, "dram") as store:
        params = skipping_params()
        straight = OffloadedAdamW(params, store, sub_group_size=1000, namespace="straight")
        train_skipping(straight, params, range(8))
        expected = straight.master_params()

    with make_store(tmp_path, "dram") as store:
        params = skipping_params()
        first = OffloadedAdamW(params, store, sub_group_size=1000, namespace="first")
        train_skipping(first, params, range(4))
        checkpoint = first.state_dict()
        first.save_snapshot(tmp_path / "skipping.h5")
        saved_params = [p.detach().clone() for p in params]
    assert [int(checkpoint["state"][i]["step"]) for i in range(4)] == [3, 2, 3, 1]

    with make_store(tmp_path, "nvme") as store:
        params = skipping_params()
        for param, saved in zip(params, saved_params, strict=True):
            param.data.copy_(saved)
        resumed = OffloadedAdamW(params, store, sub_group_size=1000, namespace="dict")
        resumed.load_state_dict(checkpoint)
        assert resumed.param_steps == [3, 2, 3, 1] and resumed.step_count == 4
        train_skipping(resumed, params, range(4, 8))
        for got, want in zip(resumed.master_params(), expected, strict=True):
            assert torch.equal(got, want)

    with make_store(tmp_path, "nvme") as store:
        params = skipping_params()
        resumed = OffloadedAdamW(params, store, sub_group_size=1000, namespace="first")
        resumed.load_snapshot(tmp_path / "skipping.h5")
        assert resumed.param_steps == [3, 2, 3, 1] and resumed.step_count == 4
        train_skipping(resumed, params, range(4, 8))
        for got, want in zip(resumed.master_params(), expected, strict=True):
            assert torch.equal(got, want)


def test_checkpoints_with_one_global_step_still_load(tmp_path: Path) -> None:
    """Before per-parameter counts, every entry held the global count and snapshots had only
    ``step_count``: every parameter gets the global count."""
    with make_store(tmp_path, "dram") as store:
        params = skipping_params()
        optimizer = OffloadedAdamW(params, store, sub_group_size=1000, namespace="old")
        train_skipping(optimizer, params, range(3))
        old_dict = optimizer.state_dict()
        del old_dict["step_count"]
        for entry in old_dict["state"].values():
            entry["step"] = torch.tensor(3.0)
        optimizer.save_snapshot(tmp_path / "old.h5")
        with h5py.File(tmp_path / "old.h5", "r+") as snapshot:
            metadata = json.loads(snapshot.attrs["metadata"])
            del metadata["param_steps"]
            snapshot.attrs["metadata"] = json.dumps(metadata)

        optimizer.load_state_dict(old_dict)
        assert optimizer.param_steps == [3, 3, 3, 3] and optimizer.step_count == 3
        optimizer.param_steps = [0, 0, 0, 0]
        optimizer.load_snapshot(tmp_path / "old.h5")
        assert optimizer.param_steps == [3, 3, 3, 3] and optimizer.step_count == 3


@pytest.mark.parametrize(
    ("option", "values"),
    [
        ("sub_group_size", [0, -5, 2.5, True, "1000"]),
        ("prefetch_depth", [0, -1, 1.5, True, "2"]),
        ("dram_budget", [-1, 1.5, "-1MiB", "lots", True]),
        ("cache_policy", ["lru", None, ["model"]]),
        ("max_grad_norm", [0.0, -1.0, float("nan"), float("inf"), "1", True]),
        ("lr", [-1e-3, float("nan"), float("inf"), "1e-3", None, True]),
        ("eps", [-1e-8, float("nan"), "1e-8"]),
        ("weight_decay", [-0.1, float("nan"), "0.01", None]),
        ("betas", [(0.9,), (0.9, 0.999, 0.5), (1.0, 0.999), (0.9, -0.1), "ab", (0.9, float("nan")), 0.9]),
        ("namespace", ["", "/abs", "a/../b", "bad\x00name", "del\x7f", "nel\x85", "trailing/", None, 7]),
        ("amsgrad", [1, None, "yes"]),
        ("maximize", [0, None]),
        ("compute_threads", [0, -1, 1.5, True, "1"]),
    ],
)
def test_bad_constructor_arguments_name_the_field(tmp_path: Path, option: str, values: list[object]) -> None:
    with make_store(tmp_path, "dram") as store:
        for value in values:
            with pytest.raises(ConfigError, match=f"^{option}: "):
                options: dict[str, Any] = {option: value}  # wrong on purpose: the runtime check is tested
                OffloadedAdamW([torch.nn.Parameter(torch.randn(100))], store, **options)


@pytest.mark.parametrize(("compute_threads", "during"), [(None, 1), (1, 1), (2, 2)])
def test_a_step_runs_its_kernels_on_compute_threads_and_restores_torchs_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compute_threads: int | None, during: int
) -> None:
    """By default one core is left to the I/O threads (2 -> 1); the setting is torch's again after
    the step, even one that raised."""
    seen: list[int] = []
    update = OffloadedAdamW._update

    def spy(self: OffloadedAdamW, *args: Any) -> None:
        seen.append(torch.get_num_threads())
        update(self, *args)

    monkeypatch.setattr(OffloadedAdamW, "_update", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with make_store(tmp_path, "dram") as store:
            param = torch.nn.Parameter(torch.randn(100))
            optimizer = OffloadedAdamW([param], store, compute_threads=compute_threads)
            param.grad = torch.ones(100)
            optimizer.step()
            assert seen == [during] and torch.get_num_threads() == 2
            monkeypatch.setattr(OffloadedAdamW, "_update", lambda *args: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                optimizer.step()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_first_reads_of_a_step_are_issued_before_the_gradient_norm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The norm is a full pass over the gradients: the disk works meanwhile. A skipped (overflowing)
    step drops the reads it issued and changes nothing."""
    events: list[str] = []
    with make_store(tmp_path, "nvme") as store:
        params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(4)]
        optimizer = OffloadedAdamW(params, store, sub_group_size=1000, cache_policy="none")
        get, coefficient = store.get, OffloadedAdamW._gradient_coefficient

        def noted_get(*args: Any, **kwargs: Any) -> Any:
            events.append("read")
            return get(*args, **kwargs)

        def noted_coefficient(self: OffloadedAdamW, grad_scale: float) -> float | None:
            events.append("norm")
            return coefficient(self, grad_scale)

        monkeypatch.setattr(store, "get", noted_get)
        monkeypatch.setattr(OffloadedAdamW, "_gradient_coefficient", noted_coefficient)
        for param in params:
            param.grad = torch.ones(1000)
        optimizer.step()
        assert events[:3] == ["read", "read", "norm"]
        before = [p.detach().clone() for p in params]
        params[0].grad = torch.full((1000,), float("inf"))
        optimizer.step()
        assert optimizer.skipped_steps == 1 and all(
            torch.equal(p, b) for p, b in zip(params, before, strict=True)
        )
        params[0].grad = torch.ones(1000)
        optimizer.step()
        assert optimizer.step_count == 2


def test_bad_parameter_group_hyperparameters_name_the_group(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        groups: list[dict[str, Any]] = [
            {"params": [torch.nn.Parameter(torch.randn(10))]},
            {"params": [torch.nn.Parameter(torch.randn(10))], "lr": -1.0},
        ]
        with pytest.raises(ConfigError, match=r"^param_groups\.1\.lr: "):
            OffloadedAdamW(groups, store)


def test_a_pooled_subgroup_grows_into_a_larger_buffer_keeping_its_values(tmp_path: Path) -> None:
    """The DeepSpeed swapper's first step: a sub-group read as master weights only, resized once the
    optimizer has created its moments; a kept (pool) buffer of the old size must not lose them."""
    from tierstore.optimizer.subgroup_stager import SubGroupStager

    with make_store(tmp_path, "dram") as store:
        stager = SubGroupStager(store, "grow", slot_elements=3 * 4096, dram_budget=1 << 20)
        stager.write("a", 4096, lambda state: state.copy_(torch.arange(4096.0)))
        stager.wait_writes()
        for _ in range(2):  # the second pass finds it kept, in a pool buffer of 4096 values
            stager.begin_pass(["a"], {"a": 4096})
            state = stager.acquire("a")
            grown = stager.resize("a", 3 * 4096)
            assert torch.equal(grown[:4096], torch.arange(4096.0))
            grown[4096:].fill_(7.0)
            stager.release("a")
            stager.end_pass()
            assert "a" in stager.resident
            assert torch.equal(stager.read("a")[4096:], torch.full((2 * 4096,), 7.0))
            del state


def twins(shapes: list[tuple[int, ...]]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    torch.manual_seed(1)
    model = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    return model, [torch.nn.Parameter(p.detach().clone()) for p in model]


def test_two_optimizers_on_one_store_never_share_a_namespace(tmp_path: Path) -> None:
    """A GAN's generator and discriminator on one store: with default arguments the second is
    refused, naming the namespace, instead of the two overwriting each other's state; each in a
    namespace of its own trains as torch does; a namespace comes free when its holder closes or is
    garbage collected."""
    from tierstore.optimizer import OffloadedAPOLLO

    from tierstore import NamespaceInUseError

    with make_store(tmp_path, "nvme") as store:
        generator, generator_twin = twins([(300,), (17, 5)])
        discriminator, discriminator_twin = twins([(300,), (40,)])
        first = OffloadedAdamW(generator, store, sub_group_size=200)
        with pytest.raises(NamespaceInUseError, match=r"'adamw'.*OffloadedAdamW"):
            OffloadedAdamW(discriminator, store, sub_group_size=200)
        with pytest.raises(NamespaceInUseError, match="'adamw'"):
            OffloadedAPOLLO(discriminator, store, namespace="adamw")
        OffloadedAPOLLO(discriminator, store)  # its own default namespace, "apollo"
        first.close()
        with pytest.raises(StoreClosedError):
            first.step()

        g = OffloadedAdamW(generator, store, sub_group_size=200, namespace="g")
        d = OffloadedAdamW(discriminator, store, sub_group_size=200, namespace="d")
        assert store.namespaces.claimed() == {"d": "OffloadedAdamW", "g": "OffloadedAdamW"}
        for optimizer, model, twin in (
            (g, generator, generator_twin),
            (d, discriminator, discriminator_twin),
        ):
            expected = torch.optim.AdamW(twin, lr=1e-3, weight_decay=1e-2, foreach=False)
            train_side_by_side(optimizer, model, expected, twin, range(4))
        for optimizer, twin in ((g, generator_twin), (d, discriminator_twin)):
            for got, want in zip(optimizer.master_params(), twin, strict=True):
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        del g
        assert "g" not in store.namespaces.claimed()
        OffloadedAdamW(generator, store, sub_group_size=200, namespace="g")


def test_a_snapshot_is_loaded_only_into_the_namespace_that_saved_it(tmp_path: Path) -> None:
    """Its objects are keys of that namespace, which another workload on the store may hold."""
    with make_store(tmp_path, "dram") as store:
        params, _ = twins([(100,)])
        first = OffloadedAdamW(params, store, namespace="first")
        first.save_snapshot(tmp_path / "first.h5")
        other = OffloadedAdamW(params, store, namespace="other")
        before = store["first/0"].clone()
        first.step_count = 7
        with pytest.raises(BufferMismatchError, match=r"'first/0'.*namespace 'other'"):
            other.load_snapshot(tmp_path / "first.h5")
        assert torch.equal(store["first/0"], before)


@pytest.mark.parametrize("sub_group_size", [64, 1000])
def test_groups_added_after_construction_are_trained_and_saved(tmp_path: Path, sub_group_size: int) -> None:
    """As torch.optim.AdamW.add_param_group: the group is updated from then on and is in the state
    dict; a group larger than any before grows the staging buffers (no budget given), or is a
    CapacityError within a budget too small for it."""
    with make_store(tmp_path, "nvme") as store:
        model, reference = twins([(50,), (7, 3), (400,), (33,)])
        optimizer = OffloadedAdamW(model[:2], store, sub_group_size=sub_group_size, weight_decay=0.0)
        expected = torch.optim.AdamW(reference[:2], weight_decay=0.0, foreach=False)
        train_side_by_side(optimizer, model[:2], expected, reference[:2], range(2))
        optimizer.add_param_group({"params": model[2:], "lr": 3e-3, "betas": (0.8, 0.99)})
        expected.add_param_group({"params": reference[2:], "lr": 3e-3, "betas": (0.8, 0.99)})
        train_side_by_side(optimizer, model, expected, reference, range(2, 6))
        for got, want in zip(optimizer.master_params(), reference, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        state = optimizer.state_dict()
        assert sorted(state["state"]) == [0, 1, 2, 3] and int(state["state"][3]["step"]) == 4
        assert state["param_groups"][1]["params"] == [2, 3] and state["param_groups"][1]["lr"] == 3e-3
        torch.testing.assert_close(state["state"][2]["exp_avg"], expected.state[reference[2]]["exp_avg"])

        tight = OffloadedAdamW(model[:1], store, sub_group_size=1000, dram_budget=2048, namespace="tight")
        with pytest.raises(CapacityError, match="added sub-groups"):
            tight.add_param_group({"params": model[2:3]})
        assert len(tight.param_groups) == 1 and len(tight.params) == 1  # nothing changed


def test_amsgrad_and_maximize_match_torch_adamw(tmp_path: Path) -> None:
    """As group keys or constructor arguments; amsgrad's running maximum is a fourth of state,
    counted in the working set and saved in the state dict."""
    with make_store(tmp_path, "nvme") as store:
        model, reference = twins([(300,), (17, 5), (60,)])
        groups: list[dict[str, Any]] = [
            {"params": model[:2], "amsgrad": True, "maximize": True},
            {"params": model[2:]},
        ]
        optimizer = OffloadedAdamW(
            groups,
            store,
            sub_group_size=128,
            maximize=False,
        )
        expected = torch.optim.AdamW(
            [{**groups[0], "params": reference[:2]}, {"params": reference[2:]}], foreach=False
        )
        train_side_by_side(optimizer, model, expected, reference, range(6))
        for got, want in zip(optimizer.master_params(), reference, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        # fp32 parameters: the moments, and the running maximum in the amsgrad group
        assert [optimizer.state_numel(sg) // sg.numel for sg in optimizer.subgroups] == [3, 3, 3, 3, 2]
        assert optimizer.stager.slot_bytes == 4 * 3 * 128
        state = optimizer.state_dict()["state"]
        torch.testing.assert_close(state[1]["max_exp_avg_sq"], expected.state[reference[1]]["max_exp_avg_sq"])
        assert "max_exp_avg_sq" not in state[2]

        single = OffloadedAdamW(model[2:], store, amsgrad=True, maximize=True, namespace="single")
        assert single.param_groups[0]["amsgrad"] and single.param_groups[0]["maximize"]
        optimizer.param_groups[1]["amsgrad"] = True  # the state has no room for it
        with pytest.raises(ConfigError, match=r"param_groups\.1\.amsgrad"):
            optimizer.step()
        optimizer.param_groups[1]["amsgrad"] = False
        saved = optimizer.state_dict()
        saved["param_groups"][0]["amsgrad"] = False
        with pytest.raises(BufferMismatchError, match=r"param_groups\.0\.amsgrad"):
            optimizer.load_state_dict(saved)


def test_a_parameter_listed_twice_is_refused(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        param = torch.nn.Parameter(torch.randn(10))
        with pytest.raises(ConfigError, match=r"param_groups\.0\.params: .*listed twice"):
            OffloadedAdamW([param, param], store)
        optimizer = OffloadedAdamW([torch.nn.Parameter(torch.randn(3))], store)
        with pytest.raises(ConfigError, match=r"param_groups\.1\.params: .*listed twice"):
            optimizer.add_param_group({"params": [param, param]})
        assert len(optimizer.param_groups) == 1


def test_a_sparse_gradient_is_refused_naming_the_parameter(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        embedding = torch.nn.Embedding(10, 4, sparse=True)
        other = torch.nn.Parameter(torch.randn(5))
        optimizer = OffloadedAdamW([other, embedding.weight], store)
        embedding(torch.tensor([1, 2])).sum().backward()
        other.grad = torch.ones(5)
        before = [p.detach().clone() for p in (other, embedding.weight)]
        with pytest.raises(
            BufferMismatchError, match=r"parameter 1 \(shape \(10, 4\)\) has a torch.sparse_coo"
        ):
            optimizer.step()
        assert all(torch.equal(p, b) for p, b in zip((other, embedding.weight), before, strict=True))
        assert optimizer.step_count == 0 and torch.equal(optimizer.master_params()[0], before[0])


# -- master weights, and state dicts that go through torch's AdamW ----------------------------------
def torch_fused(params: list[torch.nn.Parameter] | list[dict[str, Any]], **options: Any) -> torch.optim.AdamW:
    """torch's AdamW on the fused kernel, OffloadedAdamW's arithmetic."""
    return torch.optim.AdamW(params, fused=True, **options)


def test_fp32_parameters_are_their_own_master_weights(tmp_path: Path) -> None:
    """No copy of an fp32 parameter in the state (8 bytes per parameter, no master_param in the
    state dict): weights the model is given outside the optimizer are the ones the next step
    updates, as with torch's AdamW, instead of being reverted to a stored master."""
    with make_store(tmp_path, "dram") as store:
        model, reference = twins([(4, 4), (4,)])
        optimizer = OffloadedAdamW(model, store, lr=0.1, sub_group_size=8)
        expected = torch_fused(reference, lr=0.1)
        assert [optimizer.state_numel(sg) for sg in optimizer.subgroups] == [
            2 * sg.numel for sg in optimizer.subgroups
        ]
        train_side_by_side(optimizer, model, expected, reference, range(3), exact=True)
        assert all("master_param" not in entry for entry in optimizer.state_dict()["state"].values())
        with torch.no_grad():  # e.g. model.load_state_dict after the optimizer was built
            for param, twin in zip(model, reference, strict=True):
                param.add_(1.0)
                twin.add_(1.0)
        train_side_by_side(optimizer, model, expected, reference, range(3, 5), exact=True)
        for master, param in zip(optimizer.master_params(), model, strict=True):
            assert torch.equal(master, param.detach())


def test_a_state_dict_through_torchs_fused_adamw_and_back_continues_bit_for_bit(tmp_path: Path) -> None:
    """OffloadedAdamW -> torch.optim.AdamW(fused=True) -> OffloadedAdamW, each continuing from the
    other's state dict: torch stays on its fused kernel (the groups say fused=True) and the weights
    equal torch's fused AdamW trained straight through, to the bit, at every step: no fp32 master
    weights go out with the state to come back stale (torch carries the entries it does not know
    along unchanged while it trains)."""
    shapes = [(37, 13), (1000,), (4, 4), (300, 3)]
    with make_store(tmp_path, "dram") as store:
        model, straight = twins(shapes)
        hyper: dict[str, Any] = {"lr": 0.1, "betas": (0.8, 0.99), "weight_decay": 0.1}
        groups: list[dict[str, Any]] = [
            {"params": model[:2]},
            {"params": model[2:], "amsgrad": True, "weight_decay": 0.0},
        ]
        ours = OffloadedAdamW(groups, store, sub_group_size=640, **hyper)
        expected = torch_fused(
            [{**groups[0], "params": straight[:2]}, {**groups[1], "params": straight[2:]}], **hyper
        )
        train_side_by_side(ours, model, expected, straight, range(3), exact=True)

        theirs = torch_fused([{"params": model[:2]}, {"params": model[2:]}])
        theirs.load_state_dict(ours.state_dict())
        assert [group["fused"] for group in theirs.param_groups] == [True, True]
        assert set(theirs.param_groups[0]) == set(expected.param_groups[0])
        train_side_by_side(theirs, model, expected, straight, range(3, 6), exact=True)

        ours.load_state_dict(theirs.state_dict())
        train_side_by_side(ours, model, expected, straight, range(6, 9), exact=True)
        assert ours.param_steps == [9, 9, 9, 9]


def test_our_state_dict_from_torchs_fused_adamw_continues_bit_for_bit(tmp_path: Path) -> None:
    """torch.optim.AdamW(fused=True)'s state dict (no master weights) into a fresh OffloadedAdamW:
    the model's weights are the masters, and it continues as torch would."""
    with make_store(tmp_path, "nvme") as store:
        model, straight = twins([(37, 13), (1000,)])
        first = torch_fused(model, lr=1e-2)
        expected = torch_fused(straight, lr=1e-2)
        train_side_by_side(first, model, expected, straight, range(4), exact=True)
        ours = OffloadedAdamW(model, store, lr=0.5, sub_group_size=256)  # the dict's lr is taken
        ours.load_state_dict(first.state_dict())
        assert ours.param_groups[0]["lr"] == 1e-2 and ours.param_groups[0]["fused"] is True
        train_side_by_side(ours, model, expected, straight, range(4, 8), exact=True)


def test_stale_master_weights_of_a_bf16_model_are_refused(tmp_path: Path) -> None:
    """A bf16 model's state dict through torch's AdamW: torch carries master_param along (rounded
    to bf16) while it trains, so the masters no longer belong to the model's weights. Loading it
    back is a StaleMasterWeightsError naming what to do, nothing restored; without master_param
    the model's weights are the masters, and the next step starts from them."""
    torch.manual_seed(2)
    model = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in [(4, 4), (300,)]]
    with make_store(tmp_path, "dram") as store:
        ours = OffloadedAdamW(model, store, lr=0.1, sub_group_size=128)
        for step in range(3):
            for param in model:
                param.grad = torch.randn(
                    param.shape, generator=torch.Generator().manual_seed(step)
                ).bfloat16()
            ours.step()
        saved = ours.state_dict()
        assert all(entry["master_param"].dtype == torch.float32 for entry in saved["state"].values())
        theirs = torch_fused(model, lr=0.1)
        theirs.load_state_dict(saved)
        for step in range(3, 6):
            for param in model:
                param.grad = torch.randn(
                    param.shape, generator=torch.Generator().manual_seed(step)
                ).bfloat16()
            theirs.step()
        current = [param.detach().clone() for param in model]
        before = ours.state_dict()
        with pytest.raises(
            StaleMasterWeightsError, match=r"parameter 0 \(shape \(4, 4\)\).*drop 'master_param'"
        ):
            ours.load_state_dict(theirs.state_dict())
        assert isinstance(StaleMasterWeightsError("x"), BufferMismatchError)
        after = ours.state_dict()  # nothing restored
        assert ours.param_steps == [3, 3]
        for entry, was in zip(after["state"].values(), before["state"].values(), strict=True):
            assert all(torch.equal(entry[part], was[part]) for part in was)

        dropped = theirs.state_dict()
        for entry in dropped["state"].values():
            del entry["master_param"]
        ours.load_state_dict(dropped)
        for master, weights in zip(ours.master_params(), current, strict=True):
            assert torch.equal(master, weights.float())
        for param in model:
            param.grad = torch.randn(param.shape).bfloat16()
        ours.step()
        for param, was in zip(model, current, strict=True):  # one step of about lr, not a revert
            assert float((param.detach().float() - was.float()).abs().max()) <= 0.1 * 1.2

        consistent = ours.state_dict()  # its masters belong to the model's weights: accepted
        ours.load_state_dict(consistent)


def test_a_group_mixing_fp32_and_bf16_parameters(tmp_path: Path) -> None:
    """The group's state has a master row (for its bf16 parameter); the fp32 one is updated in
    place as torch's fused AdamW updates it, to the bit, and has no master_param in the state dict."""
    torch.manual_seed(3)
    norm, weight = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(200).bfloat16())
    twin = torch.nn.Parameter(norm.detach().clone())
    with make_store(tmp_path, "dram") as store:
        ours = OffloadedAdamW([norm, weight], store, lr=1e-2, sub_group_size=128)
        expected = torch_fused([twin], lr=1e-2)
        assert [ours.state_numel(sg) // sg.numel for sg in ours.subgroups] == [3, 3, 3]
        for step in range(4):
            generator = torch.Generator().manual_seed(step)
            norm.grad = torch.randn(100, generator=generator)
            weight.grad = torch.randn(200, generator=generator).bfloat16()
            twin.grad = norm.grad.clone()
            ours.step()
            expected.step()
        assert torch.equal(norm.detach(), twin.detach())
        masters = ours.master_params()
        assert torch.equal(masters[1].bfloat16(), weight.detach()) and not torch.equal(
            masters[1], weight.float()
        )
        state = ours.state_dict()["state"]
        assert "master_param" not in state[0] and "master_param" in state[1]


def test_a_parameter_whose_dtype_changes_after_its_group_was_added_is_refused(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        layer = torch.nn.Linear(4, 4)
        optimizer = OffloadedAdamW(layer.parameters(), store)
        layer.bfloat16()  # the same Parameter objects, bf16 now
        layer(torch.randn(2, 4).bfloat16()).sum().backward()
        with pytest.raises(ConfigError, match=r"parameter 0 \(shape \(4, 4\)\) is torch.bfloat16 now"):
            optimizer.step()


def test_a_snapshot_of_another_master_layout_is_refused(tmp_path: Path) -> None:
    """A snapshot holding fp32 master weights for parameters that are fp32 here (from a bf16 model,
    or one without ``own_masters``, which holds master weights for every parameter) is laid out
    differently: refused, never misread. A snapshot of fp32 parameters holds no weights: the model
    keeps its own."""
    with make_store(tmp_path, "dram") as store:
        bf16 = [torch.nn.Parameter(torch.randn(300).bfloat16())]
        OffloadedAdamW(bf16, store, namespace="n").save_snapshot(tmp_path / "bf16.h5")
    with make_store(tmp_path, "dram") as store:
        fp32, _ = twins([(300,)])
        optimizer = OffloadedAdamW(fp32, store, namespace="n")
        with pytest.raises(BufferMismatchError, match=r"other dtypes.*parameters \[0\]"):
            optimizer.load_snapshot(tmp_path / "bf16.h5")
        optimizer.save_snapshot(tmp_path / "fp32.h5")
        with h5py.File(tmp_path / "fp32.h5", "r+") as snapshot:  # master weights for every parameter
            metadata = json.loads(snapshot.attrs["metadata"])
            del metadata["own_masters"]
            snapshot.attrs["metadata"] = json.dumps(metadata)
        with pytest.raises(BufferMismatchError, match="other dtypes"):
            optimizer.load_snapshot(tmp_path / "fp32.h5")
        optimizer.save_snapshot(tmp_path / "fp32.h5")
        with torch.no_grad():
            fp32[0].fill_(7.0)
        optimizer.load_snapshot(tmp_path / "fp32.h5")
        assert torch.equal(fp32[0].detach(), torch.full((300,), 7.0))


def test_decoupled_weight_decay_false_is_torchs_l2_weight_decay(tmp_path: Path) -> None:
    """A group with decoupled_weight_decay=False gets L2 weight decay (added to the gradient), as in
    torch's AdamW and torch.optim.Adam(fused=True): equal to both to the bit."""
    with make_store(tmp_path, "dram") as store:
        model, reference = twins([(37, 13), (300,)])
        adam = [torch.nn.Parameter(p.detach().clone()) for p in model[:1]]
        groups: list[dict[str, Any]] = [
            {"params": model[:1], "decoupled_weight_decay": False, "weight_decay": 0.5},
            {"params": model[1:]},
        ]
        ours = OffloadedAdamW(groups, store, lr=1e-2, weight_decay=0.1, sub_group_size=256)
        expected = torch_fused(
            [{**groups[0], "params": reference[:1]}, {"params": reference[1:]}], lr=1e-2, weight_decay=0.1
        )
        torch_adam = torch.optim.Adam(adam, lr=1e-2, weight_decay=0.5, fused=True)
        for step in range(6):
            generator = torch.Generator().manual_seed(step)
            for param, twin in zip(model, reference, strict=True):
                param.grad = torch.randn(param.shape, generator=generator)
                twin.grad = param.grad.clone()
            adam[0].grad = reference[0].grad
            for optimizer in (ours, expected, torch_adam):
                optimizer.step()
        assert torch.equal(model[0].detach(), reference[0].detach())
        assert torch.equal(model[0].detach(), adam[0].detach())
        assert torch.equal(model[1].detach(), reference[1].detach())
        assert ours.state_dict()["param_groups"][0]["decoupled_weight_decay"] is False


@pytest.mark.parametrize(
    ("key", "refused", "accepted"),
    [
        ("foreach", [True, 1, "no"], [None, False]),
        ("fused", [False, 0, "yes"], [None, True]),
        ("capturable", [True, None], [False]),
        ("differentiable", [True, None], [False]),
        ("decoupled_weight_decay", [None, 1], [True, False]),
    ],
)
def test_every_key_of_torchs_adamw_is_honoured_or_refused(
    tmp_path: Path, key: str, refused: list[object], accepted: list[object]
) -> None:
    """As a constructor argument (where torch's AdamW has one), a group key, an added group's key
    or a key changed before a step: a kernel other than torch's fused AdamW is a ConfigError naming
    the key. The groups say fused=True, the kernel they run; a loaded state dict's implementation
    keys describe its saver's kernel and are not taken."""
    with make_store(tmp_path, "dram") as store:
        param, other = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
        for value in refused:
            if key != "decoupled_weight_decay":  # not an argument of torch's AdamW
                arguments: dict[str, Any] = {key: value}  # wrong on purpose: the runtime check is tested
                with pytest.raises(ConfigError, match=f"^{key}: "):
                    OffloadedAdamW([param], store, **arguments)
            groups: list[dict[str, Any]] = [{"params": [param]}, {"params": [other], key: value}]
            with pytest.raises(ConfigError, match=rf"^param_groups\.1\.{key}: "):
                OffloadedAdamW(groups, store)
        optimizer = OffloadedAdamW([param], store, namespace="added")
        for value in refused:
            with pytest.raises(ConfigError, match=rf"^param_groups\.1\.{key}: "):
                optimizer.add_param_group({"params": [other], key: value})
        assert len(optimizer.param_groups) == 1
        param.grad = torch.ones(10)
        optimizer.param_groups[0][key] = refused[0]
        with pytest.raises(ConfigError, match=rf"^param_groups\.0\.{key}: "):
            optimizer.step()
        for value in accepted:
            optimizer.param_groups[0][key] = value
            optimizer.step()
            assert optimizer.param_groups[0]["fused"] is True
        optimizer.close()

        torch_groups = torch.optim.AdamW([param], foreach=True).state_dict()["param_groups"]
        ours = OffloadedAdamW([param], store, namespace="loaded")
        assert set(ours.state_dict()["param_groups"][0]) == set(torch_groups[0])
        ours.load_state_dict({"state": {}, "param_groups": torch_groups})
        assert ours.param_groups[0]["foreach"] is None and ours.param_groups[0]["fused"] is True
