"""The offloaded optimizers over parameters on a GPU (the device path), against torch's own AdamW on
the same GPU: every test here is marked ``gpu`` and skips without CUDA (the pipeline's order and
lifetimes are tested on a simulated device in tests/test_device_optimizer.py; its speed is
measured by ``python -m benchmarks.bench_optimizer --device cuda``).

Run them with ``pytest -m gpu`` on a GPU node, or through the GPU check (``tools/gpu_check.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.backends import open_backend
from tierstore.optimizer import OffloadedAdamW, OffloadedAPOLLO, StagedOptimizer, apollo
from tierstore.optimizer.device import DeviceStager
from tierstore.optimizer.state_kernels import BLOCK
from tierstore.optimizer.state_precision import PRESETS, PackedLayout

from tierstore import BufferMismatchError, Tier, TierStore
from tierstore.app.demo import GPT

from .helpers import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

HYPER: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MAX_NORM = 0.05
"""Small enough that every step clips."""
STEPS = 10
BATCH, LENGTH, VOCAB = 4, 32, 256


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Callable[..., TierStore]]:
    """Stores on an NVMe tier (O_DIRECT files under the test's directory), one per call."""
    opened: list[TierStore] = []

    def factory() -> TierStore:
        backend = open_backend(f"nvme://{tmp_path / f'state{len(opened)}'}?chunk_bytes=1MiB")
        opened.append(TierStore([Tier("state", backend)], cache_budget=0))
        return opened[-1]

    yield factory
    for store in opened:
        store.close()


def gpt(dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, width=128, layers=2, heads=4, length=LENGTH, dropout=0.0).to("cuda", dtype)


def llama(dtype: torch.dtype) -> torch.nn.Module:
    """A small Hugging Face Llama built from a config (no download)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
    )
    return transformers.LlamaForCausalLM(config).to("cuda", dtype)


MODELS: dict[str, Callable[[torch.dtype], torch.nn.Module]] = {"gpt": gpt, "llama": llama}


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The next-token loss of step ``step``'s batch (the same on every run), on the model's device."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=generator)
    tokens = tokens.to(next(model.parameters()).device)
    if isinstance(model, GPT):
        return model(tokens[:, :-1], tokens[:, 1:])
    return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


def backward(model: torch.nn.Module, step: int) -> None:
    """Step ``step``'s gradients into the model."""
    model.zero_grad(set_to_none=True)
    loss_of(model, step).backward()  # type: ignore[no-untyped-call]


class Reference:
    """torch's ``AdamW(fused=True)`` on the same GPU over fp32 master weights of a model's
    parameters: stepped on the model's gradients (in fp32, clipped by ``clip_grad_norm_``), so the
    two see the same gradients at every step."""

    def __init__(self, model: torch.nn.Module, max_grad_norm: float | None) -> None:
        self.params = list(model.parameters())
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, fused=True, **HYPER)
        self.max_grad_norm = max_grad_norm

    def step(self) -> None:
        for master, param in zip(self.masters, self.params, strict=True):
            master.grad = param.grad.detach().float().clone()  # type: ignore[union-attr]
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm)
        self.optimizer.step()


def train(model: torch.nn.Module, optimizer: StagedOptimizer, reference: Reference, steps: range) -> None:
    for step in steps:
        backward(model, step)
        optimizer.step()
        reference.step()


def assert_matches(optimizer: StagedOptimizer, reference: Reference, *, exact: bool) -> None:
    """Our master weights are torch's: to the bit where every step sees the same gradients
    unscaled (``exact``), within 1e-6 relative where clipping takes a norm of its own; the model's
    parameters are the master weights, rounded to their dtype."""
    for got, master, param in zip(
        optimizer.master_params(), reference.masters, optimizer.params, strict=True
    ):
        want = master.detach().cpu()
        if exact:
            assert torch.equal(got, want)
        else:
            assert relative_error(got, want) <= 1e-6
        assert torch.equal(param.detach().cpu(), got.to(param.dtype))


