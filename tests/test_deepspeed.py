"""The DeepSpeed integration against real DeepSpeed ZeRO-3 on CPU (gloo), one process per rank.

Each run is the integration's example script in a fresh process (DeepSpeed keeps process-wide
state), with its optimizer state on tmpfs, which accepts O_DIRECT here and keeps runs steady.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deepspeed")

import torch
from tierstore.integrations.deepspeed import check_deepspeed_version, validate_config
from tierstore.integrations.deepspeed.checkpoints import (
    ADAM_STATES,
    CHECKPOINT_INDEX,
    PACKED_ROWS,
    checkpoint_store,
    convert_checkpoint,
    read_index,
)
from tierstore.integrations.deepspeed.config import TierstoreSection, parse_section
from tierstore.integrations.deepspeed.swapper import TierStoreSwapper
from tierstore.optimizer.state_precision import PRESETS, PackedLayout

from tierstore import BufferMismatchError, ConfigError, TierStore, UnsupportedVersionError
from tierstore.app.demo import GPT, Linear

from .helpers import make_store, run_ranks

SMALL = ["--layers", "2", "--width", "256", "--heads", "4", "--vocab", "2048", "--sub-group-size", "1000000"]
BF16_TOLERANCE = 2e-2  # relative; bf16 keeps 8 bits of mantissa


@pytest.fixture
def scratch(tmp_path: Path, deepspeed_ops: None) -> Any:
    """A directory for the example's runs, on tmpfs when there is one (O_DIRECT works there on
    this kernel); DeepSpeed's ops are built by then."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    directory = base / f"tierstore-ds-{os.getpid()}-{tmp_path.name}"
    directory.mkdir()
    yield directory
    subprocess.run(["rm", "-rf", str(directory)], check=True)


def train(*args: str, world: int = 1, output: Path) -> list[dict[str, Any]]:
    """Run the example on ``world`` ranks; rank 0's rows. Every rank is killed when one fails or
    runs out of time."""
    command = [sys.executable, "-m", "tierstore.integrations.deepspeed.example", *args, "--json", str(output)]
    # Generous: on a CPU without native bf16 the 10M-parameter runs take ~80 s each.
    run_ranks(command, world, timeout=900)
    rows: list[dict[str, Any]] = json.loads(output.read_text())["rows"]
    return rows


def losses(rows: list[dict[str, Any]]) -> list[float]:
    return [row["loss"] for row in rows]


def deepspeed_aio_missing() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return not AsyncIOBuilder().is_compatible(verbose=False)


@pytest.mark.skipif(deepspeed_aio_missing(), reason="DeepSpeed's async_io op needs Debian's libaio-dev")
def test_losses_match_deepspeeds_own_nvme_offload(scratch: Path) -> None:
    """A 2-block GPT of about 10M parameters in bf16 in 6 sub-groups, 10 steps each way (about 80 s
    per run on 2 cores without native bf16; the benchmark runs the 55M default)."""
    model = ["--layers", "2", "--width", "512", "--heads", "8", "--vocab", "4096"]
    # DRAM for 16 DeepSpeed buffers of 2M elements: tierstore keeps some of the 6 sub-groups
    budget = [*model, "--sub-group-size", "2000000", "--buffer-count", "16"]
    stock = train(
        "--offload", "deepspeed", *budget, "--nvme", str(scratch / "stock"), output=scratch / "stock.json"
    )
    ours = train("--offload", "tierstore", *budget, "--nvme", str(scratch / "ts"), output=scratch / "ts.json")
    assert len(stock) == len(ours) == 10
    assert losses(ours) == pytest.approx(losses(stock), rel=BF16_TOLERANCE)
    assert losses(ours)[-1] < losses(ours)[0] / 2  # it learns
    parameters = json.loads((scratch / "ts.json").read_text())["parameters"]
    assert 5e6 <= parameters <= 20e6
    for row in ours[1:]:  # fp32 state only (master + 2 moments), never an fp32 gradient
        assert 0 < row["bytes_written"] <= 12 * parameters
    for row in ours[2:]:  # the sub-group kept in DRAM skips its read and its write
        assert row["bytes_read"] < 12 * parameters and row["bytes_written"] < 12 * parameters
    assert not list((scratch / "ts").rglob("*gradient*"))


