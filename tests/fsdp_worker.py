"""One rank of an FSDP2 training run for tests/test_fsdp.py (gloo, CPU), spawned by the test.

The run is described by a JSON document (argv[1]); RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
come from the environment. Rank 0 writes the result (losses, relative errors against the
reference, gathered parameters) to the document's ``output``.

Keys: ``setup`` (``fp32``: fp32 model; ``mp``: fp32 shards with
``MixedPrecisionPolicy(param_dtype=bf16)``; ``bf16``: a bf16 model), ``clip`` (None, ``optimizer``:
``max_grad_norm``, ``torch``: ``clip_grad_norm_`` on the DTensor gradients), ``mixed`` (the root
module left unsharded: only the blocks are sharded), ``steps``, ``reference`` (also train
FSDP2 + ``torch.optim.AdamW`` on the same model and data), ``save_at`` + ``checkpoint`` (save after
that step), ``resume`` (load ``checkpoint`` first and continue from its step), ``state_dir`` (an
NVMe tier per rank under it, else DRAM), ``dram_budget``, ``sub_group_size``, ``state_precision``
(with a compressed one, the stored bytes' digests after the save and after the load). ``scenario``:
``errors`` (the refused setups), ``rss`` (peak RSS of a step and a save), ``interop`` (DCP
checkpoints from tierstore's optimizer resumed by torch's fused AdamW and the reverse, under
``checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tierstore.backends import open_backend
from tierstore.integrations import fsdp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tierstore import Tier, TierStore
from tierstore.app.demo import GPT

HYPER: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MAX_NORM = 0.05
"""Small enough that every step clips."""
GLOBAL_BATCH, LENGTH, VOCAB = 4, 16, 64


def build(run: dict[str, Any]) -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, width=32, layers=2, heads=2, length=LENGTH, dropout=0.0)
    if run["setup"] == "bf16":
        model = model.to(torch.bfloat16)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16) if run["setup"] == "mp" else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    if not run.get("mixed"):
        fully_shard(model, mp_policy=policy)
    return model


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch (the same global batch for any world)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH + 1), generator=generator)
    share = tokens.chunk(world)[rank]
    return share[:, :-1], share[:, 1:]


def train_step(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    run: dict[str, Any],
    step: int,
    coefficient_errors: list[float] | None = None,
) -> float:
    """One training step; with ``coefficient_errors`` and the optimizer's own clipping, the relative
    difference between the clipping coefficient it takes and the one ``clip_grad_norm_``'s norm
    gives, on this step's gradients, is appended to it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batch(step, rank, world)
    loss = model(tokens, targets)
    loss.backward()
    if run.get("mixed"):  # the unsharded modules' gradients, averaged as replicate() would
        for param in model.parameters():
            if not isinstance(param, DTensor) and param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world
    if run.get("clip") == "torch" or (
        run.get("clip") == "optimizer" and not isinstance(optimizer, fsdp.FSDPOffloadedAdamW)
    ):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if (
        run.get("clip") == "optimizer"
        and coefficient_errors is not None
        and isinstance(optimizer, fsdp.FSDPOffloadedAdamW)
    ):
        ours = optimizer._gradient_coefficient(1.0)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        total = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        theirs = min(1.0, MAX_NORM / (total + 1e-6))
        assert ours is not None
        coefficient_errors.append(abs(ours - theirs) / theirs)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return float(mean) / world


def save(run: dict[str, Any], model: GPT, optimizer: fsdp.FSDPOffloadedAdamW, step: int) -> None:
    """Checkpoint after ``step``: streamed (:func:`fsdp.save`), or ``eager``: torch's own
    ``get_state_dict`` + ``dcp.save``, the optimizer's state dict materialised."""
    if not run.get("eager"):
        fsdp.save(run["checkpoint"], model, optimizer, step=torch.tensor(step))
        return
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step)}
    dcp_save(state, checkpoint_id=run["checkpoint"])


