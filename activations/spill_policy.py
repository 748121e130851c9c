"""The activation spill policy: which saved tensors are spilled, the order backward reads them back
in, and how room is made when the memory budget is full.

One policy drives two executions of a step, so that a plan's prediction follows what the runtime
does by construction: the offloader carries its decisions out on real memory, writes and reads, and
`tierstore.activations.replay.replay_spill` carries them out on a simulated timeline to judge a
plan. Each describes the saved tensors of one step to the policy through `SpilledTensors` and does
what it decides.

The rules:

* admission: a saved tensor is spilled if the plan says so; a plan may also keep it in memory,
  or, for a saved tensor of a device, leave it on the device (no copy at all). While there is no
  plan, a saved tensor in host memory is spilled, and one of a device goes to host memory first
  (a *capture kept*: its copy to host memory is all the offload it costs) and to the store only
  as room is needed (see below). A spilled tensor's capture is let go of when its write ends,
  unless backward's read-ahead has already reached it (it is then handed back without a read);
* room at a save: when the budget is full, a step without a plan spills the oldest capture it
  keeps while the writes in flight would not free room enough (host memory first, storage beyond
  it: the captures saved last, which backward wants first, stay in memory), then waits for writes
  in flight (each gives its capture back), and does nothing else;
* reads: at the end of forward and after each use, reads start in backward's order (the plan's
  profiled use order, or reverse save order without a plan) for as many spilled tensors as there
  is room for now; one still in memory is handed back without a read;
* room for a read backward is waiting for: first drop the tensor held ahead of its use that
  backward needs last (it is read again when its turn comes), then wait for writes and reads in
  flight. When nothing in flight can make room, the bytes go to ordinary memory (an overflow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar

Tensor = TypeVar("Tensor")
"""How a caller names the saved tensors of a step: the runtime's entries, the replay's indices."""
Tensor_contra = TypeVar("Tensor_contra", contravariant=True)


class Residence(Enum):
    """Where a spilled tensor's bytes are, as far as starting a read is concerned."""

    DONE = "done"
    """Used, freed, failed, or being read: there is nothing to start for it."""
    WRITING = "writing"
    """Its capture is in memory while its write runs."""
    AHEAD = "ahead"
    """In memory and in the store before backward uses it (read ahead, or a capture kept to be
    handed back): dropping it makes room."""
    STORED = "stored"
    """Only in the store: a read brings it back."""


class Placement(Enum):
    """Where a saved tensor goes at its save."""

    STORAGE = "storage"
    """Captured into memory and written to the store (spilled)."""
    HOST = "host"
    """Captured into memory and kept there until backward."""
    DEVICE = "device"
    """Left on its device: never copied (a saved tensor of a device only)."""


class Room(Enum):
    """What making room did, or what the caller must do next."""

    DROPPED = "dropped"
    """A tensor held ahead of its use was let go of: try again."""
    SPILL = "spill"
    """Spill the oldest capture kept in memory (start its write), then try again."""
    WAIT = "wait"
    """Wait for a write or read in flight to end, then try again."""
    NONE = "none"
    """Nothing in flight will make room: the bytes go to ordinary memory."""


class SpilledTensors(Protocol[Tensor_contra]):
    """The spilled tensors of one step, as the policy sees them and acts on them."""

    def residence(self, tensor: Tensor_contra) -> Residence:
        """Where the tensor's bytes are."""
        ...

    def hand_back(self, tensor: Tensor_contra) -> None:
        """Keep the tensor's capture in memory to hand it back without a read."""
        ...

    def try_read_ahead(self, tensor: Tensor_contra) -> bool:
        """Start reading the tensor back if the budget has room for it now; whether it had."""
        ...

    def drop(self, tensor: Tensor_contra) -> None:
        """Let go of the tensor's bytes held in memory ahead of its use."""
        ...