def test_activations_spilled_through_the_engine_change_no_loss(scratch: Path) -> None:
    """``tierstore.activations`` wraps the engine's forward: same losses to the bit, bytes spilled
    and resident activations within the budget."""
    common = [*SMALL, "--steps", "4", "--offload", "tierstore"]
    plain = train(*common, "--nvme", str(scratch / "plain"), output=scratch / "plain.json")
    section = json.dumps({"budget": "4MiB", "min_bytes": "32KiB", "plan": "lifetime"})
    spilled = train(
        *common, "--activations", section, "--nvme", str(scratch / "act"), output=scratch / "act.json"
    )
    assert losses(spilled) == losses(plain)
    assert all(row["activations_spilled_bytes"] > 0 for row in spilled)
    assert all(0 < row["activations_peak_resident_bytes"] <= 4 << 20 for row in spilled)


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.skipif(deepspeed_aio_missing(), reason="DeepSpeed's async_io op needs Debian's libaio-dev")
def test_a_block_skipped_on_some_steps_matches_deepspeeds_own_nvme_offload(scratch: Path) -> None:
    """The last block gets no gradient on steps 1, 3 and 5. Stock DeepSpeed counts Adam steps per
    sub-group, every step, and feeds a parameter without a gradient its stale one (read back from
    its gradient file); tierstore must do the same. Stock's swapper writes files only for tensors
    of at least its aio block (1 MiB of fp32); what it reads for smaller ones is leftover buffer
    contents, so only the large ones are compared element-wise."""
    common = [*SMALL, "--steps", "6", "--skip-last-block-at", "1,3,5"]
    runs = {}
    for offload in ("deepspeed", "tierstore"):
        rows = train(
            "--offload",
            offload,
            *common,
            "--nvme",
            str(scratch / offload),
            "--parameters",
            str(scratch / f"{offload}.pt"),
            output=scratch / f"{offload}.json",
        )
        summary = json.loads((scratch / f"{offload}.json").read_text())
        runs[offload] = (rows, summary["adam_steps"], torch.load(scratch / f"{offload}.pt"))
    (stock_rows, stock_steps, stock), (our_rows, our_steps, ours) = runs["deepspeed"], runs["tierstore"]
    assert losses(our_rows) == pytest.approx(losses(stock_rows), rel=BF16_TOLERANCE)
    assert our_steps == stock_steps == [6] * len(stock_steps)
    large = [name for name, value in stock.items() if value.numel() * 4 >= 1 << 20]
    assert {"blocks.1.up.weight", "blocks.1.down.weight"} <= set(large)
    for name in large:
        assert relative_difference(ours[name], stock[name]) <= 5e-3, name


def test_subgroups_without_a_gradient_yet_are_left_alone(scratch: Path) -> None:
    """The last block is unused on both steps. With sub-groups of 200k elements two sub-groups
    hold only its parameters (proj.bias, norm2, up and down.weight; DeepSpeed fills sub-groups
    with whole parameters in model order). Stock DeepSpeed fails on them (no .grad to unscale);
    tierstore gives them no gradient, so Adam skips them: no step counted, weights untouched."""
    train(
        "--offload",
        "tierstore",
        *SMALL,
        "--sub-group-size",
        "200000",
        "--buffer-count",
        "24",  # DRAM for the ring of the largest sub-group (the 524k embedding)
        "--steps",
        "2",
        "--skip-last-block-at",
        "0,1",
        "--nvme",
        str(scratch / "ts"),
        "--parameters",
        str(scratch / "ts.pt"),
        output=scratch / "ts.json",
    )
    adam_steps = json.loads((scratch / "ts.json").read_text())["adam_steps"]
    assert sorted(adam_steps) == [0, 0] + [2] * (len(adam_steps) - 2)
    trained = torch.load(scratch / "ts.pt")
    torch.manual_seed(0)
    example = GPT(vocab=2048, width=256, layers=2, heads=4, length=64, dropout=0.0, tied_head=False)
    initial = example.bfloat16().float().state_dict()
    untouched = ["proj.bias", "norm2.weight", "norm2.bias", "up.weight", "up.bias", "down.weight"]
    for name in untouched:
        assert torch.equal(trained[f"blocks.1.{name}"], initial[f"blocks.1.{name}"]), name
    assert not torch.equal(trained["blocks.0.up.weight"], initial["blocks.0.up.weight"])