def load(run: dict[str, Any], model: GPT, optimizer: fsdp.FSDPOffloadedAdamW) -> int:
    """Restore :func:`save`'s checkpoint the same way; returns its step."""
    if not run.get("eager"):
        return int(fsdp.load(run["checkpoint"], model, optimizer, step=torch.tensor(0))["step"])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    step = torch.tensor(0)
    dcp_load(
        {"model": model_state, "optimizer": optimizer_state, "step": step}, checkpoint_id=run["checkpoint"]
    )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    return int(step)


def stored_digests(optimizer: fsdp.FSDPOffloadedAdamW) -> list[str]:
    """Each rank's stored state bytes, hashed, in rank order."""
    digest = hashlib.sha256()
    for saved in optimizer._packed_state()["subgroups"]:
        digest.update(saved["data"].numpy().tobytes())
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    return digests


def full(param: torch.Tensor) -> torch.Tensor:
    param = param.detach()
    return (param.full_tensor() if isinstance(param, DTensor) else param).float().clone()


def open_store(run: dict[str, Any], rank: int) -> TierStore:
    if run.get("state_dir"):
        backend = open_backend(f"nvme://{Path(run['state_dir']) / f'rank{rank}'}?chunk_bytes=64KiB")
    else:
        backend = open_backend("dram://")
    return TierStore([Tier("state", backend)], cache_budget=0)


def tier_bytes(store: TierStore) -> dict[str, int]:
    """The bytes the store's tier has read and written so far."""
    tier = store.stats()["tiers"]["state"]
    return {"bytes_read": int(tier["bytes_read"]), "bytes_written": int(tier["bytes_written"])}


def memory_kib(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def reset_peak() -> None:
    """Start the kernel's peak-RSS count (VmHWM) again from the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss(run: dict[str, Any]) -> dict[str, Any]:
    """The RSS the optimizer step and a streamed DCP save add at their peak, measured by the
    kernel (VmHWM after resetting it), against the size of the state in the store."""
    torch.manual_seed(0)
    model = GPT(vocab=256, width=256, layers=4, heads=4, length=32, dropout=0.0).to(torch.bfloat16)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    store = open_store(run, dist.get_rank())
    try:
        optimizer = fsdp.FSDPOffloadedAdamW(
            model, store, sub_group_size=run["sub_group_size"], dram_budget=run["dram_budget"]
        )
        state_bytes = sum(4 * optimizer.state_numel(sg) for sg in optimizer.subgroups)
        figures: dict[str, Any] = {"state_bytes": state_bytes, "dram_budget": run["dram_budget"]}
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        for step in range(2):  # the first allocates the gradients and torch's own caches
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            before = memory_kib("VmRSS")
            reset_peak()
            optimizer.step()
            figures[f"step{step + 1}_peak_increase_bytes"] = 1024 * (memory_kib("VmHWM") - before)
            optimizer.zero_grad(set_to_none=True)
        before = memory_kib("VmRSS")
        reset_peak()
        fsdp.save(run["checkpoint"], model, optimizer)
        figures["save_peak_increase_bytes"] = 1024 * (memory_kib("VmHWM") - before)
        optimizer.close()
        return figures
    finally:
        store.close()


def offloaded(policy: Any) -> torch.nn.Module:
    layer = torch.nn.Linear(8, 8)
    fully_shard(layer, offload_policy=policy)
    return layer


def bf16_layer() -> torch.nn.Linear:
    layer = torch.nn.Linear(4, 4).bfloat16()
    fully_shard(layer)
    return layer


def setup_errors() -> dict[str, list[str]]:
    """Each refused setup: the exception's class and message (or "accepted")."""
    from tierstore.optimizer import APOLLO_MINI, OffloadedAdamW, OffloadedAPOLLO
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Shard, distribute_tensor

    store = TierStore([Tier("state", open_backend("dram://"))], cache_budget=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = build({"setup": "fp32"})
    cases: dict[str, Any] = {
        "apollo": lambda: OffloadedAPOLLO(
            [{"params": [p for p in sharded.parameters() if p.ndim == 2], **APOLLO_MINI}], store
        ),
        "plain_adamw_on_dtensors": lambda: OffloadedAdamW(sharded.parameters(), store),
        "cpu_offload_policy": lambda: fsdp.FSDPOffloadedAdamW(
            offloaded(CPUOffloadPolicy(pin_memory=False)), store
        ),
        "no_dtensor": lambda: fsdp.FSDPOffloadedAdamW(torch.nn.Linear(8, 8), store),
        "column_sharded": lambda: fsdp.FSDPOffloadedAdamW(
            [torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)]))], store
        ),
        "mixed_dtypes": lambda: fsdp.FSDPOffloadedAdamW(
            [next(sharded.parameters()), bf16_layer().weight], store
        ),
    }
    found: dict[str, list[str]] = {}
    for name, make in cases.items():
        try:
            make().close()
            found[name] = ["accepted", ""]
        except Exception as error:
            found[name] = [type(error).__name__, str(error)]
    store.close()
    return found