class ReadAhead(Generic[Tensor]):
    """Backward's reads of one step: the order they are started in, and how far that has got.

    Args:
        order: the spilled tensors in the order reads start in (`SpillPolicy.read_order`).
    """

    def __init__(self, order: Sequence[Tensor] = ()) -> None:
        self.order = list(order)
        self.cursor = 0
        """Position in ``order`` of the next tensor to start a read for."""

    def advance(self, tensors: SpilledTensors[Tensor]) -> None:
        """Start reads in order for as many tensors as there is room for now; a tensor still in
        memory is handed back instead of read."""
        while self.cursor < len(self.order):
            tensor = self.order[self.cursor]
            residence = tensors.residence(tensor)
            if residence is Residence.WRITING or residence is Residence.AHEAD:
                tensors.hand_back(tensor)
            elif residence is Residence.STORED and not tensors.try_read_ahead(tensor):
                return
            self.cursor += 1

    def take_back_last(self, wanted: Tensor, tensors: SpilledTensors[Tensor]) -> Tensor | None:
        """The tensor held ahead of its use that backward needs last, other than ``wanted``; the
        cursor returns to it so that it is read again in its turn. None if none is held ahead."""
        for position in range(len(self.order) - 1, -1, -1):
            tensor = self.order[position]
            if tensor != wanted and tensors.residence(tensor) is Residence.AHEAD:
                self.cursor = min(self.cursor, position)
                return tensor
        return None


@dataclass(frozen=True)
class SpillPolicy:
    """The decisions of one step (see the module docstring); tensors are named here by their index
    in save order.

    Args:
        spill: the tensors a plan spills; None when there is no plan (a step profiling, or plan
            ``"all"``): every tensor in host memory is spilled, every one of a device kept in
            host memory first (see the module docstring).
        use_order: the spilled tensors in the order backward used them when profiled; None reads
            back in reverse save order (a sequential model's backward order).
        on_device: the tensors of a device a plan leaves there.
        first_use_order: every tensor in the order backward first used it when profiled (the
            order tensors are brought back to a device in); None: reverse save order.
    """

    spill: frozenset[int] | None = None
    use_order: tuple[int, ...] | None = None
    on_device: frozenset[int] = frozenset()
    first_use_order: tuple[int, ...] | None = None

    @property
    def planned(self) -> bool:
        """Whether a plan decides what is spilled."""
        return self.spill is not None

    def placement(self, index: int, *, device: bool) -> Placement:
        """Where the tensor saved at ``index`` goes; ``device``: it is a device's."""
        if self.spill is None:
            return Placement.HOST if device else Placement.STORAGE
        if device and index in self.on_device:
            return Placement.DEVICE
        return Placement.STORAGE if index in self.spill else Placement.HOST

    def spills(self, index: int) -> bool:
        """Whether the tensor saved at ``index`` in host memory is spilled (otherwise it stays in
        memory)."""
        return self.placement(index, device=False) is Placement.STORAGE

    def read_order(self, spilled: Sequence[int]) -> list[int]:
        """The order backward's reads start in, for a step that spilled ``spilled`` (ascending)."""
        return list(spilled[::-1] if self.use_order is None else self.use_order)

    def restore_order(self, captured: Sequence[int]) -> list[int]:
        """The order tensors are brought back to a device in, for a step that captured
        ``captured`` (ascending) from it."""
        if self.first_use_order is None:
            return list(captured[::-1])
        wanted = set(captured)
        return [index for index in self.first_use_order if index in wanted]

    def keeps_after_write(self, *, handed_back: bool, used: bool) -> bool:
        """Whether a capture stays in memory once its write ends: only while read-ahead counts on
        handing it back and backward has not used it yet."""
        return handed_back and not used

    def room_to_save(self, *, writing: bool, spillable: bool = False) -> Room:
        """What to do when a capture does not fit: without a plan, spill the oldest capture kept
        in memory while ``spillable`` (there is one, and the writes in flight would not free room
        enough); then wait while writes are in flight."""
        if spillable and not self.planned:
            return Room.SPILL
        return Room.WAIT if writing else Room.NONE

    def room_to_read(
        self,
        tensors: SpilledTensors[Tensor],
        reads: ReadAhead[Tensor],
        wanted: Tensor,
        *,
        writing: bool,
        reading: bool,
    ) -> Room:
        """What to do when backward waits for ``wanted`` and its bytes do not fit: drop the tensor
        held ahead that backward needs last, else wait for writes and reads in flight."""
        dropped = reads.take_back_last(wanted, tensors)
        if dropped is not None:
            tensors.drop(dropped)
            return Room.DROPPED
        return Room.WAIT if writing or reading else Room.NONE
