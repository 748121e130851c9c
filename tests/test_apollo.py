"""OffloadedAPOLLO against apollo_torch.APOLLOAdamW (the official implementation), state in real tiers."""

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.optimizer import OffloadedAdamW, OffloadedAPOLLO, partition_whole

from tierstore import BufferMismatchError, ConfigError, TierStore

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

MATRICES = [(37, 13), (13, 40), (64, 64), (5, 300)]  # tall, wide, square, one larger than a sub-group
VECTORS = [(50,), (7,)]  # biases and norms: AdamW


def reference_optimizer() -> Any:
    """``apollo_torch.APOLLOAdamW``. Its package ``__init__`` imports bitsandbytes and transformers for
    its other optimizers; APOLLOAdamW needs neither (transformers only for a torch version check), so
    its three modules are loaded alone, with that check stubbed while they load."""
    spec = importlib.util.find_spec("apollo_torch")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("apollo-torch is not installed (make test installs it with --no-deps)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if "_apollo_reference.apollo" not in sys.modules:
        stubs = {}
        if importlib.util.find_spec("transformers") is None:
            versions = types.ModuleType("transformers.utils.versions")
            versions.require_version = lambda *_: None  # type: ignore[attr-defined]
            stubs = {
                "transformers": types.ModuleType("transformers"),
                "transformers.utils": types.ModuleType("transformers.utils"),
                "transformers.utils.versions": versions,
            }
        package = types.ModuleType("_apollo_reference")
        package.__path__ = [str(folder)]
        sys.modules.update(stubs)
        sys.modules["_apollo_reference"] = package
        try:
            for name in ("svd_projector", "random_projector", "apollo"):
                module_spec = importlib.util.spec_from_file_location(
                    f"_apollo_reference.{name}", folder / f"{name}.py"
                )
                assert module_spec is not None and module_spec.loader is not None
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[module_spec.name] = module
                module_spec.loader.exec_module(module)
        finally:
            for name in stubs:
                del sys.modules[name]
    return sys.modules["_apollo_reference.apollo"].AdamW


def groups(params: list[torch.nn.Parameter], projection: dict[str, Any]) -> list[dict[str, Any]]:
    """The reference's usual split: matrices get APOLLO, vectors AdamW."""
    return [
        {"params": params[: len(MATRICES)], **projection},
        {"params": params[len(MATRICES) :]},
    ]


def run_pair(
    store: TierStore, projection: dict[str, Any], loop: TrainingLoop = PLAIN_LOOP, **options: Any
) -> tuple[OffloadedAPOLLO, list[torch.nn.Parameter]]:
    model, reference = twin_parameters([*MATRICES, *VECTORS], torch.bfloat16)
    optimizer = OffloadedAPOLLO(
        groups(model, projection),
        store,
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=loop.max_grad_norm,
        **options,
    )
    expected = reference_optimizer()(groups(reference, projection), lr=1e-2, weight_decay=0.1)
    train_against_reference(optimizer, model, expected, reference, loop, overflow_element=(2, 3, 4))
    return optimizer, reference


def assert_matches(optimizer: OffloadedAPOLLO, reference: list[torch.nn.Parameter]) -> None:
    for got, want in zip(optimizer.master_params(), reference, strict=True):
        assert relative_error(got, want) <= 1e-5
    for param, want in zip(optimizer.params, reference, strict=True):  # the model follows
        assert relative_error(param.float(), want) <= 1e-2


PROJECTION = {"proj": "random", "proj_type": "std"}  # apollo_torch requires every key
MINI = {**PROJECTION, "rank": 1, "scale_type": "tensor", "scale": 128.0, "update_proj_gap": 5}
RANK4_CHANNEL = {**PROJECTION, "rank": 4, "scale_type": "channel", "scale": 1.0, "update_proj_gap": 7}


@pytest.mark.parametrize("kind", ["dram", "nvme"])
@pytest.mark.parametrize("projection", [MINI, RANK4_CHANNEL], ids=["mini", "rank4-channel"])
def test_matches_apollo_torch(tmp_path: Path, kind: str, projection: dict[str, Any]) -> None:
    with make_store(tmp_path, kind) as store:
        optimizer, reference = run_pair(store, projection, sub_group_size=1000, dram_budget=1 << 20)
        assert optimizer.step_count == 20
        assert_matches(optimizer, reference)


@pytest.mark.parametrize("projection", [MINI, RANK4_CHANNEL], ids=["mini", "rank4-channel"])
def test_clipping_and_loss_scaling_skip_an_overflow(tmp_path: Path, projection: dict[str, Any]) -> None:
    with make_store(tmp_path, "dram") as store:
        loop = TrainingLoop(max_grad_norm=1.0, grad_scale=1024.0, overflow_at=7)
        optimizer, reference = run_pair(store, projection, loop, sub_group_size=2000)
        assert optimizer.skipped_steps == 1 and optimizer.step_count == 19
        assert_matches(optimizer, reference)


@pytest.mark.parametrize(
    "options",
    [{"scale_front": True}, {"disable_nl": True}, {"correct_bias": False}],
    ids=["scale-front", "no-limiter", "no-bias-correction"],
)
def test_the_reference_flags(tmp_path: Path, options: dict[str, Any]) -> None:
    reference_class = reference_optimizer()
    torch.manual_seed(1)
    model = [torch.nn.Parameter(torch.randn(shape)) for shape in MATRICES + VECTORS]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in model]
    group_keys = {"correct_bias": options["correct_bias"]} if "correct_bias" in options else {}
    flags = {k: v for k, v in options.items() if k != "correct_bias"}
    with make_store(tmp_path, "dram") as store:
        optimizer = OffloadedAPOLLO(
            groups(model, {**RANK4_CHANNEL, **group_keys}), store, lr=1e-2, sub_group_size=500, **flags
        )
        expected = reference_class(groups(reference, {**RANK4_CHANNEL, **group_keys}), lr=1e-2, **flags)
        for _ in range(10):
            for param, twin in zip(model, reference, strict=True):
                param.grad = torch.randn(param.shape)
                twin.grad = param.grad.clone()
            optimizer.step()
            expected.step()
        for got, want in zip(optimizer.master_params(), reference, strict=True):
            assert relative_error(got, want) <= 1e-5


