"""What the offloader records of each step and of each capture it holds, and the captures' states.

A :class:`Step` is one forward (one ``with`` block) and the backward that consumes it; an
:class:`Entry` is one capture of that step (one or several saves of the same bytes): in memory,
being written, spilled, or being read back. Every field is read and written under the offloader's
lock.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from ..device import Transfer
from ..spill_policy import ReadAhead, Residence, SpillPolicy
from .layout import Capture

Signature = list[tuple[int, torch.dtype]]
"""What a plan depends on: the sizes and dtypes of a step's captures, in save order."""


@dataclass(eq=False)
class Step:
    """One forward and the backward that consumes it."""

    number: int
    started: float
    policy: SpillPolicy
    """The decisions this step runs under: its plan's, or spilling everything while it profiles."""
    expected: Signature
    """The saved sequence the plan was built for; a step that leaves it profiles instead."""
    entries: list[Entry] = field(default_factory=list)
    captures: dict[tuple[object, ...], Entry] = field(default_factory=dict)
    """Live entries by storage and capture identity, to share one capture between saves."""
    reads: ReadAhead[Entry] = field(default_factory=ReadAhead)
    """Backward's reads, in the policy's order (set at the end of forward)."""
    stalls: float = 0.0
    """Seconds this step waited for writes and reads: taken out of its profiled timeline."""
    forward_done: bool = False
    last_use: float = 0.0

    def now(self) -> float:
        """Compute seconds since the step started (stalls excluded)."""
        return time.perf_counter() - self.started - self.stalls

    def profiled(self) -> bool:
        """Backward has used (or autograd has freed) every saved tensor."""
        return self.forward_done and all(e.used_at is not None or e.dead for e in self.entries)

    def signature(self) -> Signature:
        return [(entry.capture.nbytes, entry.dtype) for entry in self.entries]

    def add(self, entry: Entry) -> None:
        """Record a new capture, spilled or kept as the policy says; one the plan did not expect
        (the saved sequence changed) turns the step to profiling from here on."""
        expected = self.expected[entry.index] if entry.index < len(self.expected) else None
        if self.policy.planned and expected != (entry.capture.nbytes, entry.dtype):
            self.policy = SpillPolicy()
        entry.spill = self.policy.spills(entry.index)
        self.entries.append(entry)

    def end_forward(self) -> None:
        """Forward is over: a step that saved fewer tensors than its plan expected profiles, and
        backward's reads are put in the policy's order."""
        if self.policy.planned and len(self.entries) != len(self.expected):
            self.policy = SpillPolicy()
        self.forward_done = True
        spilled = [entry.index for entry in self.entries if entry.spill]
        self.reads = ReadAhead([self.entries[index] for index in self.policy.read_order(spilled)])


@dataclass(eq=False)
class Entry:
    """One capture of one step: in memory, being written, spilled, or being read back."""

    step: Step
    index: int
    key: str
    capture: Capture
    dtype: torch.dtype
    device: torch.device
    storage: weakref.ref[torch.UntypedStorage]
    saved_at: float
    data: torch.Tensor | None = None
    """The captured bytes (uint8, pool memory) while the offloader holds them."""
    io: torch.Tensor | None = None
    """The same bytes for the store's reads and writes (a :class:`~tierstore.buffers.Lease`'s)."""
    spill: bool = True
    """Written to the store; otherwise kept in memory until autograd frees it (the plan's keep)."""
    copied: Transfer | None = None
    """CUDA: the device-to-host copy into ``data`` (its bytes are there once it has ended)."""
    used_at: float | None = None
    handles: int = 0
    unpacked: set[int] = field(default_factory=set)
    writing: bool = False
    written: bool = False
    """The store holds the object (until deleted)."""
    reading: bool = False
    read_back: bool = False
    """Its bytes have been read from the store at least once."""
    handed_back: bool = False
    """Read-ahead reached it while its write was in flight: the capture stays to be handed back."""
    dead: bool = False
    error: BaseException | None = None

    def served(self) -> bool:
        """Every handle autograd holds on it has been unpacked."""
        return len(self.unpacked) >= self.handles

    def residence(self) -> Residence:
        """Where its bytes are, for the spill policy."""
        if self.dead or self.used_at is not None or self.reading or self.error is not None:
            return Residence.DONE
        if self.data is not None:
            return Residence.AHEAD if self.written else Residence.WRITING
        return Residence.STORED if self.written else Residence.DONE

    def drop(self) -> None:
        """Let go of the bytes in memory: their pool memory returns once no rebuilt tensor holds
        it either."""
        self.data = self.io = self.copied = None
        self.handed_back = False
