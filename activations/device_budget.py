"""The device memory the offloader holds, bounded by ``device_budget``: saved tensors held while
their copy to host memory runs, saved tensors left on the device, and tensors copied back ahead of
their use. Each is counted from when the offloader takes it until it lets go of it (or its last
handle is served: autograd's memory from then on)."""

from __future__ import annotations

import threading
from collections import deque

import torch

from ..device import DeviceCopies, Transfer
from ..errors import ConfigError
from .entries import Entry


class DeviceBudget:
    """The bytes of device memory the offloader holds, and its copies to host memory in flight
    (which give memory back when they end). Its counts change under the offloader's lock.

    Args:
        budget: the most device memory, in bytes, the offloader holds at once.
        lock: the offloader's lock (reentrant).
        stats: the offloader's counters (``peak_device_bytes``, updated under ``lock``).
        copies: the device layer's copies, whose end a save waits for while the budget is full.
    """

    def __init__(
        self, budget: int, lock: threading.Condition, stats: dict[str, float], copies: DeviceCopies
    ) -> None:
        self.budget = budget
        self.held = 0
        """Device memory the offloader holds now."""
        self._lock = lock
        self._stats = stats
        self._copies = copies
        self._copying: deque[tuple[Entry, Transfer]] = deque()
        """Copies to host memory, oldest first (those that have ended are pruned from the left)."""

    def check_fits(self, nbytes: int, tensor: torch.Tensor) -> None:
        """Refuse a saved tensor of a device larger than the whole budget, with a [`ConfigError`][]
        naming ``device_budget``."""
        if nbytes > self.budget:
            raise ConfigError(
                f"device_budget: {self.budget} bytes cannot hold one saved tensor of "
                f"{nbytes} bytes ({tensor.type()} {list(tensor.shape)}) while it is copied; raise "
                "device_budget, or min_bytes above it"
            )

    def reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` for a save, waiting on this thread (forward's) for the oldest copies
        to host memory to end while the budget is full; False when no copy in flight can make
        room (tensors left on the device fill it)."""
        while True:
            with self._lock:
                if self.held + nbytes <= self.budget:
                    self.take(nbytes)
                    return True
                oldest = next((t for e, t in self._copying if e.copying), None)
            if oldest is None:
                return False
            self._copies.wait(oldest)

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in the budget now (under the lock)."""
        return self.held + nbytes <= self.budget

    def take(self, nbytes: int) -> None:
        """Count ``nbytes`` more as held (under the lock)."""
        self.held += nbytes
        self._stats["peak_device_bytes"] = max(self._stats["peak_device_bytes"], self.held)

    def give_back(self, nbytes: int) -> None:
        """Count ``nbytes`` as no longer held (under the lock)."""
        self.held -= nbytes

    def copying_out(self, entry: Entry, transfer: Transfer) -> None:
        """The entry's copy to host memory has started (under the lock)."""
        self._copying.append((entry, transfer))

    def copied_out(self, entry: Entry) -> Transfer | None:
        """The entry's copy to host memory has ended (``entry.copying`` is False): its transfer,
        the copies that have ended pruned (under the lock)."""
        transfer = next((t for e, t in self._copying if e is entry), None)
        while self._copying and not self._copying[0][0].copying:
            self._copying.popleft()
        return transfer

    def release(self, entry: Entry) -> None:
        """Give back the entry's device memory once nothing of it is held: its copy to host memory
        has ended and it is not left on the device (under the lock)."""
        if entry.device_bytes and not entry.copying and entry.source is None:
            self.give_back(entry.device_bytes)
            entry.device_bytes = 0
