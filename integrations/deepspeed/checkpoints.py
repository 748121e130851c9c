"""The optimizer state in a DeepSpeed checkpoint (seam 7): where it goes and how its index reads.

A save copies every sub-group's state object into a persistent store of the checkpoint's own,
``<tag>/tierstore/rank<NN>/`` beside the engine's files ([`TierStore.copy_to`][]: hard links where
the store and the checkpoint share a file system, so no byte moves and the save takes a few metadata
operations), then writes the index (`CHECKPOINT_INDEX`: each sub-group's size, state tensors and
scalars, the ``state_precision`` the objects are stored in, and the optimizer's own counters),
which is the checkpoint's commit. A load copies the objects back the same way, or imports a
checkpoint of DeepSpeed's own NVMe offload from its swap files (`read_swap_file`).
`convert_checkpoint` rewrites a checkpoint's optimizer state into another ``state_precision`` (a
new checkpoint beside it), for an engine configured with that precision.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.ops.adam import DeepSpeedCPUAdam
from pydantic import ByteSize
from tierstore.optimizer.state_precision import FP32_STATE, PackedLayout, RowKind, StatePrecision
from tierstore.optimizer.state_precision import state_precision as as_state_precision

from tierstore._directories import missing_directories, remove_empty
from tierstore.config import CacheConfig, StoreConfig, TierConfig
from tierstore.dtypes import dtype_from_name, dtype_name
from tierstore.errors import BufferMismatchError, ConfigError
from tierstore.store import TierStore

CHECKPOINT_FORMAT = 3
CHECKPOINT_INDEX = "tierstore-checkpoint.json"
"""A checkpoint's index, written last: its format, each sub-group's size, state tensors and
scalars, the ``state_precision`` of a compressed state (none for fp32 state), and the optimizer's
own counters."""
CHECKPOINT_SUBFOLDER = "tierstore"
"""The folder of a checkpoint's tag that holds the optimizer state, one ``rank<NN>`` folder each."""
ADAM_STATES = ("exp_avg", "exp_avg_sq")
"""The state tensors a compressed sub-group holds, in order (a sub-group not yet updated holds
none: its moments are zeros)."""
PACKED_ROWS: tuple[RowKind, ...] = ("master", "signed", "nonnegative")
"""What each row of a compressed sub-group holds: the master weights, then `ADAM_STATES`."""
PARTITION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""The dtypes of a model's partitions that a compensated master is stored against."""
PARTITION_SUFFIX = ".low-precision"
"""Ends the checkpoint store's key of a compensated master's low-precision partition (after the
sub-group's key)."""


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
    return Path(directory) / tag / CHECKPOINT_SUBFOLDER / f"rank{dist.get_rank():02d}"