def test_the_examples_linear_layers_multiply_in_fp32_over_bf16_weights() -> None:
    """``--matmul-dtype float32``: bf16 weights, activations and gradients, fp32 products."""
    torch.manual_seed(0)
    layer = Linear(64, 32, compute=torch.float32).bfloat16()
    x = torch.randn(8, 64).bfloat16().requires_grad_()
    y = layer(x)
    y.float().square().sum().backward()
    assert y.dtype == x.grad.dtype == layer.weight.grad.dtype == torch.bfloat16  # type: ignore[union-attr]
    weight = layer.weight.detach().float().requires_grad_()
    expected = torch.nn.functional.linear(x.detach().float(), weight, layer.bias.detach().float())
    expected.bfloat16().float().square().sum().backward()  # type: ignore[no-untyped-call]
    assert torch.equal(y, expected.bfloat16())
    torch.testing.assert_close(layer.weight.grad, weight.grad.bfloat16())  # type: ignore[union-attr]
    assert Linear(64, 32, compute=torch.bfloat16).bfloat16()(x).dtype == torch.bfloat16  # bf16: plain path


def test_checkpoint_resumes_exactly(scratch: Path) -> None:
    common = ["--offload", "tierstore", "--steps", "6", *SMALL]
    straight = train(
        *common,
        "--nvme",
        str(scratch / "a"),
        "--save",
        str(scratch / "ckpt"),
        "--save-after",
        "3",
        output=scratch / "a.json",
    )
    resumed = train(
        *common, "--nvme", str(scratch / "b"), "--load", str(scratch / "ckpt"), output=scratch / "b.json"
    )
    assert [row["step"] for row in resumed] == [3, 4, 5]
    assert losses(resumed) == losses(straight)[3:]  # bit for bit: Adam state, steps, masters restored
    indexes = list((scratch / "ckpt").rglob(CHECKPOINT_INDEX))
    assert len(indexes) == 1  # one rank's state: its store beside the engine's files
    assert list((indexes[0].parent / "objects").iterdir())


