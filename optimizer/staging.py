"""Staging sub-group state between a TierStore and a fixed pool of DRAM buffers.

Both offloaded optimizers (:class:`~tierstore.optimizer.OffloadedAdamW` and the DeepSpeed
integration's swapper) move the same thing: one fp32 object per sub-group, read before its update
and written after it. The stager owns the buffers and the policies that make that fast:

* a read-ahead ring of ``prefetch_depth`` buffers, filled in pass order while the current
  sub-group is updated;
* write-back in the background, a buffer returning to the pool once its write is done;
* the sub-groups kept in DRAM at the end of a pass (MLP-Offload's cache-friendly order: the next,
  reversed pass starts with them), chosen by the I/O model, the static last-K rule, or none;
  a kept sub-group skips its write now and its read next pass.

The DRAM it holds is bounded up front: ``prefetch_depth`` buffers plus as many spare ones as the
budget allows, each the size of the largest sub-group. Nothing else is allocated per step.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Literal

import torch

from ..buffers import aligned_tensor
from ..errors import CapacityError, ConfigError
from ..model import PathSpeed, plan_pass
from ..store import TierStore

CachePolicy = Literal["model", "static", "none"]
FP32 = 4


class SubGroupStager:
    """Reads, holds and writes back fp32 sub-group states of at most ``slot_elements`` each.

    A pass is ``begin_pass(order)``, then ``acquire``/``release`` per sub-group in that order, then
    ``end_pass()``. ``acquire`` and ``release`` also work outside a pass (one blocking read, one
    write-back), which is what initialisation and checkpoint restore need.
    """

    def __init__(
        self,
        store: TierStore,
        namespace: str,
        *,
        slot_elements: int,
        dram_budget: int | None,
        prefetch_depth: int = 2,
        cache_policy: CachePolicy = "model",
        reserved_bytes: int = 0,
    ) -> None:
        _check_settings(namespace, dram_budget, prefetch_depth, cache_policy)
        self.store = store
        self.namespace = namespace
        self.prefetch_depth = prefetch_depth
        self.cache_policy = cache_policy
        self.slot_bytes = FP32 * max(slot_elements, 1)
        working = prefetch_depth * self.slot_bytes + reserved_bytes
        self.dram_budget = working if dram_budget is None else dram_budget
        if self.dram_budget < working:
            raise CapacityError(
                f"dram_budget of {self.dram_budget} bytes is below the working set of {working} bytes "
                f"({prefetch_depth} sub-group buffers of {self.slot_bytes}"
                + (f" + {reserved_bytes} for gradients)" if reserved_bytes else ")")
            )
        reservation = store.memory.reserve(f"optimizer {namespace}", self.dram_budget)
        weakref.finalize(self, store.memory.release, reservation)
        spare = (self.dram_budget - working) // self.slot_bytes
        self.buffers = [aligned_tensor(max(slot_elements, 1)) for _ in range(prefetch_depth + spare)]
        self._free: list[torch.Tensor] = list(self.buffers)
        self._sizes: dict[Hashable, int] = {}
        self.resident: dict[Hashable, torch.Tensor] = {}
        """Sub-groups kept in DRAM between passes (their store copy is stale)."""
        self._held: dict[Hashable, torch.Tensor] = {}
        self._reads: dict[Hashable, tuple[torch.Tensor, Future[torch.Tensor]]] = {}
        self._writes: deque[tuple[Future[None], torch.Tensor]] = deque()
        self._upcoming: deque[Hashable] = deque()
        self._keep: set[Hashable] = set()

    # -- a pass ---------------------------------------------------------------------------------
    def begin_pass(self, order: Sequence[Hashable], sizes: Mapping[Hashable, int]) -> None:
        """Start a pass over ``order`` (sub-group -> elements in ``sizes``): plan what stays in DRAM
        at its end and start reading ahead."""
        self._sizes.update(sizes)
        self._keep = self._plan_keep(list(order))
        self._upcoming = deque(name for name in order if name not in self.resident)
        self._read_ahead()

    def acquire(self, name: Hashable, elements: int | None = None) -> torch.Tensor:
        """The sub-group's state in DRAM (``elements`` fp32 values), once its read is done."""
        if elements is not None:
            self._sizes[name] = elements
        self._reclaim(block=False)
        self._read_ahead()
        if name in self.resident:
            buffer = self.resident.pop(name)
        elif name in self._reads:
            buffer, future = self._reads.pop(name)
            future.result()
        else:
            if name in self._upcoming:
                self._upcoming.remove(name)
            buffer = self._take_free()
            try:
                self._read(name, buffer).result()
            except BaseException:
                self._free.append(buffer)
                raise
        self._held[name] = buffer
        return buffer[: self._sizes[name]]

    def resize(self, name: Hashable, elements: int) -> torch.Tensor:
        """An acquired sub-group's state grown or shrunk to ``elements`` (its layout changed, e.g. an
        optimizer created its moments during the first step)."""
        if FP32 * elements > self.slot_bytes:
            raise CapacityError(f"{name}: {elements} fp32 values do not fit a {self.slot_bytes}-byte buffer")
        self._sizes[name] = elements
        return self._held[name][:elements]

    def release(self, name: Hashable) -> None:
        """Done with the sub-group: keep it in DRAM if the plan says so, else write it back."""
        buffer = self._held.pop(name)
        if name in self._keep:
            self.resident[name] = buffer
        else:
            self._write(name, buffer)
        self._read_ahead()

    def end_pass(self) -> None:
        """Wait for the pass's writes; drop reads started for sub-groups that were never acquired."""
        self._upcoming.clear()
        self._keep = set()
        for buffer, future in self._reads.values():
            future.exception()
            self._free.append(buffer)
        self._reads.clear()
        self.wait_writes()

    # -- outside a pass ---------------------------------------------------------------------------
    def write(self, name: Hashable, elements: int, fill: Callable[[torch.Tensor], None]) -> None:
        """Write a sub-group's state laid out by ``fill`` into a free buffer (in the background)."""
        self._sizes[name] = elements
        self.resident.pop(name, None)
        buffer = self._take_free()
        fill(buffer[:elements])
        self._write(name, buffer)

    def read(self, name: Hashable) -> torch.Tensor:
        """The sub-group's current state: the DRAM copy if kept, else read from the store."""
        if name in self.resident:
            return self.resident[name][: self._sizes[name]]
        return self.store.get(self.key(name)).result()

    def flush(self) -> None:
        """Write the kept sub-groups to the store too (they stay in DRAM)."""
        futures = [
            self.store.put(self.key(name), buffer[: self._sizes[name]], cache=False)
            for name, buffer in self.resident.items()
        ]
        for future in futures:
            future.result()

    def drop_resident(self) -> None:
        """Forget the DRAM copies (after the store was rewritten behind them)."""
        self._free.extend(self.resident.values())
        self.resident.clear()

    def wait_writes(self) -> None:
        while self._writes:
            self._reclaim(block=True)

    def key(self, name: Hashable) -> str:
        return f"{self.namespace}/{name}"

    # -- internals ------------------------------------------------------------------------------
    def _read(self, name: Hashable, buffer: torch.Tensor) -> Future[torch.Tensor]:
        return self.store.get(self.key(name), out=buffer[: self._sizes[name]], cache=False)

    def _write(self, name: Hashable, buffer: torch.Tensor) -> None:
        state = buffer[: self._sizes[name]]
        self._writes.append((self.store.put(self.key(name), state, cache=False), buffer))

    def _read_ahead(self) -> None:
        while self._upcoming and self._free and len(self._reads) < self.prefetch_depth:
            name = self._upcoming.popleft()
            if name in self.resident or name in self._held or name in self._reads:
                continue
            buffer = self._free.pop()
            self._reads[name] = (buffer, self._read(name, buffer))

    def _reclaim(self, block: bool) -> None:
        """Return the buffers of finished writes to the pool (``block``: wait for at least one)."""
        while self._writes and (block or self._writes[0][0].done()):
            future, buffer = self._writes.popleft()
            try:
                future.result()
            finally:
                self._free.append(buffer)
            block = False

    def _take_free(self) -> torch.Tensor:
        while not self._free:
            if not self._writes:
                raise CapacityError(
                    f"all {len(self.buffers)} staging buffers are in use: a pass acquired more sub-groups "
                    "than the DRAM budget holds"
                )
            self._reclaim(block=True)
        return self._free.pop()

    def _plan_keep(self, order: list[Hashable]) -> set[Hashable]:
        room = len(self.buffers) - self.prefetch_depth
        if self.cache_policy == "none" or room <= 0:
            return set()
        if self.cache_policy == "static":
            return set(order[-room:])
        # A kept sub-group holds a whole buffer, whatever its own size.
        sizes = [self.slot_bytes] * len(order)
        plan = plan_pass(
            self._path_speeds(), room * self.slot_bytes, sizes, list(range(len(order))), working_bytes=0
        )
        return {order[i] for i in plan.keep}

    def _path_speeds(self) -> list[PathSpeed]:
        speeds = []
        for path in self.store.tiers[0].paths:
            estimate = path.bandwidth()
            speeds.append(
                PathSpeed(path.name, estimate.read, estimate.write)
                if estimate
                else PathSpeed(path.name, 1e9, 1e9)
            )
        return speeds


def _check_settings(namespace: str, dram_budget: int | None, prefetch_depth: int, cache_policy: str) -> None:
    """A :class:`ConfigError` naming the field, rather than a TypeError or a bad key at first use."""
    if (
        not isinstance(namespace, str)
        or not namespace
        or namespace.startswith("/")
        or ".." in namespace.split("/")
        or any(ord(c) < 32 for c in namespace)
    ):
        raise ConfigError(
            "namespace: must be a non-empty string without control characters, a leading '/' or a "
            f"'..' segment (it prefixes the store keys), got {namespace!r}"
        )
    if dram_budget is not None and (not _is_integer(dram_budget) or dram_budget < 0):
        raise ConfigError(f"dram_budget: must be None or a number of bytes >= 0, got {dram_budget!r}")
    if not _is_integer(prefetch_depth) or prefetch_depth < 1:
        raise ConfigError(f"prefetch_depth: must be an integer >= 1, got {prefetch_depth!r}")
    if cache_policy not in ("model", "static", "none"):
        raise ConfigError(f"cache_policy: must be 'model', 'static' or 'none', got {cache_policy!r}")


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
