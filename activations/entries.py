"""What the offloader records of each step and of each capture it holds, and the captures' states.

A `Step` is one forward (one ``with`` block) and the backward that consumes it; an `Entry` is one
capture of that step (one or several saves of the same bytes): in memory, being written, spilled, or
being read back; for a saved tensor of a device also on the device, being copied to host memory, or
being copied back. Every field is read and written under the offloader's lock.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from ..device import Transfer
from .capture import Capture
from .spill_policy import Placement, ReadAhead, Residence, SpillPolicy

Signature = list[tuple[int, torch.dtype]]
"""What a plan depends on: the sizes and dtypes of a step's captures, in save order."""


@dataclass(eq=False)
class DeviceTimes:
    """A step's events on a device's clock (timed events of the caller's stream), from which its
    profile and its report are taken once they have completed."""

    origin: object
    """Recorded at the first save of a device tensor: the step's time zero on the device."""
    forward_end: object | None = None
    """Recorded when forward ends."""
    stalls: list[tuple[object, object]] = field(default_factory=list)
    """Around each wait of the caller's stream for a copy back: the stall it may have caused."""


@dataclass(eq=False)
class Traffic:
    """What one step moved, by link, and how long the copies of a device took on its clock."""

    to_host_bytes: int = 0
    to_host_seconds: float = 0.0
    to_device_bytes: int = 0
    to_device_seconds: float = 0.0
    written_bytes: int = 0
    read_bytes: int = 0


@dataclass(eq=False)
class Step:
    """One forward and the backward that consumes it."""

    number: int
    started: float
    policy: SpillPolicy
    """The decisions this step runs under: its plan's, or the default one while it profiles."""
    expected: Signature
    """The saved sequence the plan was built for; a step that leaves it profiles instead."""
    entries: list[Entry] = field(default_factory=list)
    captures: dict[tuple[object, ...], Entry] = field(default_factory=dict)
    """Live entries by storage and capture identity, to share one capture between saves."""
    reads: ReadAhead[Entry] = field(default_factory=ReadAhead)
    """Backward's reads, in the policy's order (set at the end of forward)."""
    restores: list[Entry] = field(default_factory=list)
    """The entries of a device in the order they are brought back to it (set at the end of
    forward); ``restore_cursor`` is the next one to bring back."""
    restore_cursor: int = 0
    stalls: float = 0.0
    """Seconds this step waited for writes and reads: taken out of its profiled timeline."""
    forward_done: bool = False
    forward_seconds: float = 0.0
    last_use: float = 0.0
    device: torch.device | None = None
    """The device of its first saved tensor of a device, if it saved one."""
    times: DeviceTimes | None = None
    traffic: Traffic = field(default_factory=Traffic)

    def now(self) -> float:
        """Compute seconds since the step started (stalls excluded)."""
        return time.perf_counter() - self.started - self.stalls

    def profiled(self) -> bool:
        """Backward has used (or autograd has freed) every saved tensor."""
        return self.forward_done and all(e.used_at is not None or e.dead for e in self.entries)

    def signature(self) -> Signature:
        return [(entry.capture.nbytes, entry.dtype) for entry in self.entries]

    def place(self, nbytes: int, dtype: torch.dtype, *, device: bool) -> Placement:
        """Where the next capture (``nbytes`` of ``dtype``; ``device``: of a device tensor) goes,
        as the policy says; one the plan did not expect (the saved sequence changed) turns the
        step to profiling from here on."""
        index = len(self.entries)
        expected = self.expected[index] if index < len(self.expected) else None
        if self.policy.planned and expected != (nbytes, dtype):
            self.policy = SpillPolicy()
        return self.policy.placement(index, device=device)

    def add(self, entry: Entry) -> None:
        """Record a new capture, placed by `place`."""
        self.entries.append(entry)

    def end_forward(self) -> None:
        """Forward is over: a step that saved fewer tensors than its plan expected profiles, and
        backward's reads and copies back to the device are put in the policy's order."""
        if self.policy.planned and len(self.entries) != len(self.expected):
            self.policy = SpillPolicy()
        self.forward_done = True
        self.forward_seconds = self.now()
        spilled = [entry.index for entry in self.entries if entry.spill]
        self.reads = ReadAhead([self.entries[index] for index in self.policy.read_order(spilled)])
        captured = [entry.index for entry in self.entries if entry.device is not None]
        self.restores = [self.entries[index] for index in self.policy.restore_order(captured)]