def stored_objects(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The bytes of every object of the one rank's optimizer state in a checkpoint directory, by
    key."""
    (index,) = checkpoint.rglob(CHECKPOINT_INDEX)
    with checkpoint_store(index.parent) as store:
        keys = store.keys()
        return {key: store.get(key).result().reshape(-1).view(torch.uint8) for key in keys}


def test_compressed_state_is_stored_packed_and_resumes_exactly(scratch: Path) -> None:
    """``state_precision: "int8-compensated"`` over bf16 weights: each sub-group's store object is
    its packed layout (8-bit moments, the master as the bf16 partition plus a bf16 compensation),
    which a checkpoint carries beside the partitions. A fresh engine loading it holds the same bytes
    (saved again at once) and trains on to the losses and weights of the uninterrupted run, bit for
    bit; an engine storing fp32 state refuses the checkpoint, and loads it converted to fp32
    (`convert_checkpoint`), training on to losses close to the compressed run's."""
    precision = PRESETS["int8-compensated"]
    common = ["--offload", "tierstore", "--steps", "6", *SMALL, "--state-precision", "int8-compensated"]
    straight = train(
        *common,
        "--nvme",
        str(scratch / "a"),
        "--save",
        str(scratch / "saved"),
        "--save-after",
        "3",
        "--parameters",
        str(scratch / "a.pt"),
        output=scratch / "a.json",
    )
    resumed = train(
        *common,
        "--nvme",
        str(scratch / "b"),
        "--load",
        str(scratch / "saved"),
        "--save",
        str(scratch / "loaded"),
        "--save-after",
        "3",
        "--parameters",
        str(scratch / "b.pt"),
        output=scratch / "b.json",
    )
    assert losses(straight)[-1] < losses(straight)[0] - 1  # it learns
    assert losses(resumed) == losses(straight)[3:]
    uninterrupted, continued = torch.load(scratch / "a.pt"), torch.load(scratch / "b.pt")
    assert all(torch.equal(continued[name], weights) for name, weights in uninterrupted.items())

    (index,) = (scratch / "saved").rglob(CHECKPOINT_INDEX)
    subgroups, _, saved_precision = read_index(index.parent)
    assert saved_precision == precision
    saved = stored_objects(scratch / "saved")
    assert set(saved) == {f"rank0/{name}{part}" for name in subgroups for part in ("", ".low-precision")}
    packed = {
        name: 4 * PackedLayout(PACKED_ROWS, sg.numel, precision).words for name, sg in subgroups.items()
    }
    for name, subgroup in subgroups.items():
        assert saved[f"rank0/{name}"].numel() == packed[name] < 5 * subgroup.numel  # fp32 state: 12
        assert saved[f"rank0/{name}.low-precision"].numel() == 2 * subgroup.numel  # the bf16 partition
    assert straight[0]["bytes_read"] == sum(packed.values())  # the first update reads every sub-group
    loaded = stored_objects(scratch / "loaded")
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[key], stored) for key, stored in saved.items())

    with pytest.raises(
        AssertionError, match=r"BufferMismatchError: .*'int8-compensated', this engine's in 'fp32'"
    ):
        train(
            *common[:-2],
            "--nvme",
            str(scratch / "c"),
            "--load",
            str(scratch / "saved"),
            output=scratch / "c.json",
        )
    convert_checkpoint(scratch / "saved" / "checkpoint", scratch / "fp32" / "checkpoint", "fp32")
    converted = train(
        *common[:-2], "--nvme", str(scratch / "d"), "--load", str(scratch / "fp32"), output=scratch / "d.json"
    )
    assert [row["step"] for row in converted] == [3, 4, 5]
    assert losses(converted) == pytest.approx(losses(straight)[3:], rel=1e-2)


SUBGROUPS = {"0_3": 700, "4_9": 300}
"""The sub-groups of the swappers built directly (by ``ds_id``) and their elements."""


def direct_swapper(
    directory: Path, precision: str, seed: int
) -> tuple[TierStoreSwapper, dict[str, torch.Tensor], list[torch.Tensor]]:
    """A swapper as the engine builds it, without DeepSpeed, over `SUBGROUPS`, initialised from
    random bf16 partitions; its partitions by name and its fp32 partitions (DeepSpeed's
    parameters)."""
    generator = torch.Generator().manual_seed(seed)
    partitions = {
        name: torch.randn(numel, generator=generator).bfloat16() for name, numel in SUBGROUPS.items()
    }
    parameters = []
    for name in SUBGROUPS:
        parameter = torch.empty(0)
        parameter.ds_id = name  # type: ignore[attr-defined]
        parameters.append(parameter)
    swapper = TierStoreSwapper(
        make_store(directory, "dram"),
        TierstoreSection.model_validate({"state_precision": precision}),
        directory / "swap",
        torch.optim.Adam([torch.zeros(1)]),
        largest_numel=max(SUBGROUPS.values()),
        namespace="rank0",
        low_precision=lambda parameter: partitions[parameter.ds_id],  # type: ignore[attr-defined]
    )
    swapper.initialize_parameters(parameters, list(partitions.values()))
    return swapper, partitions, parameters