def checkpoint_store(folder: Path, *, read_only: bool = False) -> TierStore:
    """The persistent store of a checkpoint's optimizer state (objects and manifest in ``folder``),
    opened ``read_only`` where nothing may change in it."""
    return TierStore.from_config(
        StoreConfig(
            cache=CacheConfig(budget=ByteSize(0)),
            tiers=[TierConfig(name="checkpoint", backend={"type": "nvme", "path": str(folder / "objects")})],
            manifest=str(folder / "manifest"),
        ),
        read_only=read_only,
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
        precision = as_state_precision(saved.get("state_precision", {}), f"{index}: state_precision")
    except ConfigError as error:
        raise BufferMismatchError(str(error)) from None
    return subgroups, extra, precision


def convert_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    state_precision: str | StatePrecision | dict[str, str] = "fp32",
    *,
    partition_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write a copy of the engine checkpoint ``source`` whose optimizer state is stored in
    ``state_precision``, at ``destination``, for an engine whose ``tierstore.state_precision`` is
    that (a checkpoint loads only into an engine of the precision it holds).

    ``destination`` is built whole in a hidden folder beside it and renamed into place last, so a
    failure leaves no destination, and ``source`` is only read. The engine's own files are copied
    (not linked: a save into one tag would rewrite the other's); each rank's sub-groups are decoded
    to fp32 and encoded again: a compressed sub-group's moments dequantised and a compensated master
    settled (the master its low-precision partition rounds from, as the engine hands it to
    DeepSpeed), so the fp32 state is the compressed one's values exactly; fp32 state is quantised
    as an engine of that precision packs it, a compensated master against its partition (the master
    rounded to nearest, as DeepSpeed copies it). An engine loads it with
    ``load_checkpoint(save_dir, tag)``, ``tag`` being ``destination``'s name (``latest`` is not
    written).

    Args:
        source: the checkpoint's tag folder (``<save_dir>/<tag>``), saved by an engine with
            tierstore's DeepSpeed section.
        destination: the converted checkpoint's tag folder (``<save_dir>/<new tag>``, in the same
            ``save_dir`` or another, made if missing); must not exist.
        state_precision: the precision to store the state in, as the section's ``state_precision``
            takes it: a preset's name (``"fp32"``...), a `StatePrecision` or a mapping of its fields.
        partition_dtype: the model's low-precision dtype (``torch.bfloat16``, ``torch.float16``,
            ``torch.float32`` for an fp32 model), which a ``bf16-compensated`` master is stored
            against when ``source`` holds none (its master is fp32); a compensated ``source``'s
            partitions keep their own.

    Raises:
        ConfigError: a bad ``state_precision``, or a ``destination`` that exists.
        BufferMismatchError: ``source`` holds no tierstore optimizer state, or state that does not
            read back (a missing object or partition; state tensors other than Adam's for a
            compressed precision).
    """
    precision = as_state_precision(state_precision)
    if partition_dtype not in PARTITION_DTYPES:
        raise ConfigError(
            f"convert_checkpoint: partition_dtype must be one of {', '.join(map(str, PARTITION_DTYPES))}, "
            f"not {partition_dtype!r}"
        )
    source, destination = Path(source), Path(destination)
    if destination.exists():
        raise ConfigError(f"convert_checkpoint: destination {destination} exists")
    ranks = sorted(
        index.parent for index in (source / CHECKPOINT_SUBFOLDER).glob(f"rank*/{CHECKPOINT_INDEX}")
    )
    if not ranks:
        raise BufferMismatchError(f"{source}: holds no tierstore optimizer state ({CHECKPOINT_INDEX})")
    made = missing_directories(destination.parent)
    destination.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        shutil.copytree(
            source,
            building,
            ignore=lambda folder, _: [CHECKPOINT_SUBFOLDER] if Path(folder) == source else [],
            dirs_exist_ok=True,
        )
        for rank in ranks:
            _convert_rank(rank, building / CHECKPOINT_SUBFOLDER / rank.name, precision, partition_dtype)
        os.rename(building, destination)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        remove_empty(made)
        raise


def _convert_rank(
    source: Path, destination: Path, precision: StatePrecision, partition_dtype: torch.dtype
) -> None:
    """One rank's optimizer state (`convert_checkpoint`): the store and index in ``source``
    rewritten in ``precision`` into ``destination``, the index last."""
    subgroups, extra, saved_precision = read_index(source)
    destination.mkdir(parents=True)
    with (
        checkpoint_store(source, read_only=True) as saved,
        checkpoint_store(destination) as converted,
    ):
        keys = {key.rpartition("/")[2]: key for key in saved}  # by sub-group name
        for name, subgroup in subgroups.items():
            where = f"{source}: sub-group {name}"
            if precision.compressed and subgroup.states not in ((), ADAM_STATES):
                raise BufferMismatchError(
                    f"{where}: state_precision {precision.name!r} stores Adam's "
                    f"{' and '.join(ADAM_STATES)}, not the state tensors {list(subgroup.states)}"
                )
            rows, partition = _decoded_rows(saved, keys, name, subgroup, saved_precision, where)
            key = keys[name]
            if not precision.compressed:
                converted.put(key, rows[: (1 + len(subgroup.states)) * subgroup.numel], cache=False).result()
                continue
            layout = PackedLayout(PACKED_ROWS, subgroup.numel, precision)
            packed = torch.empty(layout.words, dtype=torch.float32)
            dtypes: list[tuple[int, int, torch.dtype]] = []
            if precision.master == "bf16-compensated":
                dtype = partition_dtype if partition is None else partition.dtype
                master = rows[: subgroup.numel]
                converted.put(key + PARTITION_SUFFIX, master.to(dtype), cache=False).result()
                dtypes = [(0, subgroup.numel, dtype)]
            layout.encode(rows[: len(PACKED_ROWS) * subgroup.numel], packed, dtypes)
            converted.put(key, packed, cache=False).result()
    write_index(destination, subgroups, extra, precision)


def _decoded_rows(
    saved: TierStore,
    keys: Mapping[str, str],
    name: str,
    subgroup: SavedSubGroup,
    precision: StatePrecision,
    where: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A saved sub-group's state in fp32, ``[master | states...]`` with at least `ADAM_STATES`' rows
    (zeros where it holds none), and a compensated master's low-precision partition (None for
    another master).

    Args:
        saved: the checkpoint's store.
        keys: its keys by the last part (the sub-group's name, or the name of its partition).
        name: the sub-group.
        subgroup: its entry in the index.
        precision: the precision it is stored in.
        where: the sub-group in an error's message.
    """
    if name not in keys:
        raise BufferMismatchError(f"{where}: missing from the checkpoint's store")
    rows = torch.zeros((1 + max(len(subgroup.states), len(ADAM_STATES))) * subgroup.numel)
    stored = saved.get(keys[name], cache=False).result().reshape(-1)
    if not precision.compressed:
        if stored.numel() != (1 + len(subgroup.states)) * subgroup.numel:
            raise BufferMismatchError(
                f"{where}: {stored.numel()} values, not {1 + len(subgroup.states)} rows"
            )
        rows[: stored.numel()].copy_(stored)
        return rows, None
    layout = PackedLayout(PACKED_ROWS, subgroup.numel, precision)
    if stored.numel() != layout.words:
        raise BufferMismatchError(f"{where}: {stored.numel()} words, its packed layout {layout.words}")
    partition = None
    if precision.master == "bf16-compensated":
        if name + PARTITION_SUFFIX not in keys:
            raise BufferMismatchError(f"{where}: holds no low-precision partition for its compensated master")
        partition = saved.get(keys[name + PARTITION_SUFFIX], cache=False).result().reshape(-1)
    windows = [] if partition is None else [(0, partition)]
    layout.decode(stored, rows[: len(PACKED_ROWS) * subgroup.numel], windows, settle=True)
    return rows, partition


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