def torch_fused_adamw(model: GPT) -> torch.optim.AdamW:
    """torch's AdamW on its fused kernel (the offloaded optimizer's arithmetic) over ``model``."""
    # torch's fused kernel takes DTensors and plain tensors in separate groups only
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    groups: list[dict[str, Any]] = [{"params": sharded}, *([{"params": plain}] if plain else [])]
    return torch.optim.AdamW(groups, **HYPER, fused=True)


def interop(run: dict[str, Any]) -> dict[str, Any]:
    """DCP checkpoints passed between FSDPOffloadedAdamW and torch's fused AdamW with stock calls
    (``get_state_dict`` + ``dcp.save``, ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``), and
    tierstore's :func:`fsdp.save` / :func:`fsdp.load`: each resumed run's losses and its largest
    parameter difference from torch's fused AdamW trained straight through (clip_grad_norm_ on every
    step, fp32 arithmetic: equal to the bit)."""
    rank = dist.get_rank()
    run = {**run, "clip": "torch"}
    steps, save_at, root = run["steps"], run["save_at"], Path(run["checkpoint"])

    def trained(make: Any, first: int, last: int, model: GPT | None = None, restore: Any = None) -> Any:
        model = build(run) if model is None else model
        optimizer = make(model)
        if restore is not None:
            restore(model, optimizer)
        losses = [train_step(model, optimizer, run, step) for step in range(first, last)]
        return model, optimizer, losses

    stores: list[TierStore] = []

    def ours(model: GPT) -> fsdp.FSDPOffloadedAdamW:
        stores.append(open_store({}, rank))
        return fsdp.FSDPOffloadedAdamW(model, stores[-1], **HYPER, sub_group_size=3000)

    def stock_save(path: Path) -> Any:
        def save(model: GPT, optimizer: torch.optim.Optimizer) -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp_save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))

        return save

    def stock_load(path: Path) -> Any:
        def load(model: GPT, optimizer: torch.optim.Optimizer) -> None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp_load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

        return load

    def streamed_load(path: Path) -> Any:
        return lambda model, optimizer: fsdp.load(str(path), model, optimizer)

    try:
        straight, _, straight_losses = trained(torch_fused_adamw, 0, steps)
        expected = [full(p) for p in straight.parameters()]
        # tierstore's optimizer saves after save_at steps: streamed, and with torch's own calls
        model, optimizer, _ = trained(ours, 0, save_at)
        fsdp.save(str(root / "ours-streamed"), model, optimizer)
        stock_save(root / "ours-stock")(model, optimizer)
        # torch's fused AdamW saves after save_at steps, with torch's own calls
        model, optimizer, _ = trained(torch_fused_adamw, 0, save_at)
        stock_save(root / "torch-stock")(model, optimizer)
        resumes = {
            "torch from ours (fsdp.save)": (torch_fused_adamw, stock_load(root / "ours-streamed")),
            "torch from ours (dcp.save)": (torch_fused_adamw, stock_load(root / "ours-stock")),
            "ours from torch (dcp.load)": (ours, stock_load(root / "torch-stock")),
            "ours from torch (fsdp.load)": (ours, streamed_load(root / "torch-stock")),
        }
        found: dict[str, Any] = {"world": dist.get_world_size()}
        for name, (make, restore) in resumes.items():
            model, optimizer, losses = trained(make, save_at, steps, restore=restore)
            if isinstance(optimizer, torch.optim.AdamW):
                found[f"{name}: fused"] = [group["fused"] for group in optimizer.param_groups]
            found[name] = {
                "losses_equal": losses == straight_losses[save_at:],
                "largest_difference": max(
                    float((full(p) - e).abs().max())
                    for p, e in zip(model.parameters(), expected, strict=True)
                ),
            }
        return found
    finally:
        for store in stores:
            store.close()