def step_directly(
    swapper: TierStoreSwapper, partitions: dict[str, torch.Tensor], parameters: list[torch.Tensor]
) -> None:
    """What an update does to each sub-group through the swapper: new master weights and moments,
    the master copied into the partition (as DeepSpeed copies it), then the swap-out."""
    generator = torch.Generator().manual_seed(7)
    for parameter in parameters:
        swapper.swap_in_optimizer_state(parameter)
        swapper.create_adam_state(parameter)
        state = swapper.optimizer.state[parameter]
        parameter.data.add_(torch.randn(parameter.shape, generator=generator), alpha=1e-3)
        state["exp_avg"].copy_(torch.randn(parameter.shape, generator=generator))
        state["exp_avg_sq"].copy_(torch.rand(parameter.shape, generator=generator))
        partitions[parameter.ds_id].copy_(parameter.data)  # type: ignore[attr-defined]
        swapper.swap_out_optimizer_state(parameter)


def stored_bytes(swapper: TierStoreSwapper) -> dict[str, torch.Tensor]:
    return {name: swapper.stager.read(name).view(torch.uint8).clone() for name in SUBGROUPS}


@pytest.mark.parametrize(("saved", "loading"), [("int8-compensated", "fp32"), ("fp32", "int8-compensated")])
def test_a_checkpoint_of_another_state_precision_is_refused_before_anything_changes(
    tmp_path: Path, saved: str, loading: str
) -> None:
    """The loading engine's stored state and its low-precision partitions (which a compensated
    master's load replaces) are as they were."""
    saver, saver_partitions, saver_parameters = direct_swapper(tmp_path / "saver", saved, seed=0)
    step_directly(saver, saver_partitions, saver_parameters)
    saver.export_checkpoint(tmp_path / "checkpoint", {"passes": 1})
    saver.close()
    loader, partitions, parameters = direct_swapper(tmp_path / "loader", loading, seed=1)
    step_directly(loader, partitions, parameters)
    before = stored_bytes(loader), {name: partition.clone() for name, partition in partitions.items()}
    with pytest.raises(BufferMismatchError, match=f"state_precision '{saved}', this engine's in '{loading}'"):
        loader.restore_checkpoint(tmp_path / "checkpoint")
    after = stored_bytes(loader)
    assert all(torch.equal(after[name], stored) for name, stored in before[0].items())
    assert all(torch.equal(partitions[name], partition) for name, partition in before[1].items())
    loader.close()