def test_save_load_continue_equals_uninterrupted(tmp_path: Path) -> None:
    projection = {**MINI, "update_proj_gap": 3}  # refreshes before and after the resume point

    def make(params: list[torch.nn.Parameter], store: TierStore, namespace: str) -> OffloadedAPOLLO:
        return OffloadedAPOLLO(
            groups(params, projection), store, sub_group_size=1000, dram_budget=1 << 18, namespace=namespace
        )

    checkpoint = assert_resume_equals_uninterrupted(tmp_path, [*MATRICES, *VECTORS], make)
    assert set(checkpoint["state"][0]) == {
        "step",
        "exp_avg",
        "exp_avg_sq",
        "master_param",
        "seed",
        "scaled_grad",
    }
    assert checkpoint["state"][0]["exp_avg"].shape == (37, 1)  # rank 1: the moments are low-rank
    assert set(checkpoint["state"][len(MATRICES)]) == {"step", "exp_avg", "exp_avg_sq", "master_param"}


def test_a_restore_with_another_rank_is_refused(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in MATRICES + VECTORS]
        mini = OffloadedAPOLLO(groups(params, MINI), store, namespace="one")
        rank4 = OffloadedAPOLLO(groups(params, {**MINI, "rank": 4}), store, namespace="two")
        with pytest.raises(BufferMismatchError, match=r"param_groups\.0\.rank"):
            rank4.load_state_dict(mini.state_dict())


def test_apollo_mini_moves_a_third_of_adamws_bytes(tmp_path: Path) -> None:
    """A bf16 model: both keep fp32 master weights in the state."""
    shapes = [(256, 256), (256, 1024), (1024, 256), (256,)]

    def bytes_per_step(make: Any) -> int:
        with make_store(tmp_path, "dram") as store:
            params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in shapes]
            optimizer = make(params, store)
            tier = store.tiers[0]
            for param in params:
                param.grad = torch.randn(param.shape).bfloat16()
            optimizer.step()
            optimizer.stager.wait_writes()  # the last write-backs run on past the step
            before = tier.bytes_read + tier.bytes_written
            optimizer.step()
            optimizer.stager.wait_writes()
            return int(tier.bytes_read + tier.bytes_written - before)

    adamw = bytes_per_step(lambda p, s: OffloadedAdamW(p, s, sub_group_size=1 << 18, cache_policy="none"))
    mini = bytes_per_step(
        lambda p, s: OffloadedAPOLLO(
            [{"params": p[:3], **MINI}, {"params": p[3:]}], s, sub_group_size=1 << 18, cache_policy="none"
        )
    )
    assert adamw == 2 * 12 * sum(torch.Size(shape).numel() for shape in shapes)
    assert mini <= 0.34 * adamw


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rank", 0),
        ("rank", 1.5),
        ("proj", "svd"),
        ("scale_type", "row"),
        ("scale", 0.0),
        ("update_proj_gap", 0),
        ("proj_type", "full"),
        ("correct_bias", "yes"),
        ("lr", -1.0),
        ("maximize", True),  # torch's AdamW keys that APOLLO does not have: refused, not ignored
        ("amsgrad", True),
    ],
)
def test_bad_group_keys_name_the_field(tmp_path: Path, key: str, value: object) -> None:
    with make_store(tmp_path, "dram") as store:
        params = [torch.nn.Parameter(torch.randn(4, 4))]
        with pytest.raises(ConfigError, match=rf"param_groups\.0\.{key}"):
            OffloadedAPOLLO([{"params": params, **MINI, key: value}], store)
        with pytest.raises(ConfigError, match="scale_front"):
            OffloadedAPOLLO(params, store, scale_front=1)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"param_groups\.0\.scale_type"):
            OffloadedAPOLLO([{"params": params, **RANK4_CHANNEL, "proj_type": "reverse_std"}], store)