@dataclass(eq=False)
class Entry:
    """One capture of one step: in memory, being written, spilled, or being read back; for a
    saved tensor of a device also on the device, or being copied to or from it."""

    step: Step
    index: int
    key: str
    capture: Capture
    dtype: torch.dtype
    device: torch.device | None
    """The device whose memory holds the saved tensor; None for host memory."""
    storage: weakref.ref[torch.UntypedStorage]
    saved_at: float
    data: torch.Tensor | None = None
    """The captured bytes (uint8, pool memory) while the offloader holds them."""
    io: torch.Tensor | None = None
    """The same bytes for the store's reads and writes (a `Lease`'s)."""
    spill: bool = True
    """Written to the store; otherwise kept in memory until autograd frees it (the plan's keep,
    or a device's capture kept in host memory first), or left on its device."""
    copied: Transfer | None = None
    """Device: the copy into ``data`` (its bytes are there once it has ended)."""
    source: torch.Tensor | None = None
    """Device: the captured bytes on the device (a uint8 view of the saved tensor's storage, or
    a snapshot of them), held until the copy to host memory has ended, so that their memory is
    not reused before; and for as long as the entry lives when it stays on the device."""
    on_device: bool = False
    """Device: its bytes stay on the device (``source``) and need no copy back: the plan left it
    there, or its copy to host memory had not ended when forward ended."""
    copying: bool = False
    """Device: its copy to host memory has not ended yet."""
    device_bytes: int = 0
    """Device memory of the offloader's ``device_budget`` this entry holds now."""
    restored: torch.Tensor | None = None
    """Device: its bytes copied back ahead of backward's use (new memory of the copy stream)."""
    restoring: Transfer | None = None
    """Device: the copy into ``restored``."""
    tracked: torch.Tensor | None = None
    """Device: the saved tensor, detached (it shares autograd's version counter), while ``source``
    is held: a write autograd tracks shows in its version."""
    version: int = 0
    """Device: the saved tensor's version at the save."""
    modified: int | None = None
    """Device: the saved tensor's version when its copy to host memory ended, if a write that
    autograd tracks had reached it by then (backward then raises as autograd does)."""

    def version_now(self) -> int | None:
        """Device: the saved tensor's version if a write autograd tracks has reached the bytes
        the offloader holds of it (before its copy ended, or since, while it stays on the
        device); None otherwise."""
        if self.modified is not None:
            return self.modified
        if self.tracked is not None and self.tracked._version != self.version:
            return self.tracked._version
        return None

    used_at: float | None = None
    saved_event: object | None = None
    """Device: a timed event of the caller's stream at the save."""
    used_event: object | None = None
    """Device: a timed event of the caller's stream at backward's first use."""
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
        """Where its bytes are, for the spill policy (bytes on the device need nothing from it)."""
        if self.dead or self.used_at is not None or self.reading or self.error is not None:
            return Residence.DONE
        if self.on_device or self.restored is not None:
            return Residence.DONE
        if self.data is not None:
            return Residence.AHEAD if self.written else Residence.WRITING
        return Residence.STORED if self.written else Residence.DONE

    def drop(self) -> None:
        """Let go of the bytes in host memory: their pool memory returns once no rebuilt tensor
        (nor a copy in flight) holds it either."""
        self.data = self.io = self.copied = None
        self.handed_back = False