def saved_checkpoint(directory: Path, precision: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint tag folder as an engine saves it, from a swapper built directly and stepped
    once in ``precision`` (an engine file of its own beside the optimizer state); its sub-groups'
    low-precision partitions by name."""
    swapper, partitions, parameters = direct_swapper(directory / "saver", precision, seed=0)
    step_directly(swapper, partitions, parameters)
    tag = directory / "checkpoints" / "step-1"
    swapper.export_checkpoint(tag / "tierstore" / "rank00", {"passes": 1})
    swapper.close()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"the engine's own file")
    return tag, partitions


def saved_state(tag: Path) -> dict[str, bytes]:
    """Every file's bytes under a checkpoint tag folder, by path."""
    return {str(file.relative_to(tag)): file.read_bytes() for file in tag.rglob("*") if file.is_file()}


def test_a_compressed_checkpoint_converts_to_the_fp32_state_it_holds(tmp_path: Path) -> None:
    """An ``int8-compensated`` checkpoint converted to fp32 loads into an fp32 engine as exactly
    the state the compressed engine hands DeepSpeed: the moments dequantised and the master settled
    (the partition plus its compensation, rounding to the partition); it trains on from there."""
    tag, partitions = saved_checkpoint(tmp_path, "int8-compensated")
    before = saved_state(tag)
    convert_checkpoint(tag, tag.with_name("fp32"), "fp32")
    assert saved_state(tag) == before  # only read
    assert (tag.parent / "fp32" / "mp_rank_00_model_states.pt").read_bytes() == b"the engine's own file"
    subgroups, extra, precision = read_index(tag.parent / "fp32" / "tierstore" / "rank00")
    assert (subgroups, extra, precision) == (*read_index(tag / "tierstore" / "rank00")[:2], PRESETS["fp32"])

    loader, _, parameters = direct_swapper(tmp_path / "loader", "fp32", seed=1)
    loader.restore_checkpoint(tag.parent / "fp32" / "tierstore" / "rank00")
    with checkpoint_store(tag / "tierstore" / "rank00") as saved:
        for name, numel in SUBGROUPS.items():
            expected = torch.empty(3 * numel)
            PackedLayout(PACKED_ROWS, numel, PRESETS["int8-compensated"]).decode(
                saved.get(f"rank0/{name}").result(), expected, [(0, partitions[name])], settle=True
            )
            assert torch.equal(loader.stager.read(name), expected), name
            assert torch.equal(expected[:numel].bfloat16(), partitions[name]), name
    assert all(set(ADAM_STATES) <= set(loader.optimizer.state[parameter]) for parameter in parameters)
    step_directly(loader, {name: partition.clone() for name, partition in partitions.items()}, parameters)
    assert all(loader.stager.read(name).isfinite().all() for name in SUBGROUPS)
    loader.close()


@pytest.mark.parametrize("saved", ["fp32", "int8-compensated"])
def test_a_checkpoint_converts_to_int8_compensated_state(tmp_path: Path, saved: str) -> None:
    """An fp32 checkpoint converted to ``int8-compensated`` is stored as the compressed engine
    packs the fp32 state, its partitions the masters rounded; a compressed engine loads it (into
    its partitions too) and trains on. Converted into its own precision, a checkpoint keeps its
    bytes."""
    tag, _ = saved_checkpoint(tmp_path, saved)
    converted = tag.with_name("int8-compensated")
    convert_checkpoint(tag, converted, "int8-compensated")
    loader, partitions, parameters = direct_swapper(tmp_path / "loader", "int8-compensated", seed=1)
    loader.restore_checkpoint(converted / "tierstore" / "rank00")
    with checkpoint_store(tag / "tierstore" / "rank00") as checkpoint:
        for name, numel in SUBGROUPS.items():
            stored = checkpoint.get(f"rank0/{name}").result()
            expected = stored
            if saved == "fp32":
                master = stored[:numel]
                assert torch.equal(partitions[name], master.bfloat16()), name
                layout = PackedLayout(PACKED_ROWS, numel, PRESETS["int8-compensated"])
                expected = torch.empty(layout.words)
                layout.encode(stored, expected, [(0, numel, torch.bfloat16)])
            else:
                assert torch.equal(partitions[name], checkpoint.get(f"rank0/{name}.low-precision").result())
            assert torch.equal(loader.stager.read(name).view(torch.uint8), expected.view(torch.uint8)), name
    step_directly(loader, partitions, parameters)
    loader.close()


def test_a_bad_conversion_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    tag, _ = saved_checkpoint(tmp_path, "fp32")
    with pytest.raises(ConfigError, match=r"state_precision: must be one of 'fp32'.*not 'int4'"):
        convert_checkpoint(tag, tag.with_name("converted"), "int4")
    with pytest.raises(ConfigError, match="partition_dtype must be one of"):
        convert_checkpoint(tag, tag.with_name("converted"), "int8-compensated", partition_dtype=torch.int8)
    with pytest.raises(ConfigError, match=r"destination .* exists"):
        convert_checkpoint(tag, tag, "int8")
    with pytest.raises(BufferMismatchError, match="holds no tierstore optimizer state"):
        convert_checkpoint(tmp_path, tag.with_name("converted"), "fp32")
    assert [entry.name for entry in tag.parent.iterdir()] == [tag.name]


def test_a_conversion_that_fails_midway_leaves_the_checkpoint_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write failing at the second object, converting into a new tag beside the checkpoint or
    into a save_dir of its own: no converted checkpoint (nor a part of one, nor the save_dir), and
    the original's files are unchanged and load."""
    tag, _ = saved_checkpoint(tmp_path, "int8-compensated")
    before = saved_state(tag)
    put = TierStore.put
    calls = itertools.count()

    def failing_put(store: TierStore, key: str, tensor: torch.Tensor, **options: Any) -> Any:
        if next(calls) % 2:
            raise OSError(28, "No space left on device")
        return put(store, key, tensor, **options)

    monkeypatch.setattr(TierStore, "put", failing_put)
    with pytest.raises(OSError, match="No space left"):
        convert_checkpoint(tag, tag.with_name("fp32"), "fp32")
    with pytest.raises(OSError, match="No space left"):
        convert_checkpoint(tag, tmp_path / "elsewhere" / "fp32", "fp32")  # a save_dir of its own
    monkeypatch.undo()
    assert next(calls) == 4  # each time, the first object was written
    assert [entry.name for entry in tag.parent.iterdir()] == [tag.name]
    assert not (tmp_path / "elsewhere").exists()
    assert saved_state(tag) == before
    loader, _, _ = direct_swapper(tmp_path / "loader", "int8-compensated", seed=1)
    loader.restore_checkpoint(tag / "tierstore" / "rank00")
    loader.close()


def test_deepspeeds_own_fp32_state_is_packed_as_it_is_imported(tmp_path: Path) -> None:
    """A checkpoint of DeepSpeed's own NVMe offload (fp32 masters and Adam moments) imported into
    ``int8-compensated`` state: each sub-group is stored as the packing of its rows, its
    partition takes the master rounded, and its step count is restored."""
    swapper, partitions, parameters = direct_swapper(tmp_path, "int8-compensated", seed=0)
    rows = [torch.cat([torch.randn(2 * numel), torch.rand(numel)]) for numel in SUBGROUPS.values()]
    masters, entries = [], []
    for numel, state in zip(SUBGROUPS.values(), rows, strict=True):
        master, exp_avg, exp_avg_sq = state.view(3, numel)
        masters.append(master)
        entries.append({"step": 4, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})
    swapper.import_deepspeed_state(parameters, masters, entries)
    for (name, numel), master, state, parameter in zip(
        SUBGROUPS.items(), masters, rows, parameters, strict=True
    ):
        layout = PackedLayout(PACKED_ROWS, numel, PRESETS["int8-compensated"])
        expected = torch.empty(layout.words)
        layout.encode(state, expected, [(0, numel, torch.bfloat16)])
        assert torch.equal(swapper.stager.read(name).view(torch.uint8), expected.view(torch.uint8)), name
        assert torch.equal(partitions[name], master.bfloat16()), name
        assert swapper.optimizer.state[parameter]["step"] == 4
    swapper.close()


def test_two_ranks_match_one_and_share_the_node_limit(scratch: Path) -> None:
    tiers = [
        {
            "name": "virtual",
            "paths": [
                {"name": "local", "backend": f"nvme://{scratch / 'local'}"},
                {
                    "name": "pfs",
                    "backend": f"nvme://{scratch / 'pfs'}",
                    "node_limit": {"key": f"pfs-{scratch.name}", "directory": str(scratch / "locks")},
                },
            ],
        }
    ]
    common = ["--offload", "tierstore", "--steps", "4", "--batch", "4", *SMALL, "--tiers", json.dumps(tiers)]
    one = train(*common, "--nvme", str(scratch / "one"), output=scratch / "one.json")
    two = train(
        *common,
        "--nvme",
        str(scratch / "two"),
        "--telemetry",
        str(scratch / "paths"),
        world=2,
        output=scratch / "two.json",
    )
    assert losses(two) == pytest.approx(losses(one), rel=BF16_TOLERANCE)
    history = [json.loads((scratch / f"paths.rank{rank}").read_text()) for rank in range(2)]
    for direction in ("read", "write"):
        intervals = sorted(
            (start, end, rank)
            for rank in range(2)
            for start, end, _, moved in history[rank]["pfs"]
            if moved == direction
        )
        assert {rank for *_, rank in intervals} == {0, 1}, direction  # both ranks used the shared path
        for (_, end, _), (start, _, _) in itertools.pairwise(intervals):
            assert start >= end, f"two {direction}s on the shared path at once across ranks"


def test_configuration_errors_name_the_field() -> None:
    good = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}},
        "tierstore": {"dram_budget": "1GiB"},
    }
    assert validate_config(good)["tierstore"] == {"dram_budget": "1GiB"}
    cases = {
        "tierstore": {k: v for k, v in good.items() if k != "tierstore"},
        "tierstore.cache_policy": {**good, "tierstore": {"cache_policy": "lru"}},
        "tierstore.tiers.0.placement": {
            **good,
            "tierstore": {"tiers": [{"name": "x", "backend": "dram://", "placement": "?"}]},
        },
        "zero_optimization.stage": {**good, "zero_optimization": {"stage": 2}},
        "zero_optimization.offload_optimizer": {
            **good,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        },
        "optimizer.type": {**good, "optimizer": {"type": "SGD"}},
    }
    for field, config in cases.items():
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            validate_config(config)