def main() -> None:
    run = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    if run.get("scenario") in ("errors", "rss", "interop"):
        try:
            figures: dict[str, Any] = (
                setup_errors()
                if run["scenario"] == "errors"
                else {"rss": peak_rss, "interop": interop}[run["scenario"]](run)
            )
            if dist.get_rank() == 0:
                Path(run["output"]).write_text(json.dumps(figures))
        finally:
            dist.barrier()
            dist.destroy_process_group()
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"world": world}
    store = open_store(run, rank)
    try:
        model = build(run)
        optimizer = fsdp.FSDPOffloadedAdamW(
            model,
            store,
            **HYPER,
            max_grad_norm=MAX_NORM if run.get("clip") == "optimizer" else None,
            sub_group_size=run.get("sub_group_size", 3000),
            dram_budget=run.get("dram_budget"),
            state_precision=run.get("state_precision", "fp32"),
        )
        compressed = optimizer.precision.compressed
        result["fp32_shards"] = optimizer.fp32_shards
        result["state_keys"] = sorted(store.keys())[:2]
        local = sum(fsdp.local_shard(p).numel() for p in optimizer.params)
        result["state_per_element"] = sum(optimizer.state_numel(sg) for sg in optimizer.subgroups) / local
        first = 0
        if run.get("resume"):
            before = tier_bytes(store)
            first = load(run, model, optimizer)
            if compressed:
                result["loaded_digests"] = stored_digests(optimizer)
            after = tier_bytes(store)
            result["load_bytes"] = {
                "read": after["bytes_read"] - before["bytes_read"],
                "written": after["bytes_written"] - before["bytes_written"],
                "state": 4 * sum(optimizer.state_numel(sg) for sg in optimizer.subgroups),
            }
        losses = []
        coefficient_errors: list[float] = []
        for step in range(first, run["steps"]):
            losses.append(train_step(model, optimizer, run, step, coefficient_errors))
            if run.get("save_at") == step + 1:
                save(run, model, optimizer, step + 1)
                if compressed:
                    result["saved_digests"] = stored_digests(optimizer)
        result["losses"] = losses
        result["coefficient_errors"] = coefficient_errors
        params = [full(p) for p in model.parameters()]
        if run.get("reference"):
            reference = build(run)
            torch_adamw = torch_fused_adamw(reference)
            result["reference_losses"] = [
                train_step(reference, torch_adamw, run, s) for s in range(run["steps"])
            ]
            errors = [
                float((mine - full(theirs)).norm() / full(theirs).norm().clamp_min(1e-30))
                for mine, theirs in zip(params, reference.parameters(), strict=True)
            ]
            result["max_relative_error"] = max(errors)
            reference_params = [full(p) for p in reference.parameters()]
            if rank == 0:
                torch.save(reference_params, Path(run["output"]).with_suffix(".reference.pt"))
        if run.get("mixed"):  # the replicated parameters stayed identical on every rank
            replicas = [p.detach().float() for p in model.parameters() if not isinstance(p, DTensor)]
            result["replicated"] = len(replicas)
            spread = 0.0
            for p in replicas:
                low, high = p.clone(), p.clone()
                dist.all_reduce(low, op=dist.ReduceOp.MIN)
                dist.all_reduce(high, op=dist.ReduceOp.MAX)
                spread = max(spread, float((high - low).abs().max()))
            result["replica_spread"] = spread
        optimizer.close()
        if rank == 0:
            torch.save(params, Path(run["output"]).with_suffix(".pt"))
            Path(run["output"]).write_text(json.dumps(result))
    finally:
        store.close()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # gloo's threads can abort a normal interpreter exit
