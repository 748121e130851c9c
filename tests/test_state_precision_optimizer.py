"""Offloaded AdamW with compressed state: the stored bytes, state dicts and snapshots carried
exactly, resume bit for bit, conversion to torch's fp32 state, and the refusals."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter
from tierstore.optimizer import OffloadedAdamW, OffloadedAPOLLO, state_kernels
from tierstore.optimizer import adamw as adamw_module
from tierstore.optimizer.device import DeviceStager
from tierstore.optimizer.gradients import GRADIENT_CHUNK
from tierstore.optimizer.state_kernels import BLOCK, TORCH_VECTOR, adamw_int8_compensated
from tierstore.optimizer.state_precision import PRESETS, fp32_state_dict, spans
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from tierstore import BufferMismatchError, ConfigError, TierStore

from .helpers import make_store
from .test_device_optimizer import ShuffledDevice

SHAPES = [(37, 29), (300,), (5, 7, 11)]
"""Sizes off every block and alignment, cut by 500-element sub-groups."""


def model(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in SHAPES]


def train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int) -> None:
    """``steps`` steps of gradients drawn from ``seed`` (the same gradients for the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        optimizer.step()


def adamw(
    store: TierStore,
    params: Sequence[torch.Tensor],
    precision: str,
    kind: type[OffloadedAdamW] = OffloadedAdamW,
    **options: Any,
) -> OffloadedAdamW:
    return kind(
        params, store, lr=1e-2, weight_decay=0.1, sub_group_size=500, state_precision=precision, **options
    )


def stored_bytes(optimizer: OffloadedAdamW) -> int:
    return sum(4 * optimizer._stored_numel(sg) for sg in optimizer.subgroups)


@pytest.mark.parametrize("precision", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_state_dicts_resume_bit_for_bit(tmp_path: Path, precision: str, dtype: torch.dtype) -> None:
    """6 steps straight through against 3 steps, a state dict loaded into a new optimizer, 3 more:
    the same weights, the same stored bytes; the dict loads what was saved, byte for byte."""
    with make_store(tmp_path, "nvme") as store:
        straight = model(dtype)
        optimizer = adamw(store, straight, precision, namespace="straight")
        train(optimizer, straight, 3, seed=1)
        saved = optimizer.state_dict()
        weights = [p.detach().clone() for p in straight]
        train(optimizer, straight, 3, seed=2)
        resumed = [torch.nn.Parameter(w.clone()) for w in weights]
        second = adamw(store, resumed, precision, namespace="second")
        second.load_state_dict(saved)
        if precision != "fp32":
            again = second.state_dict()["packed_state"]["subgroups"]
            for mine, theirs in zip(again, saved["packed_state"]["subgroups"], strict=True):
                assert torch.equal(mine["data"], theirs["data"])
        train(second, resumed, 3, seed=2)
        for ours, theirs in zip(resumed, straight, strict=True):
            assert torch.equal(ours, theirs)
        for sg in optimizer.subgroups:
            loaded, kept = second.stager.read(sg.index), optimizer.stager.read(sg.index)
            assert torch.equal(loaded.view(torch.int32), kept.view(torch.int32))  # packed bytes, not floats


class PerParameterAdamW(OffloadedAdamW):
    """Its state dict holds each parameter's state decoded, as ``FSDPOffloadedAdamW``'s does."""

    PACKED_STATE_DICT = False


@pytest.mark.parametrize("precision", ["bf16", "int8", "int8-compensated"])
def test_per_parameter_state_dicts_encode_back_to_the_stored_bytes(tmp_path: Path, precision: str) -> None:
    """Decoded per parameter and loaded on the same sub-groups, a compressed state is stored as it
    was, byte for byte, even where fp32 cannot hold the parameter plus its compensation (terms
    2^-20 of the weight, which a master weight derived from ``master_param`` would lose)."""
    with make_store(tmp_path, "nvme") as store:
        params = model(torch.bfloat16)
        optimizer = adamw(store, params, precision, PerParameterAdamW)
        train(optimizer, params, 3, seed=1)
        saved = optimizer.state_dict()
        assert "packed_state" not in saved
        if precision == "int8-compensated":
            for number, param in enumerate(params):
                tiny = (param.detach().float() * 2.0**-20).to(torch.bfloat16)
                saved["state"][number]["master_compensation"] = tiny
                # the master weights as fp32 holds them: param + tiny, rounded
                saved["state"][number]["master_param"] = param.detach().float() + tiny.float()
        resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
        second = adamw(store, resumed, precision, PerParameterAdamW, namespace="second")
        second.load_state_dict(saved)
        again = second.state_dict()["state"]
        for number in range(len(params)):
            for name, value in saved["state"][number].items():
                assert torch.equal(again[number][name], value), (number, name)
        if precision != "int8-compensated":
            for sg in optimizer.subgroups:
                loaded, kept = second.stager.read(sg.index), optimizer.stager.read(sg.index)
                assert torch.equal(loaded.view(torch.int32), kept.view(torch.int32))


def test_a_misshapen_compensation_entry_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with make_store(tmp_path, "nvme") as store:
        params = model(torch.bfloat16)
        optimizer = adamw(store, params, "int8-compensated", PerParameterAdamW)
        train(optimizer, params, 1, seed=1)
        saved = optimizer.state_dict()
        before = [optimizer.stager.read(sg.index).clone() for sg in optimizer.subgroups]
        saved["state"][0]["master_compensation"] = torch.zeros(7, dtype=torch.bfloat16)
        with pytest.raises(BufferMismatchError, match="master_compensation has shape"):
            optimizer.load_state_dict(saved)
        for sg, kept in zip(optimizer.subgroups, before, strict=True):
            assert torch.equal(optimizer.stager.read(sg.index).view(torch.int32), kept.view(torch.int32))


def test_stored_bytes_per_parameter(tmp_path: Path) -> None:
    """bf16 parameters: 12 -> 8 -> 6 -> 4 bytes per element (and the block maxima, alignment);
    fp32 ones: 8 -> 4 -> 2."""
    numel = sum(torch.Size(shape).numel() for shape in SHAPES)
    expected = {
        torch.bfloat16: {"fp32": 12, "bf16": 8, "int8": 6, "int8-compensated": 4},
        torch.float32: {"fp32": 8, "bf16": 4, "int8": 2, "int8-compensated": 2},
    }
    with make_store(tmp_path, "dram") as store:
        for dtype, sizes in expected.items():
            for precision, width in sizes.items():
                params = model(dtype)
                optimizer = adamw(
                    store, params, precision, namespace=f"{precision}-{dtype}".replace(".", "_")
                )
                blocks = 2 * 4 * (numel // 256 + len(optimizer.subgroups)) if "int8" in precision else 0
                slack = 2 * 3 * 64 * len(optimizer.subgroups) + blocks  # block maxima and alignment
                assert width * numel <= stored_bytes(optimizer) <= width * numel + slack
                optimizer.close()


@pytest.mark.parametrize("precision", ["bf16", "int8", "int8-compensated"])
def test_a_compressed_state_converts_to_torchs_adamw(tmp_path: Path, precision: str) -> None:
    """fp32_state_dict: torch's fused AdamW loads it and takes the same next step as an offloaded
    fp32 AdamW loading it; the moments are the dequantised ones."""
    with make_store(tmp_path, "dram") as store:
        params = model(torch.float32)
        optimizer = adamw(store, params, precision)
        train(optimizer, params, 3, seed=1)
        converted = fp32_state_dict(optimizer.state_dict(), params)
        assert "packed_state" not in converted
        assert set(converted["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
        twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
        reference = torch.optim.AdamW(twin, lr=1e-2, weight_decay=0.1, fused=True)
        reference.load_state_dict(converted)
        fp32 = adamw(store, params, "fp32", namespace="fp32")
        fp32.load_state_dict(converted)
        train(reference, twin, 1, seed=2)
        train(fp32, params, 1, seed=2)
        for ours, theirs in zip(params, twin, strict=True):
            assert torch.equal(ours, theirs)


def test_compensated_master_converts_to_param_plus_compensation(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        params = model(torch.bfloat16)
        optimizer = OffloadedAdamW(
            params, store, lr=1e-4, sub_group_size=500, state_precision="int8-compensated"
        )
        train(optimizer, params, 3, seed=1)
        converted = fp32_state_dict(optimizer.state_dict(), params)
        for number, param in enumerate(params):
            master = converted["state"][number]["master_param"]
            assert torch.equal(master.to(torch.bfloat16), param.detach())
            assert torch.equal(master, optimizer.master_params()[number])
        fp32 = adamw(store, params, "fp32", namespace="fp32")
        fp32.load_state_dict(converted)  # the parameters round from the masters: not stale


def test_snapshots_carry_the_compressed_state_and_refuse_another_precision(tmp_path: Path) -> None:
    with make_store(tmp_path, "nvme") as store:
        params = model(torch.bfloat16)
        optimizer = adamw(store, params, "int8-compensated")
        train(optimizer, params, 2, seed=1)
        optimizer.save_snapshot(tmp_path / "snapshot.h5")
        before = [optimizer.stager.read(sg.index).clone() for sg in optimizer.subgroups]
        weights = [p.detach().clone() for p in params]
        train(optimizer, params, 2, seed=2)
        with torch.no_grad():
            for param, saved in zip(params, weights, strict=True):
                param.copy_(saved)
        optimizer.load_snapshot(tmp_path / "snapshot.h5")
        for sg, saved in zip(optimizer.subgroups, before, strict=True):
            assert torch.equal(optimizer.stager.read(sg.index).view(torch.int32), saved.view(torch.int32))
        optimizer.close()
        other = adamw(store, params, "int8")
        with pytest.raises(BufferMismatchError, match="state_precision 'int8-compensated'"):
            other.load_snapshot(tmp_path / "snapshot.h5")


def test_a_state_dict_of_another_precision_is_refused(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        params = model(torch.bfloat16)
        int8 = adamw(store, params, "int8", namespace="int8")
        saved = int8.state_dict()
        for precision in ("fp32", "bf16"):
            other = adamw(store, params, precision, namespace=precision)
            with pytest.raises(BufferMismatchError, match="fp32_state_dict"):
                other.load_state_dict(saved)
            other.load_state_dict(fp32_state_dict(saved, params))  # converted explicitly
            other.close()


def test_bad_precisions_and_fp32_only_optimizers_are_refused(tmp_path: Path) -> None:
    with make_store(tmp_path, "dram") as store:
        for bad in ("int4", 8, {"moments": "fp8"}):
            with pytest.raises(ConfigError, match=r"^state_precision: "):
                adamw(store, model(torch.float32), bad)  # type: ignore[arg-type]
        with pytest.raises(
            ConfigError, match=r"^state_precision: OffloadedAPOLLO stores its state in fp32 only"
        ):
            OffloadedAPOLLO(model(torch.float32), store, state_precision="int8")


def step_side_by_side(
    device: ShuffledDevice,
    sides: Sequence[tuple[OffloadedAdamW, Sequence[torch.Tensor]]],
    on_device: Sequence[torch.Tensor],
    steps: int,
) -> None:
    """``steps`` steps of each optimizer over its parameters, step ``n``'s gradients drawn from seed
    ``n`` for every side (made device tensors for ``on_device``); the device runs after each step."""
    for step in range(steps):
        for optimizer, params in sides:
            generator = torch.Generator().manual_seed(step)
            for param in params:
                grad = torch.randn(param.shape, generator=generator).to(param.dtype)
                param.grad = device.tensor(grad) if params is on_device else grad
            optimizer.step()
        device.run_all()


@pytest.mark.parametrize("precision", ["bf16", "int8-compensated"])
@pytest.mark.parametrize("budgets", [{}, {"gpu_budget": "1MiB"}], ids=["streamed", "kept on the device"])
def test_the_device_path_runs_the_same_kernels(
    tmp_path: Path, precision: str, budgets: dict[str, Any]
) -> None:
    """On a simulated device (its streams run in a random order the events allow) a compressed
    state trains to the bits of the CPU path's, state dicts included."""
    device = ShuffledDevice(1)
    with make_store(tmp_path, "dram") as device_store, make_store(tmp_path, "dram") as host_store:
        device_store._operations.device.runtime = device
        in_host = model(torch.bfloat16)
        on_device = [device.tensor(p.detach().clone()).requires_grad_() for p in in_host]
        ours = adamw(device_store, on_device, precision, **budgets)
        theirs = adamw(host_store, in_host, precision)
        step_side_by_side(device, [(ours, on_device), (theirs, in_host)], on_device, steps=4)
        for mine, reference in zip(on_device, in_host, strict=True):
            assert torch.equal(mine.detach().as_subclass(torch.Tensor), reference.detach())
        saved, expected = ours.state_dict()["packed_state"], theirs.state_dict()["packed_state"]
        for mine_sg, reference_sg in zip(saved["subgroups"], expected["subgroups"], strict=True):
            assert torch.equal(mine_sg["data"], reference_sg["data"])
        assert isinstance(ours.stager, DeviceStager)
        assert ours.device_staging_bytes > ours.stager.slot_device_bytes  # the unpacked sub-group


def test_a_dcp_checkpoint_through_the_tiers_carries_the_packed_state(tmp_path: Path) -> None:
    """tierstore.checkpoint saves a compressed state dict with dcp.save and loads it into a fresh
    optimizer's state dict: the stored bytes come back exactly."""
    settings = {"tiers": [{"name": "fast", "paths": [{"backend": f"nvme://{tmp_path / 'fast'}"}]}]}
    with make_store(tmp_path, "dram") as store:
        params = model(torch.bfloat16)
        optimizer = adamw(store, params, "int8-compensated", namespace="saved")
        train(optimizer, params, 3, seed=1)
        with TieredStorageWriter(settings) as writer:
            save(
                {"optimizer": optimizer.state_dict()},
                checkpoint_id="step-3",
                storage_writer=writer,
                no_dist=True,
            )
        fresh = adamw(store, [torch.nn.Parameter(p.detach().clone()) for p in params], "int8-compensated")
        loaded = {"optimizer": fresh.state_dict()}
        with TieredStorageReader(settings) as reader:
            load(loaded, checkpoint_id="step-3", storage_reader=reader, no_dist=True)
        fresh.load_state_dict(loaded["optimizer"])
        for sg in optimizer.subgroups:
            ours, theirs = fresh.stager.read(sg.index), optimizer.stager.read(sg.index)
            assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_fp32_is_the_state_as_without_the_option(tmp_path: Path) -> None:
    """state_precision="fp32" changes nothing: the same stored objects, weights and state dict as an
    optimizer built without it, bit for bit, and no packed state or scratch."""
    with make_store(tmp_path, "dram") as store:
        plain_params, fp32_params = model(torch.bfloat16), model(torch.bfloat16)
        plain = OffloadedAdamW(
            plain_params, store, lr=1e-2, weight_decay=0.1, sub_group_size=500, namespace="plain"
        )
        fp32 = adamw(store, fp32_params, "fp32", namespace="fp32")
        train(plain, plain_params, 3, seed=1)
        train(fp32, fp32_params, 3, seed=1)
        for ours, theirs in zip(fp32_params, plain_params, strict=True):
            assert torch.equal(ours, theirs)
        for sg in plain.subgroups:
            assert torch.equal(fp32.stager.read(sg.index), plain.stager.read(sg.index))
        assert "packed_state" not in fp32.state_dict() and fp32._scratch.numel() == 0


def test_the_cpu_paths_spans_give_the_whole_sub_groups_bits(tmp_path: Path) -> None:
    """The CPU path unpacks, updates and packs a sub-group larger than a span a span at a time, cut
    inside pieces that start aligned and between pieces that do not; it trains to the bits of the
    device path, which updates the whole sub-group at once."""
    shapes = [(600_064,), (1001, 600), (640_000,)]  # the third starts off the kernel's alignment
    device = ShuffledDevice(1)
    with make_store(tmp_path, "dram") as device_store, make_store(tmp_path, "dram") as host_store:
        device_store._operations.device.runtime = device
        torch.manual_seed(0)
        in_host = [torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16)) for shape in shapes]
        on_device = [device.tensor(p.detach().clone()).requires_grad_() for p in in_host]
        ours, theirs = (
            OffloadedAdamW(
                params, store, lr=1e-2, sub_group_size=2_000_000, state_precision="int8-compensated"
            )
            for params, store in ((in_host, host_store), (on_device, device_store))
        )
        assert [start for start, _ in spans(ours.subgroups[0], GRADIENT_CHUNK)] == [0, 524_288, 1_048_576]
        step_side_by_side(device, [(ours, in_host), (theirs, on_device)], on_device, steps=2)
        for mine, reference in zip(in_host, on_device, strict=True):
            assert torch.equal(mine.detach(), reference.detach().as_subclass(torch.Tensor))
        saved, expected = ours.state_dict()["packed_state"], theirs.state_dict()["packed_state"]
        assert torch.equal(saved["subgroups"][0]["data"], expected["subgroups"][0]["data"])


@pytest.mark.parametrize(
    "hyperparameters",
    [
        {"lr": 1e-2, "weight_decay": 0.1, "max_grad_norm": 0.5},
        {"lr": 3e-3, "betas": (0.3, 0.95), "weight_decay": 0.0, "maximize": True},
        {"lr": 1e-2, "weight_decay": 0.1, "compute_threads": 3},
    ],
    ids=["clipped", "small beta1, maximised", "blocks shared among 3 threads"],
)
def test_the_one_pass_update_gives_the_kernels_bits(
    tmp_path: Path, hyperparameters: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An int8-compensated sub-group of bf16 parameters is updated in one pass over its packed
    state on a CPU: the bits of unpacking, torch's fused AdamW (its vector body and its scalar
    tail: parameters of lengths off its vector width), rounding and packing, with parameters
    without a gradient on some steps and several parameters in one quantisation block."""
    if torch.backends.cpu.get_cpu_capability() not in TORCH_VECTOR or shutil.which("c++") is None:
        pytest.skip("torch's AdamW kernel here is not one the one-pass update reproduces, or no C++ compiler")
    shapes = [(1001,), (37, 13), (600,), (5,), (256,), (3, 7), *[(7,)] * 40]  # 7: all tail
    monkeypatch.setattr(state_kernels, "PARALLEL_MIN_NUMEL", BLOCK)  # threads share small sub-groups too
    ran: list[bool] = []

    def counted(*arguments: Any) -> bool:
        ran.append(adamw_int8_compensated(*arguments))
        return ran[-1]

    runs = []
    for one_pass in (True, False):
        monkeypatch.setattr(
            adamw_module, "adamw_int8_compensated", counted if one_pass else lambda *arguments: False
        )
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16)) for shape in shapes]
        with make_store(tmp_path, "dram") as store:
            optimizer = OffloadedAdamW(
                params, store, sub_group_size=700, state_precision="int8-compensated", **hyperparameters
            )
            for step in range(6):
                for number, param in enumerate(params):
                    has_grad = (number + step) % 4 != 0
                    param.grad = (torch.randn(param.shape) * (step + 1)).bfloat16() if has_grad else None
                optimizer.step()
            stored = [optimizer.stager.read(sg.index).clone() for sg in optimizer.subgroups]
            optimizer.close()
        runs.append(([param.detach().clone() for param in params], stored))
    assert ran and all(ran)  # every sub-group's every step took the one pass
    (ours, ours_stored), (theirs, theirs_stored) = runs
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine.view(torch.int16), reference.view(torch.int16))
    for mine, reference in zip(ours_stored, theirs_stored, strict=True):
        assert torch.equal(mine.view(torch.int32), reference.view(torch.int32))