def test_bad_tierstore_section_values_name_the_field() -> None:
    """Booleans, fractions and strings are not counts: JSON ``true`` must not become 1."""
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}
    cases = {
        "prefetch_depth": [0, -1, 1.5, True, "2"],
        "workers": [0, True, 2.5, "4"],
        "dram_budget": [-1, True, 1.5, "lots"],
    }
    for field, values in cases.items():
        for value in values:
            config = {"optimizer": {"type": "AdamW"}, "zero_optimization": zero, "tierstore": {field: value}}
            with pytest.raises(ConfigError, match=rf"tierstore\.{field}: "):
                validate_config(config)
    activation_cases = {"budget": [-1, True, "lots"], "min_bytes": [False, "x"], "plan": ["sometimes", 1]}
    for field, values in activation_cases.items():
        for value in values:
            section = {"activations": {field: value}}
            config = {"optimizer": {"type": "AdamW"}, "zero_optimization": zero, "tierstore": section}
            with pytest.raises(ConfigError, match=rf"tierstore\.activations\.{field}: "):
                validate_config(config)


def test_the_section_takes_state_precision_as_the_optimizers_do() -> None:
    """A preset's name or a table of ``moments`` and ``master``; ``"auto"`` or nothing is fp32."""
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}}

    def config(section: dict[str, Any]) -> dict[str, Any]:
        return {"optimizer": {"type": "AdamW"}, "zero_optimization": zero, "tierstore": section}

    for name, preset in PRESETS.items():
        assert parse_section(validate_config(config({"state_precision": name}))).state_precision == preset
    table = {"moments": "bf16", "master": "bf16-compensated"}
    taken = parse_section(config({"state_precision": table})).state_precision
    assert (taken.moments, taken.master) == ("bf16", "bf16-compensated")
    for section in ({}, {"state_precision": "auto"}):
        assert parse_section(config(section)).state_precision == PRESETS["fp32"]
    for value in ["int4", "INT8", 8, None, {"moments": "int4"}, {"moments": "int8", "scale": 2}]:
        with pytest.raises(ConfigError, match=r"tierstore\.state_precision: .*must be one of 'fp32', 'bf16'"):
            validate_config(config({"state_precision": value}))


def test_a_run_leaves_no_empty_directories_behind(scratch: Path) -> None:
    """The store's tier (``<nvme_path>/tierstore/rank0``) and the folder DeepSpeed's engine copies
    checkpoints through (``<nvme_path>/zero_stage_3/tierstore/rank0``) are made for the run and
    removed at its end: a scratch store leaves nothing behind, not even empty directories; what
    was in ``nvme_path`` before stays."""
    nvme = scratch / "ds-nvme"
    nvme.mkdir()
    (nvme / "mine.txt").write_text("keep")
    train("--offload", "tierstore", *SMALL, "--steps", "1", "--nvme", str(nvme), output=scratch / "rows.json")
    assert sorted(path.name for path in nvme.rglob("*")) == ["mine.txt"]


def test_unsupported_deepspeed_versions_are_refused() -> None:
    assert check_deepspeed_version("0.19.8") == "0.19.8"
    for version in ("0.18.4", "0.20.0"):
        with pytest.raises(UnsupportedVersionError, match=f"DeepSpeed {version} is not supported"):
            check_deepspeed_version(version)
