"""The optimizer state in a DeepSpeed checkpoint (seam 7): where it goes and how its index reads.

A save copies every sub-group's state object into a persistent store of the checkpoint's own,
``<tag>/tierstore/rank<NN>/`` beside the engine's files ([`TierStore.copy_to`][]: hard links where
the store and the checkpoint share a file system, so no byte moves and the save takes a few metadata
operations), then writes the index (`CHECKPOINT_INDEX`: each sub-group's size, state tensors and
scalars, the ``state_precision`` the objects are stored in, and the optimizer's own counters),
which is the checkpoint's commit. A load copies the objects back the same way, or imports a
checkpoint of DeepSpeed's own NVMe offload from its swap files (`read_swap_file`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam
from pydantic import ByteSize
from tierstore.optimizer.state_precision import FP32_STATE, StatePrecision, state_precision

from tierstore.config import CacheConfig, StoreConfig, TierConfig
from tierstore.dtypes import dtype_from_name, dtype_name
from tierstore.errors import BufferMismatchError, ConfigError
from tierstore.store import TierStore

CHECKPOINT_FORMAT = 3
CHECKPOINT_INDEX = "tierstore-checkpoint.json"
"""A checkpoint's index, written last: its format, each sub-group's size, state tensors and
scalars, the ``state_precision`` of a compressed state (none for fp32 state), and the optimizer's
own counters."""


@dataclass(frozen=True)
class SavedSubGroup:
    """One sub-group as a checkpoint's index lists it."""

    numel: int
    """Elements of its fp32 partition (the master weights)."""
    states: tuple[str, ...]
    """The optimizer's state tensors, laid out after the master weights in this order."""
    scalars: Mapping[str, Any]
    """The optimizer's other state of it (Adam's ``step``): numbers and one-element tensors. When
    saving, the optimizer's whole state entry may be given: its tensors with elements (the state
    tensors, saved in the store object) are left out of the index."""


def checkpoint_folder(directory: str, tag: str) -> Path:
    """Where this rank's optimizer state goes in the engine's checkpoint ``directory``/``tag``."""
    return Path(directory) / tag / "tierstore" / f"rank{dist.get_rank():02d}"


def checkpoint_store(folder: Path) -> TierStore:
    """The persistent store of a checkpoint's optimizer state (objects and manifest in ``folder``)."""
    return TierStore.from_config(
        StoreConfig(
            cache=CacheConfig(budget=ByteSize(0)),
            tiers=[TierConfig(name="checkpoint", backend={"type": "nvme", "path": str(folder / "objects")})],
            manifest=str(folder / "manifest"),
        )
    )


def write_index(
    folder: Path,
    subgroups: Mapping[str, SavedSubGroup],
    extra: dict[str, Any],
    precision: StatePrecision = FP32_STATE,
) -> None:
    """Commit a checkpoint whose objects are in ``folder``'s store: its index, listing the
    sub-groups, the ``precision`` they are stored in and the optimizer's own counters (``extra``),
    written whole or not at all."""
    entries = {
        name: {"numel": saved.numel, "states": list(saved.states), "scalars": _encode_scalars(saved, name)}
        for name, saved in subgroups.items()
    }
    index = folder / CHECKPOINT_INDEX
    content: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "subgroups": entries, "extra": extra}
    if precision.compressed:
        content["state_precision"] = dataclasses.asdict(precision)
    temporary = index.with_name(f".{index.name}.tmp")
    temporary.write_text(json.dumps(content))
    os.replace(temporary, index)


def read_index(folder: Path) -> tuple[dict[str, SavedSubGroup], dict[str, Any], StatePrecision]:
    """A checkpoint's sub-groups, the ``extra`` its `write_index` was given and the precision its
    sub-groups are stored in; a [`BufferMismatchError`][] for an index that is missing, unreadable
    or of another format."""
    index = folder / CHECKPOINT_INDEX
    try:
        saved = json.loads(index.read_text())
    except (OSError, ValueError) as error:
        raise BufferMismatchError(f"{index}: not a readable tierstore checkpoint index ({error})") from None
    if saved.get("format") != CHECKPOINT_FORMAT:
        raise BufferMismatchError(f"{index}: format {saved.get('format')!r}, not {CHECKPOINT_FORMAT}")
    subgroups = {
        name: SavedSubGroup(
            entry["numel"], tuple(entry["states"]), _decode_scalars(entry["scalars"], f"{index}: {name}")
        )
        for name, entry in saved["subgroups"].items()
    }
    extra: dict[str, Any] = saved["extra"]
    try:
        precision = state_precision(saved.get("state_precision", {}), f"{index}: state_precision")
    except ConfigError as error:
        raise BufferMismatchError(str(error)) from None
    return subgroups, extra, precision


def read_swap_file(file: str, target: torch.Tensor) -> None:
    """Fill ``target`` from the start of one of DeepSpeed's swap files (a checkpoint of its own
    NVMe offload), which must hold at least that many bytes (it pads to its alignment)."""
    try:
        with open(file, "rb") as source:
            got = source.readinto(target.numpy().data.cast("B"))
    except FileNotFoundError:
        raise BufferMismatchError(f"{file}: missing from the checkpoint's offloaded tensors") from None
    if got != target.numel() * target.element_size():
        raise BufferMismatchError(f"{file}: holds {got} bytes, the sub-group needs {target.nbytes}")


def replay_adam_steps(optimizer: torch.optim.Optimizer) -> None:
    """After a load, bring ``DeepSpeedCPUAdam``'s kernel to the restored step count (any other
    optimizer keeps nothing of its own). The kernel keeps beta1**step and beta2**step (its bias
    corrections) as running products, one multiplication per step, and computes them with ``pow``
    after a jump, as the first update after a load would: the two differ in the last bits, and the
    resumed run would drift from the uninterrupted one. Replaying steps 1..N on a one-element
    tensor rebuilds the same products (N: the restored step count, the same for every sub-group
    that has had a gradient)."""
    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return
    steps = max((int(entry.get("step", 0)) for entry in optimizer.state.values()), default=0)
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    scratch = [torch.zeros(1) for _ in range(4)]  # weight, gradient, exp_avg, exp_avg_sq
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(
            optimizer.opt_id, step, group["lr"], beta1, beta2, group["eps"],
            group["weight_decay"], group["bias_correction"], *scratch,
        )  # fmt: skip


def _encode_scalars(saved: SavedSubGroup, name: str) -> dict[str, Any]:
    """A sub-group's `SavedSubGroup.scalars`, JSON-ready."""
    encoded: dict[str, Any] = {}
    for key, value in saved.scalars.items():
        if torch.is_tensor(value) and value.dim() == 0:
            encoded[key] = {"tensor": value.item(), "dtype": dtype_name(value.dtype)}
        elif isinstance(value, (bool, int, float)):
            encoded[key] = value
        elif not torch.is_tensor(value):
            raise BufferMismatchError(
                f"sub-group {name}: optimizer state {key!r} ({type(value).__name__}) cannot be saved"
            )
    return encoded


def _decode_scalars(encoded: dict[str, Any], where: str) -> dict[str, Any]:
    return {
        key: torch.tensor(value["tensor"], dtype=dtype_from_name(value["dtype"], f"{where}: {key}"))
        if isinstance(value, dict)
        else value
        for key, value in encoded.items()
    }
