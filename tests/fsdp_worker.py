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
NVMe tier per rank under it, else DRAM), ``dram_budget``, ``sub_group_size``.
"""

from __future__ import annotations

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
from tierstore.demo import GPT

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


def train_step(model: GPT, optimizer: torch.optim.Optimizer, run: dict[str, Any], step: int) -> float:
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


def main() -> None:
    run = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    if run.get("scenario") in ("errors", "rss"):
        try:
            figures: dict[str, Any] = setup_errors() if run["scenario"] == "errors" else peak_rss(run)
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
        )
        result["fp32_shards"] = optimizer.fp32_shards
        result["state_keys"] = sorted(store.keys())[:2]
        local = sum(fsdp.local_shard(p).numel() for p in optimizer.params)
        result["state_per_element"] = sum(optimizer.state_numel(sg) for sg in optimizer.subgroups) / local
        first = 0
        if run.get("resume"):
            before = tier_bytes(store)
            first = load(run, model, optimizer)
            after = tier_bytes(store)
            result["load_bytes"] = {
                "read": after["bytes_read"] - before["bytes_read"],
                "written": after["bytes_written"] - before["bytes_written"],
                "state": 4 * sum(optimizer.state_numel(sg) for sg in optimizer.subgroups),
            }
        losses = []
        for step in range(first, run["steps"]):
            losses.append(train_step(model, optimizer, run, step))
            if run.get("save_at") == step + 1:
                save(run, model, optimizer, step + 1)
        result["losses"] = losses
        params = [full(p) for p in model.parameters()]
        if run.get("reference"):
            reference = build(run)
            # torch's fused kernel takes DTensors and plain tensors in separate groups only
            sharded = [p for p in reference.parameters() if isinstance(p, DTensor)]
            plain = [p for p in reference.parameters() if not isinstance(p, DTensor)]
            groups: list[dict[str, Any]] = [{"params": sharded}, *([{"params": plain}] if plain else [])]
            torch_adamw = torch.optim.AdamW(groups, **HYPER, fused=run.get("fused"))
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