# -- exact: torch's fused AdamW on the same GPU ----------------------------------------------------------
@pytest.mark.parametrize("clip", [False, True], ids=["no-clipping", "clipping"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_matches_torchs_fused_adamw_on_the_same_gpu(
    stores: Callable[..., TierStore], name: str, dtype: torch.dtype, clip: bool
) -> None:
    """10 steps of a GPT and a Hugging Face Llama, fp32 and bf16 (fp32 master weights in the
    store), the state split across the GPU (gpu_budget), pinned host memory (dram_budget) and an
    NVMe tier, sub-groups cutting parameters."""
    model = MODELS[name](dtype)
    max_grad_norm = MAX_NORM if clip else None
    reference = Reference(model, max_grad_norm)
    numel = sum(p.numel() for p in model.parameters())
    state_bytes = (8 if dtype == torch.float32 else 12) * numel
    optimizer = OffloadedAdamW(
        model.parameters(),
        stores(),
        **HYPER,
        max_grad_norm=max_grad_norm,
        sub_group_size=numel // 8,
        gpu_budget=state_bytes // 5,  # one sub-group
        dram_budget=state_bytes,  # the ring (5 sub-groups) and about two more
    )
    stager = optimizer.stager
    assert isinstance(stager, DeviceStager) and optimizer.device == torch.device("cuda", 0)
    assert any(
        piece.length < optimizer.params[piece.param].numel()
        for sg in optimizer.subgroups
        for piece in sg.pieces
    )
    train(model, optimizer, reference, range(STEPS))
    assert stager.on_device and stager.resident and len(optimizer.subgroups) > 5  # and the NVMe tier
    assert_matches(optimizer, reference, exact=not clip)


def test_apollo_on_the_gpu_is_its_cpu_arithmetic(
    stores: Callable[..., TierStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OffloadedAPOLLO over a GPU model against the same over its CPU copy (whose arithmetic
    tests/test_apollo.py holds to apollo_torch's), with the projections the GPU draws given to
    both: equal within the bound of APOLLO's CPU tests."""
    draw = apollo.random_projection

    def drawn_on_the_gpu(
        shape: torch.Size, rank: int, side: str, seed: int, device: torch.device | None = None
    ) -> torch.Tensor:
        return draw(shape, rank, side, seed, torch.device("cuda")).to(device or "cpu")

    monkeypatch.setattr(apollo, "random_projection", drawn_on_the_gpu)
    on_gpu = gpt(torch.bfloat16)
    on_cpu = gpt(torch.bfloat16).cpu()

    def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        others = [p for p in model.parameters() if p.ndim != 2]
        return [{"params": matrices, "rank": 4, "update_proj_gap": 3, "scale": 1.0}, {"params": others}]

    options: dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.1, "sub_group_size": 40_000}
    ours = OffloadedAPOLLO(groups(on_gpu), stores(), gpu_budget="1MiB", max_grad_norm=1.0, **options)
    theirs = OffloadedAPOLLO(groups(on_cpu), stores(), max_grad_norm=1.0, **options)
    for step in range(STEPS):
        backward(on_gpu, step)
        for mine, twin in zip(on_gpu.parameters(), on_cpu.parameters(), strict=True):
            twin.grad = mine.grad.cpu()  # type: ignore[union-attr]
        ours.step()
        theirs.step()
    for got, want in zip(ours.master_params(), theirs.master_params(), strict=True):
        assert relative_error(got, want) <= 1e-5


# -- refused ---------------------------------------------------------------------------------------------
def test_a_model_on_the_cpu_and_the_gpu_is_refused_naming_the_parameter(
    stores: Callable[..., TierStore],
) -> None:
    model = gpt(torch.float32)
    model.norm.cpu()
    with pytest.raises(
        BufferMismatchError, match=r"params\.\d+: a parameter of shape \(128,\) is in host memory"
    ):
        OffloadedAdamW(model.parameters(), stores())


# -- device memory: within gpu_budget and the ring ------------------------------------------------------
def test_device_memory_of_a_step_is_within_gpu_budget_and_the_ring(stores: Callable[..., TierStore]) -> None:
    """torch.cuda.max_memory_allocated over a step, beyond the model and its gradients: the
    sub-groups kept on the GPU (within gpu_budget) and the ring (device_staging_bytes), never more,
    for a state four times gpu_budget."""
    params = [torch.nn.Parameter(torch.randn(1 << 20, device="cuda")) for _ in range(16)]
    sub_group_bytes = 8 << 20  # fp32 parameters: two moments, 8 bytes each
    gpu_budget = 4 * sub_group_bytes
    optimizer = OffloadedAdamW(params, stores(), sub_group_size=1 << 20, gpu_budget=gpu_budget)
    for param in params:
        param.grad = torch.randn_like(param)
    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        optimizer.step()
        torch.cuda.synchronize()
        above = torch.cuda.max_memory_allocated() - before
        assert above <= gpu_budget + optimizer.device_staging_bytes, step
        assert torch.cuda.memory_allocated() - before <= (gpu_budget if step == 0 else 0)
    assert optimizer.stager.device_kept_bytes == gpu_budget  # type: ignore[attr-defined]


# -- state dicts and snapshots between a GPU run and a CPU run --------------------------------------------
def copy_of(model: GPT, device: str) -> GPT:
    """A GPT like ``model`` (its dtype and weights) on ``device``."""
    copy = gpt(next(model.parameters()).dtype).to(device)
    copy.load_state_dict(model.state_dict())
    return copy


def test_state_dicts_move_between_a_gpu_run_and_a_cpu_run(stores: Callable[..., TierStore]) -> None:
    """An fp32 GPT trained on the GPU; its state dict continues on the CPU in ours and in torch's
    fused AdamW alike, to the bit; the CPU run's goes back to the GPU, the same."""
    options: dict[str, Any] = {**HYPER, "sub_group_size": 50_000}
    model = gpt(torch.float32)
    ours = OffloadedAdamW(model.parameters(), stores(), gpu_budget="1MiB", **options)
    for step in range(3):
        backward(model, step)
        ours.step()
    for device, steps in (("cpu", range(3, 6)), ("cuda", range(6, 9))):
        saved = ours.state_dict()
        assert all(v.device.type == "cpu" for entry in saved["state"].values() for v in entry.values())
        model, twin = copy_of(model, device), copy_of(model, device)
        budget = "1MiB" if device == "cuda" else None
        ours = OffloadedAdamW(model.parameters(), stores(), gpu_budget=budget, **options)
        ours.load_state_dict(saved)
        theirs = torch.optim.AdamW(twin.parameters(), fused=True, **HYPER)
        theirs.load_state_dict(saved)
        for step in steps:
            backward(model, step)
            for param, param_twin in zip(model.parameters(), twin.parameters(), strict=True):
                param_twin.grad = param.grad.clone()  # type: ignore[union-attr]
            ours.step()
            theirs.step()
        for got, want in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(got, want), device


def test_a_snapshot_of_a_gpu_run_loads_into_a_cpu_run(
    stores: Callable[..., TierStore], tmp_path: Path
) -> None:
    """A bf16 model's fp32 master weights, some kept on the GPU, through a snapshot into a CPU run
    of the same model."""
    model = gpt(torch.bfloat16)
    on_gpu = OffloadedAdamW(model.parameters(), stores(), sub_group_size=50_000, gpu_budget="1MiB")
    for step in range(3):
        backward(model, step)
        on_gpu.step()
    assert on_gpu.stager.on_device  # type: ignore[attr-defined]
    on_gpu.save_snapshot(tmp_path / "state.h5")
    on_cpu = OffloadedAdamW(copy_of(model, "cpu").parameters(), stores(), sub_group_size=50_000)
    on_cpu.load_snapshot(tmp_path / "state.h5")
    for got, want in zip(on_cpu.master_params(), on_gpu.master_params(), strict=True):
        assert torch.equal(got, want)
    assert on_cpu.step_count == on_gpu.step_count == 3


# -- compressed state on the GPU --------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "int8", "int8-compensated"])
def test_compressed_state_packs_on_the_gpu_as_on_the_cpu(precision: str) -> None:
    """The packing kernels are torch operations: on the GPU they make the CPU's bytes, and unpack
    them to the CPU's values."""
    numel = 3 * BLOCK + 77
    rows = torch.randn(3, numel)
    rows[2] = rows[2].square()
    params = rows[0].to(torch.bfloat16)
    layout = PackedLayout(("master", "signed", "nonnegative"), numel, PRESETS[precision])
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for device in ("cpu", "cuda"):
        words = torch.zeros(layout.words, device=device)
        layout.encode(rows.to(device), words, [(0, numel, torch.bfloat16)])
        restored = torch.empty(3, numel, device=device)
        layout.decode(words, restored, [(0, params.to(device).float())])
        packed[device] = (words.cpu().view(torch.int32), restored.cpu())
    assert torch.equal(packed["cuda"][0], packed["cpu"][0])
    assert torch.equal(packed["cuda"][1], packed["cpu"][1])


@pytest.mark.parametrize("precision", ["bf16", "int8-compensated"])
def test_compressed_state_trains_on_the_gpu_and_resumes_on_the_cpu(
    stores: Callable[..., TierStore], precision: str
) -> None:
    """A bf16 GPT on the GPU in a compressed precision: close to torch's fused AdamW over fp32
    masters, fewer bytes in each slot than fp32's; its state dict loads into a CPU run byte for
    byte."""
    model = gpt(torch.bfloat16)
    reference = Reference(model, None)
    options: dict[str, Any] = {**HYPER, "sub_group_size": 50_000}
    ours = OffloadedAdamW(
        model.parameters(), stores(), gpu_budget="1MiB", state_precision=precision, **options
    )
    fp32 = OffloadedAdamW(gpt(torch.bfloat16).parameters(), stores(), gpu_budget="1MiB", **options)
    assert ours.stager.slot_bytes < fp32.stager.slot_bytes
    train(model, ours, reference, range(STEPS))
    for got, master in zip(ours.master_params(), reference.masters, strict=True):
        assert relative_error(got, master.detach().cpu()) <= 1e-2
    saved = ours.state_dict()
    on_cpu = OffloadedAdamW(
        copy_of(model, "cpu").parameters(), stores(), state_precision=precision, **options
    )
    on_cpu.load_state_dict(saved)
    for mine, theirs in zip(
        on_cpu.state_dict()["packed_state"]["subgroups"], saved["packed_state"]["subgroups"], strict=True
    ):
        assert torch.equal(mine["data"], theirs["data"])


# -- FSDP2 on the GPU ------------------------------------------------------------------------------------
@pytest.fixture
def nccl(tmp_path: Path) -> Iterator[None]:
    """A one-rank NCCL process group (FSDP2's GPU setup), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_on_the_gpu_matches_torchs_fused_adamw_and_checkpoints_stream(
    stores: Callable[..., TierStore], nccl: None, tmp_path: Path
) -> None:
    """FSDPOffloadedAdamW over fully_shard's CUDA shards (NCCL) with its own clipping, against
    torch's fused AdamW over a twin sharded model on the same gradients, clipped by
    clip_grad_norm_: within 1e-6. A save through tierstore's streaming DCP checkpoint, two more
    steps, and a load give back the saved weights and state, to the bit."""
    from tierstore.integrations import fsdp
    from torch.distributed.fsdp import fully_shard

    def sharded() -> GPT:
        model = gpt(torch.float32)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    model, twin = sharded(), sharded()
    ours = fsdp.FSDPOffloadedAdamW(model, stores(), **HYPER, max_grad_norm=MAX_NORM, sub_group_size=20_000)
    torchs = torch.optim.AdamW(twin.parameters(), fused=True, **HYPER)
    assert isinstance(ours.stager, DeviceStager)

    def whole(tensors: Any) -> list[torch.Tensor]:
        return [tensor.full_tensor().cpu() for tensor in tensors]

    def state_of(optimizer: fsdp.FSDPOffloadedAdamW) -> list[torch.Tensor]:
        entries = optimizer.state_dict()["state"]
        return whole(entries[n][part] for n in sorted(entries) for part in ("exp_avg", "exp_avg_sq"))

    for step in range(5):
        backward(model, step)
        for param, param_twin in zip(model.parameters(), twin.parameters(), strict=True):
            param_twin.grad = param.grad.clone()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(list(twin.parameters()), MAX_NORM)
        ours.step()
        torchs.step()
    for got, want in zip(whole(model.parameters()), whole(twin.parameters()), strict=True):
        assert relative_error(got, want) <= 1e-6
    fsdp.save(tmp_path / "checkpoint", model, ours)
    saved_weights, saved_state = whole(model.parameters()), state_of(ours)
    for step in range(5, 7):
        backward(model, step)
        ours.step()
    fsdp.load(tmp_path / "checkpoint", model, ours)
    assert all(torch.equal(a, b) for a, b in zip(whole(model.parameters()), saved_weights, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(state_of(ours), saved_state, strict=True))
    assert ours.step_count == 5