def test_whole_parameter_partition() -> None:
    subgroups = partition_whole([[(0, 5), (1, 7), (2, 2)], [(3, 3)]], sub_group_size=8)
    assert [[p.param for p in sg.pieces] for sg in subgroups] == [[0], [1], [2], [3]]
    subgroups = partition_whole([[(0, 3), (1, 4), (2, 20), (3, 1)]], sub_group_size=8)
    assert [[p.param for p in sg.pieces] for sg in subgroups] == [[0, 1], [2], [3]]
    assert [sg.numel for sg in subgroups] == [7, 20, 1]
    assert all(p.param_offset == 0 for sg in subgroups for p in sg.pieces)
    assert subgroups[0].pieces[1].offset == 3


def test_a_group_added_after_construction_trains_as_one_given_at_construction(tmp_path: Path) -> None:
    """Its parameters are numbered (seeded) after the others, as they would be had it come last."""
    with make_store(tmp_path, "nvme") as store:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in MATRICES + VECTORS]
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        whole = OffloadedAPOLLO(groups(params, MINI), store, sub_group_size=1000, namespace="whole")
        grown = OffloadedAPOLLO(groups(twins, MINI)[:1], store, sub_group_size=1000, namespace="grown")
        grown.add_param_group(groups(twins, MINI)[1])
        train_side_by_side(grown, twins, whole, params, range(6))
        assert grown.seeds == whole.seeds
        for got, want in zip(grown.master_params(), whole.master_params(), strict=True):
            assert torch.equal(got, want)
        grown.param_groups[0]["rank"] = 2  # the state holds rank-1 moments
        with pytest.raises(ConfigError, match=r"param_groups\.0\.rank"):
            grown.step()


def test_fp32_parameters_are_their_own_master_weights(tmp_path: Path) -> None:
    """An fp32 model's state holds no copy of its weights (no master_param, APOLLO-Mini's state
    the low-rank moments and limiter norms only): weights the model is given outside the
    optimizer (model.load_state_dict) are the ones the next step updates, as in apollo_torch,
    instead of being reverted to a stored master."""
    reference_class = reference_optimizer()
    torch.manual_seed(1)
    model = [torch.nn.Parameter(torch.randn(shape)) for shape in MATRICES + VECTORS]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in model]
    with make_store(tmp_path, "dram") as store:
        optimizer = OffloadedAPOLLO(groups(model, MINI), store, lr=1e-2, sub_group_size=500)
        expected = reference_class(groups(reference, MINI), lr=1e-2)
        rank1 = sum(r + c + 1 for r, c in MATRICES)  # per matrix (r x 1 or 1 x c) moments, one norm
        moments = sum(2 * torch.Size(shape).numel() for shape in VECTORS)
        assert sum(optimizer.state_numel(sg) for sg in optimizer.subgroups) <= 2 * rank1 + moments
        for step in range(6):
            if step == 3:
                with torch.no_grad():
                    for param, twin in zip(model, reference, strict=True):
                        param.add_(1.0)
                        twin.add_(1.0)
            for param, twin in zip(model, reference, strict=True):
                param.grad = torch.randn(param.shape)
                twin.grad = param.grad.clone()
            optimizer.step()
            expected.step()
        for got, want in zip(model, reference, strict=True):
            assert relative_error(got, want) <= 1e-5
        assert all("master_param" not in entry for entry in optimizer.state_dict()["state"].values())


def test_stale_master_weights_of_a_bf16_model_are_refused(tmp_path: Path) -> None:
    """A state dict whose master_param a bf16 parameter no longer rounds from (the model's weights
    changed after it was saved): a StaleMasterWeightsError, nothing restored."""
    from tierstore.optimizer import StaleMasterWeightsError

    with make_store(tmp_path, "dram") as store:
        params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in MATRICES + VECTORS]
        optimizer = OffloadedAPOLLO(groups(params, MINI), store, sub_group_size=1000)
        saved = optimizer.state_dict()
        with torch.no_grad():
            params[1].add_(1.0)
        with pytest.raises(StaleMasterWeightsError, match=r"parameter 1 \(shape \(13, 40\)\)"):
            optimizer.load_state_dict(saved)
        del saved["state"][1]["master_param"]
        optimizer.load_state_dict(saved)
        assert torch.equal(optimizer.master_params()[1], params[1].detach().float())
