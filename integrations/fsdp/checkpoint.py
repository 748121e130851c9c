"""torch.distributed.checkpoint (DCP) for an FSDP2 model and its [`FSDPOffloadedAdamW`][], with the
optimizer state streamed between the store and the checkpoint a piece at a time.

[`save`][] and [`load`][] are the two lines a training script calls::

    tierstore.integrations.fsdp.save(checkpoint_dir, model, optimizer)
    tierstore.integrations.fsdp.load(checkpoint_dir, model, optimizer)

They use ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` / ``set_state_dict``, so
the checkpoint is a plain DCP checkpoint: the optimizer's entries are ``DTensor``s sharded like the
parameters, and a checkpoint saved on N ranks loads on M (DCP reshards it). What differs from
``dcp.save(get_state_dict(...))`` is memory: the optimizer's entries are placeholders (no memory of
their own) that [`StreamingSavePlanner`][] fills when DCP writes each of them, reading the
sub-groups that hold it from the store, and [`StreamingLoadPlanner`][] writes each chunk DCP reads
straight into the sub-groups in the store. The sub-groups pass through the optimizer's own staging
buffers, and DCP's entries are written from its idle staging pool where they fit: the state streams
within the optimizer's DRAM budget, whatever its size (beyond it only one parameter's local shard of
one state part, where that does not fit the pool), and a load writes each sub-group once.

Plain ``get_state_dict`` / ``set_state_dict`` with ``dcp.save`` / ``dcp.load`` work too; they hold this
rank's whole state in memory while saving or loading, as torch's own optimizers do.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from tierstore.optimizer import Piece, SubGroup
from tierstore.optimizer.masters import stale_masters_error
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, WriteItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tierstore.buffers import AlignedBuffer

from .optimizer import FSDPOffloadedAdamW, by_position, like_parameter, local_shard


class _Placeholder:
    """Which state a placeholder tensor stands for: part ``part`` of parameter ``param``."""

    __slots__ = ("param", "part")

    def __init__(self, param: int, part: str) -> None:
        self.param = param
        self.part = part


class StateStream:
    """The optimizer's state as DCP sees it during [`save`][] / [`load`][]: placeholder entries
    (stride-0 tensors of the right shape and dtype, one fp32 value each, on the shards' device) and
    the just-in-time copy of one parameter's part between the store and a DCP buffer (host memory,
    whatever the shards' device: the state streams between the store and the checkpoint without
    crossing to a GPU).

    The sub-groups pass through the optimizer's own read-ahead ring (`SubGroupStager.lend_ring`),
    memory its DRAM budget already counts: a sub-group read for one entry stays there for the
    entries after it, and the one held longest unused makes room for the next. A load knows its read
    plan ([`expect`][]): a sub-group the plan writes whole is not read from the store first, and is
    written back as soon as its last value arrives.

    Args:
        optimizer: the optimizer whose store holds the state; its kept sub-groups are written to
            the store first (saving) or forgotten (loading, which rewrites the store).

    Raises:
        StoreClosedError: the optimizer is closed.
    """

    def __init__(self, optimizer: FSDPOffloadedAdamW) -> None:
        self.optimizer = optimizer
        self.placeholders: dict[int, _Placeholder] = {}
        """By the placeholder's local tensor's data pointer (DCP hands back views of it)."""
        self._pieces: dict[int, list[tuple[SubGroup, Piece]]] = {}
        for sg in optimizer.subgroups:
            for piece in sg.pieces:
                self._pieces.setdefault(piece.param, []).append((sg, piece))
        optimizer._check_open()
        self._window = _Window(optimizer, optimizer.stager.lend_ring())
        self._unwritten: dict[int, int] = {}
        """Load: values of each sub-group the plan still has to write (a sub-group listed here is
        written whole by the plan)."""
        self._lent: list[AlignedBuffer] = []
        """Staging-pool memory lent for DCP's entries ([`lend`][])."""
        self._lock = threading.Lock()
        self.bytes_moved = 0

    # -- the state dict ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` with every state part a placeholder.

        Returns:
            The optimizer's state dict, each state part a placeholder sharded like its parameter.
        """
        optimizer = self.optimizer
        state: dict[int, dict[str, Any]] = {}
        number = 0
        for group, params in enumerate(optimizer.param_groups):
            for param in params["params"]:
                entry: dict[str, Any] = {"step": torch.tensor(float(optimizer.param_steps[number]))}
                for part in optimizer._entry_parts(number, group):
                    entry[part] = self._placeholder(number, part, param)
                state[number] = entry
                number += 1
        return {
            "state": state,
            "param_groups": optimizer._state_dict_groups(),
            "step_count": optimizer.step_count,
            "skipped_steps": optimizer.skipped_steps,
        }

    def _placeholder(self, number: int, part: str, param: torch.Tensor) -> torch.Tensor:
        # On the shard's device: a DTensor moves a local tensor to its mesh's device, which would
        # give it memory of its own and another address.
        shard = local_shard(param)
        local = torch.zeros((), dtype=torch.float32, device=shard.device).expand(shard.shape)
        self.placeholders[local.data_ptr()] = _Placeholder(number, part)
        return like_parameter(param, local)

    def which(self, tensor: torch.Tensor) -> _Placeholder | None:
        """Which state a tensor stands for.

        Args:
            tensor: a tensor of a state dict (a ``DTensor``'s local tensor is looked at), or a view
                of one.

        Returns:
            The placeholder it (or the tensor it views) is, or None for real data.
        """
        tensor = local_shard(tensor)
        if tensor.numel() and tensor.stride() and min(tensor.stride()) != 0:
            return None
        return self.placeholders.get(tensor.data_ptr())

    def subgroups_of(self, placeholder: _Placeholder, runs: Iterable[tuple[int, int]]) -> dict[int, int]:
        """The sub-groups that values of a placeholder's part lie in.

        Args:
            placeholder: the state part.
            runs: ``(start, count)`` runs of values, flat in the parameter's local shard.

        Returns:
            Values per sub-group index, in sub-group order.
        """
        found: dict[int, int] = {}
        for sg, piece in self._pieces.get(placeholder.param, []):
            for start, count in runs:
                piece_end = piece.param_offset + piece.length
                overlap = min(start + count, piece_end) - max(start, piece.param_offset)
                if overlap > 0:
                    found[sg.index] = found.get(sg.index, 0) + overlap
        return dict(sorted(found.items()))

    def expect(self, written: dict[int, int]) -> None:
        """Tell a load which values its plan writes, so that sub-groups written whole skip their
        read and go back to the store as soon as they are complete.

        Args:
            written: values the plan writes per sub-group index (read items never overlap).
        """
        with self._lock:
            self._unwritten = {
                index: count
                for index, count in written.items()
                if count == self.optimizer.state_numel(self.optimizer.subgroups[index])
            }

    # -- just-in-time copies -------------------------------------------------------------------------
    def read(self, placeholder: _Placeholder, out: torch.Tensor) -> torch.Tensor:
        """Fill a buffer with a placeholder's values from the store.

        Args:
            placeholder: the state part to read.
            out: flat fp32, the parameter's local number of elements.

        Returns:
            ``out``.
        """
        with self._lock:
            for sg, piece in self._pieces.get(placeholder.param, []):
                row = self.optimizer._rows(sg, self._window.state(sg))[placeholder.part]
                out[piece.param_offset : piece.param_offset + piece.length].copy_(
                    row[piece.offset : piece.offset + piece.length]
                )
                self.bytes_moved += 4 * piece.length
        return out

    def write(self, placeholder: _Placeholder, flat_offset: int, values: torch.Tensor) -> None:
        """Write values of a placeholder's state part into the store.

        Args:
            placeholder: the state part to write.
            flat_offset: where ``values`` start in the part's local shard, flattened.
            values: flat fp32 values.
        """
        end = flat_offset + values.numel()
        with self._lock:
            for sg, piece in self._pieces.get(placeholder.param, []):
                start = max(flat_offset, piece.param_offset)
                stop = min(end, piece.param_offset + piece.length)
                if start >= stop:
                    continue
                whole = sg.index in self._unwritten
                state = self._window.state(sg, read=not whole or self._window.visited(sg))
                row = self.optimizer._rows(sg, state)[placeholder.part]
                at = piece.offset + start - piece.param_offset
                row[at : at + stop - start].copy_(values[start - flat_offset : stop - flat_offset])
                self._window.changed(sg)
                self.bytes_moved += 4 * (stop - start)
                if whole:
                    self._unwritten[sg.index] -= stop - start
                    if not self._unwritten[sg.index]:
                        del self._unwritten[sg.index]
                        self._window.write_back(sg)

    def lend(self, nbytes: int) -> memoryview:
        """Memory for the values of one entry DCP writes: from the optimizer's staging pool, idle
        while the state streams through the ring, where it has room (so a save holds no memory
        beyond the optimizer's budget), else of its own. Given back at [`finish`][].

        Args:
            nbytes: the size in bytes.

        Returns:
            ``nbytes`` of writable memory.
        """
        area = self.optimizer.stager.area
        with self._lock:
            block = area.try_acquire(nbytes) if area.fits(nbytes) else None
            if block is None:
                return memoryview(bytearray(nbytes))
            self._lent.append(block)
            return block.memoryview(nbytes)

    def finish(self) -> None:
        """Write back what a load changed and wait for it (the store then holds the whole state),
        and give back the memory lent for entries. Idempotent."""
        with self._lock:
            self._window.close()
            for block in self._lent:
                self.optimizer.stager.area.release(block)
            self._lent.clear()


class _Window:
    """Sub-groups' states held in lent buffers, the least recently used making room for the next;
    a changed one is written back (in the background) when it leaves.

    Args:
        optimizer: whose store holds the sub-groups.
        buffers: the memory to hold them in, each the size of the largest sub-group's state.
    """

    def __init__(self, optimizer: FSDPOffloadedAdamW, buffers: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self._free = buffers
        self._held: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        """Sub-group index -> (its buffer, its state in it), least recently used first."""
        self._changed: set[int] = set()
        self._writes: deque[tuple[Future[None], torch.Tensor]] = deque()
        self._visited: set[int] = set()

    def visited(self, sg: SubGroup) -> bool:
        """Whether the sub-group was held before (a load's partial writes may be in the store)."""
        return sg.index in self._visited

    def state(self, sg: SubGroup, *, read: bool = True) -> torch.Tensor:
        """The sub-group's state, held (read from the store first if ``read``)."""
        held = self._held.get(sg.index)
        if held is not None:
            self._held.move_to_end(sg.index)
            return held[1]
        buffer = self._take()
        state = buffer[: self.optimizer.state_numel(sg)]
        if read:
            key = self.optimizer.stager.key(sg.index)
            try:
                self.optimizer.store.get(key, out=state, cache=False).result()
            except BaseException:
                self._free.append(buffer)
                raise
        self._held[sg.index] = (buffer, state)
        self._visited.add(sg.index)
        return state

    def changed(self, sg: SubGroup) -> None:
        """The held sub-group's state was written into: it goes back to the store when it leaves."""
        self._changed.add(sg.index)

    def write_back(self, sg: SubGroup) -> None:
        """Let the held sub-group go now (its write runs in the background if it changed)."""
        buffer, state = self._held.pop(sg.index)
        if sg.index in self._changed:
            self._changed.discard(sg.index)
            key = self.optimizer.stager.key(sg.index)
            self._writes.append((self.optimizer.store.put(key, state, cache=False), buffer))
        else:
            self._free.append(buffer)

    def close(self) -> None:
        """Write back every changed sub-group and wait for all writes."""
        for index in list(self._held):
            self.write_back(self.optimizer.subgroups[index])
        while self._writes:
            self._reclaim()

    def _take(self) -> torch.Tensor:
        while not self._free:  # a write ending frees a buffer without losing a held sub-group
            if self._writes:
                self._reclaim()
            else:
                self.write_back(self.optimizer.subgroups[next(iter(self._held))])
        return self._free.pop()

    def _reclaim(self) -> None:
        future, buffer = self._writes.popleft()
        try:
            future.result()
        finally:
            self._free.append(buffer)


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, resolving the optimizer's placeholders from the store when the
    storage writer asks for each (one parameter's local part at a time, into a buffer reused for
    every item, so the writer's references to written tensors pin no memory).

    Args:
        stream: the optimizer's state stream, whose placeholders the state dict holds.
        **kwargs: ``DefaultSavePlanner``'s arguments.
    """

    def __init__(self, stream: StateStream, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream = stream
        self._buffers = threading.local()

    def resolve_data(self, write_item: WriteItem) -> Any:
        found = self.lookup_object(write_item.index)
        placeholder = self.stream.which(found) if isinstance(found, torch.Tensor) else None
        if placeholder is None:
            return self.transform_object(write_item, found)
        numel = found.numel()
        return self.stream.read(placeholder, self._buffer(numel)).view(found.shape)

    def _buffer(self, numel: int) -> torch.Tensor:
        """A tensor of exactly ``numel`` fp32 values over this thread's one reused allocation."""
        memory: memoryview | None = getattr(self._buffers, "memory", None)
        if memory is None or memory.nbytes < 4 * numel:
            memory = self._buffers.memory = self.stream.lend(4 * max(numel, 1))
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        return torch.frombuffer(memory[: 4 * numel], dtype=torch.float32)


class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, writing each chunk read for an optimizer placeholder into the
    store (through a buffer of that chunk's size) instead of into a tensor of the state dict.

    Args:
        stream: the optimizer's state stream, whose placeholders the state dict holds.
        **kwargs: ``DefaultLoadPlanner``'s arguments.
    """

    def __init__(self, stream: StateStream, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream = stream

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """The plan DCP reads, with the optimizer's items in sub-group order (DCP reads a file's
        items in plan order), each sub-group's items together; the stream learns which sub-groups
        the plan writes whole."""
        plan = super().finish_plan(central_plan)
        written: dict[int, int] = {}
        keys: list[tuple[int, int]] = []
        for item in plan.items:
            found = self.lookup_tensor(item.dest_index) if item.type != LoadItemType.BYTE_IO else None
            placeholder = None if found is None else self.stream.which(found)
            if placeholder is None or found is None:
                keys.append((-1, -1))  # model entries first, in DCP's order
                continue
            runs = [
                (start, flat.stop - flat.start)
                for start, flat in _flat_runs(tuple(found.shape), list(item.dest_offsets), list(item.lengths))
            ]
            touched = self.stream.subgroups_of(placeholder, runs)
            for index, count in touched.items():
                written[index] = written.get(index, 0) + count
            keys.append((min(touched, default=-1), max(touched, default=-1)))
        self.stream.expect(written)
        order = sorted(range(len(plan.items)), key=keys.__getitem__)
        return dataclasses.replace(plan, items=[plan.items[i] for i in order])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        found = self.lookup_tensor(read_item.dest_index)
        if self.stream.which(found) is None:
            return self.transform_tensor(read_item, found)
        return torch.empty(tuple(read_item.lengths), dtype=torch.float32)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        found = self.lookup_tensor(read_item.dest_index)
        placeholder = self.stream.which(found)
        if placeholder is None:
            return
        shape = tuple(found.shape)
        offsets, lengths = list(read_item.dest_offsets), list(read_item.lengths)
        for start, flat in _flat_runs(shape, offsets, lengths):
            self.stream.write(placeholder, start, tensor.reshape(-1)[flat])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = super().lookup_tensor(index)
        return local_shard(found)


def _flat_runs(shape: tuple[int, ...], offsets: list[int], lengths: list[int]) -> Iterator[tuple[int, slice]]:
    """The box ``offsets``/``lengths`` of a C-contiguous tensor of ``shape`` as runs of consecutive
    elements: (flat start in the tensor, slice of the box's own flat elements)."""
    if not shape:
        yield 0, slice(0, 1)
        return
    # Trailing dimensions the box covers whole merge into its innermost run.
    inner = len(shape) - 1
    while inner > 0 and offsets[inner] == 0 and lengths[inner] == shape[inner]:
        inner -= 1
    run = 1
    for dim in range(inner, len(shape)):
        run *= lengths[dim]
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    outer = lengths[:inner]
    count = 0
    for index in _ndindex(outer):
        start = (
            sum((offsets[d] + index[d]) * strides[d] for d in range(inner)) + offsets[inner] * strides[inner]
        )
        yield start, slice(count, count + run)
        count += run


def _ndindex(lengths: list[int]) -> Iterator[tuple[int, ...]]:
    if not lengths:
        yield ()
        return
    for first in range(lengths[0]):
        for rest in _ndindex(lengths[1:]):
            yield (first, *rest)


@contextmanager
def _replaced(optimizer: FSDPOffloadedAdamW, **methods: Any) -> Iterator[None]:
    """The optimizer's methods named by ``methods`` replaced, on this instance, for the duration."""
    for name, method in methods.items():
        setattr(optimizer, name, method)
    try:
        yield
    finally:
        for name in methods:
            delattr(optimizer, name)


def save(
    checkpoint_id: str | os.PathLike[str], model: nn.Module, optimizer: FSDPOffloadedAdamW, **extra: Any
) -> dict[str, int]:
    """Save a model and its optimizer as one DCP checkpoint, the optimizer state streamed from the
    store; every rank calls it.

    Args:
        checkpoint_id: a directory every rank can reach.
        model: the FSDP2 model.
        optimizer: the model's optimizer.
        **extra: entries saved beside (plain values or tensors: a step counter, a data loader
            position).

    Returns:
        ``{"optimizer_bytes": ...}``: the state bytes this rank copied out of the store.

    Raises:
        StoreClosedError: the optimizer is closed.

    A compressed `state_precision` is saved by the plain calls (``get_state_dict``, then
    ``dcp.save``): its blocks have no per-parameter rows to stream, so this rank's state is held
    decoded in memory meanwhile.
    """
    if optimizer.precision.compressed:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp_save({"model": model_state, "optimizer": optimizer_state, **extra}, checkpoint_id=checkpoint_id)
        return {"optimizer_bytes": _stored_bytes(optimizer)}
    stream = StateStream(optimizer)
    try:
        with _replaced(optimizer, state_dict=stream.state_dict):
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp_save(
                {"model": model_state, "optimizer": optimizer_state, **extra},
                checkpoint_id=checkpoint_id,
                planner=StreamingSavePlanner(stream),
            )
    finally:
        stream.finish()
    return {"optimizer_bytes": stream.bytes_moved}


def load(
    checkpoint_id: str | os.PathLike[str], model: nn.Module, optimizer: FSDPOffloadedAdamW, **extra: Any
) -> dict[str, Any]:
    """Load a [`save`][] (or any DCP checkpoint of ``get_state_dict``'s ``model``/``optimizer``
    layout) into a model and its optimizer, on any number of ranks; the optimizer state is streamed
    into the store.

    Args:
        checkpoint_id: the checkpoint's directory.
        model: the FSDP2 model to load into.
        optimizer: the model's optimizer to load into.
        **extra: entries to read back too, each given as a template (a tensor of the saved
            shape).

    Returns:
        The ``extra`` entries loaded, by name, and ``"optimizer_bytes"``: the state bytes this
        rank wrote into the store.

    Raises:
        BufferMismatchError: the checkpoint's parameter groups do not match the optimizer's.
        StaleMasterWeightsError: the model's loaded (low-precision) weights do not round from the
            checkpoint's ``master_param``: they are not the weights the state belongs to.
        StoreClosedError: the optimizer is closed.

    The state is streamed into the store as DCP reads it, with no second copy: a load that fails
    part-way (DCP's ``CheckpointException``: a missing or damaged file, or a
    `StaleMasterWeightsError`) leaves the store holding some sub-groups from the checkpoint and the
    rest as they were, so load again before training on. A failed [`save`][] changes nothing but the
    checkpoint directory.

    A compressed `state_precision` is loaded by the plain calls (``dcp.load``, then
    ``set_state_dict``), this rank's state held decoded in memory meanwhile; it is encoded as it is
    written to the store, into the bytes it was saved from where the sub-groups are cut as they were.
    """
    if optimizer.precision.compressed:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, **extra}
        dcp_load(state, checkpoint_id=checkpoint_id)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return {**{k: state[k] for k in extra}, "optimizer_bytes": _stored_bytes(optimizer)}
    stream = StateStream(optimizer)
    try:
        with _replaced(optimizer, state_dict=stream.state_dict, load_state_dict=_restore_counts(optimizer)):
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, **extra}
            dcp_load(state, checkpoint_id=checkpoint_id, planner=StreamingLoadPlanner(stream))
            stream.finish()  # the last sub-group written back: the store holds the loaded state
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
    finally:
        stream.finish()
    stale = optimizer._stale_masters()  # the model was loaded from the same checkpoint
    if stale:
        raise stale_masters_error(
            f"checkpoint {checkpoint_id}", stale, [tuple(optimizer.params[n].shape) for n in stale]
        )
    return {**{k: state[k] for k in extra}, "optimizer_bytes": stream.bytes_moved}


def _stored_bytes(optimizer: FSDPOffloadedAdamW) -> int:
    """Bytes of the state objects in the store: what a compressed state's save reads out of it, or
    its load writes."""
    return sum(4 * optimizer._stored_numel(sg) for sg in optimizer.subgroups)


def _restore_counts(optimizer: FSDPOffloadedAdamW) -> Any:
    """A ``load_state_dict`` for [`load`][]: the state parts are in the store already (streamed), so
    only the hyper-parameters and step counts are taken from the dict."""

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        state_dict = by_position(state_dict)
        optimizer._restore_groups(state_dict["param_groups"])
        state = state_dict["state"]
        entries = [state.get(i, state.get(str(i))) for i in range(len(optimizer.params))]
        optimizer.param_steps = [0 if e is None else int(e.get("step", 0)) for e in entries]
        optimizer.step_count = int(state_dict.get("step_count", max(optimizer.param_steps, default=0)))
        optimizer.skipped_steps = int(state_dict.get("skipped_steps", 0))

    return load_state_dict
