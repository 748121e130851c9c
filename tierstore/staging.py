"""Staging memory: the DRAM a workload copies tensors through on their way to and from the tiers.

Every workload that stages data (the write-back cache, the offloaded optimizer's sub-groups, spilled
activations, checkpoint drains) needs the same kind of memory: page-aligned buffers that O_DIRECT
can use without a bounce copy, page-locked for a workload that copies to a device (``pin``) so that
those copies run asynchronously, recycled by size ([`BufferPool`][]), and counted against the
store's one DRAM budget (`MemoryLedger`) so that the sum of all workloads' budgets is checked when
each starts, not discovered as an out-of-memory kill mid-step.

A [`StagingArea`][] is that memory for one owner: its budget is reserved from the ledger when it is
made and given back when it is closed (or garbage collected), and its pool never holds more than the
budget.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from ._checks import SIZE_REQUIREMENT, byte_count
from .buffers import AlignedBuffer, BufferPool, Lease, round_up
from .device_runtime import DeviceRuntime
from .errors import CapacityError, ConfigError
from .memory import MemoryLedger, Reservation


class StagingArea:
    """Aligned (and, for copies to a device, pinned) buffers under a byte budget reserved from a
    ledger.

    Args:
        ledger: the store's DRAM ledger ([`TierStore.memory`][]); the budget is reserved from it at
            once.
        owner: who holds the memory, as the ledger reports it (``"cache"``,
            ``"optimizer <namespace>"``, ``"activations <namespace>"``).
        budget: bytes reserved from the ledger (an int, or text such as ``"64MiB"``): the most
            the area's buffers (and the owner's own, see ``pool_bytes``) ever hold.
        pin: page-lock the buffers for asynchronous copies to a device, on the calling thread's
            current device (only a workload that makes such copies pins: page-locking initialises
            CUDA); see `tierstore.device`.
        resident: keep freed pages for reuse instead of returning them to the kernel (for workloads
            whose buffer sizes change all the time and that fill their budget every step; see
            [`BufferPool`][]).
        pool_bytes: most bytes of buffers the pool holds; default: the budget. Less for an owner
            that also holds buffers of its own under the same budget (an offloaded optimizer's
            read-ahead ring and gradient buffer), which the reservation then counts too; at most
            the budget rounded up to whole pages (the pool carves whole pages).
        runtime: the device runtime that page-locks pinned buffers; default CUDA's.

    Raises:
        ConfigError: ``owner`` is not a non-empty string, or ``budget`` or ``pool_bytes`` is not
            a number of bytes >= 0 nor text such as ``"64MiB"`` (a bool is refused).
        CapacityError: the budget does not fit beside the other workloads' reservations (the message
            names who holds what), or ``pool_bytes`` is above the budget. Page-locking happens as
            buffers are carved: [`try_acquire`][] raises its [`PinnedMemoryError`][].
    """

    def __init__(
        self,
        ledger: MemoryLedger,
        owner: str,
        budget: int | str,
        *,
        pin: bool = False,
        resident: bool = False,
        pool_bytes: int | str | None = None,
        runtime: DeviceRuntime | None = None,
    ) -> None:
        budget_bytes, pool = _checked_sizes(owner, budget, pool_bytes)
        self.owner = owner
        self.ledger = ledger
        reservation = ledger.reserve(owner, budget_bytes)
        self._reservation: Reservation = reservation
        self._unreserve = weakref.finalize(self, ledger.release, reservation)
        self._pool_bytes = pool
        self.pool = BufferPool(pool, pin=pin, resident=resident, runtime=runtime)
        """The buffers (acquire, lease and release them here)."""

    @property
    def budget(self) -> int:
        """Bytes reserved for this area in the ledger."""
        return self._reservation.nbytes

    @property
    def pinned(self) -> bool:
        """Whether the buffers are page-locked for copies to a device."""
        return self.pool.pin

    @property
    def capacity(self) -> int:
        """Most bytes of buffers the pool holds (``pool_bytes``, by default the budget; rounded
        down to whole pages of a resident pool)."""
        return self.pool.capacity

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers hold now: in use, or idle and kept for reuse."""
        return self.pool.allocated_bytes

    @property
    def in_use_bytes(self) -> int:
        """Capacity of the buffers handed out and not yet released."""
        return self.pool.in_use_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether an object could ever get a buffer here.

        Args:
            nbytes: the object's size in bytes.

        Returns:
            True if a buffer of ``nbytes`` fits the pool's capacity (when no buffer is in use).
        """
        return self.pool.fits(nbytes)

    def try_acquire(self, nbytes: int, *, fresh_pages: bool = False) -> AlignedBuffer | None:
        """A buffer, if there is room for it now (see [`BufferPool.try_acquire`][]).

        Args:
            nbytes: the least size of the buffer, in bytes.
            fresh_pages: for a resident pool whose free pages are split too finely, give some back
                and take fresh ones rather than fail; for callers that waiting can free nothing
                more.

        Returns:
            A buffer of at least ``nbytes`` (give it back with [`release`][]), or None while buffers
            in use leave no room.

        Raises:
            CapacityError: ``nbytes`` exceeds the pool's whole capacity.
            PinnedMemoryError: a pinned area's new memory could not be page-locked.
        """
        return self.pool.try_acquire(nbytes, fresh_pages=fresh_pages)

    def try_lease(
        self, nbytes: int, on_return: Callable[[], None] | None = None, *, fresh_pages: bool = False
    ) -> Lease | None:
        """Memory lent as tensors that give it back when the last one is gone (see
        [`BufferPool.try_lease`][]).

        Args:
            nbytes: the size of the lent tensors, in bytes.
            on_return: called (on whichever thread let go last) once the memory is back.
            fresh_pages: as for [`try_acquire`][].

        Returns:
            The lease, whose tensors are exactly ``nbytes``; or None while buffers in use leave no
            room.

        Raises:
            CapacityError: ``nbytes`` exceeds the pool's whole capacity.
            PinnedMemoryError: a pinned area's new memory could not be page-locked.
        """
        return self.pool.try_lease(nbytes, on_return, fresh_pages=fresh_pages)

    def release(self, buffer: AlignedBuffer) -> None:
        """Return a buffer acquired here; the caller must hold no view of it any more.

        Args:
            buffer: a buffer from [`try_acquire`][].
        """
        self.pool.release(buffer)

    def resize(self, budget: int | str, *, pool_bytes: int | str | None = None) -> None:
        """Change the budget: the new budget takes the old one's place in the ledger in one step,
        so it needs room for the difference only, and a failure leaves the area as it was. The pool
        starts afresh: call it only with no buffer of it in use.

        Args:
            budget: the new budget, in bytes (an int or text, as the constructor's).
            pool_bytes: the pool's share of it, as the constructor's ``pool_bytes``.

        Raises:
            ConfigError: ``budget`` or ``pool_bytes`` is not a size in bytes, as the constructor's.
            CapacityError: the difference does not fit the ledger, or ``pool_bytes`` is above the
                budget.
        """
        budget_bytes, pool = _checked_sizes(self.owner, budget, pool_bytes)
        reservation = self.ledger.reserve(self.owner, budget_bytes, replacing=self._reservation)
        self._unreserve.detach()
        self._reservation = reservation
        self._unreserve = weakref.finalize(self, self.ledger.release, reservation)
        self._pool_bytes = pool
        self._renew_pool(pin=self.pool.pin)

    def pin_for_device(self) -> bool:
        """Page-lock the area's buffers from now on, for a workload that learns only as it runs
        that it copies to a device (activation offload, at its first save of a CUDA tensor): the
        pool starts afresh, pinned, if no buffer of it is in use.

        Returns:
            Whether the area is pinned now (False while buffers are in use: they stay unpinned,
            and a copy through them is synchronous; ask again later).
        """
        if not self.pool.pin and self.pool.in_use_bytes == 0:
            self._renew_pool(pin=True)
        return self.pool.pin

    def _renew_pool(self, *, pin: bool) -> None:
        """Replace the pool (none of whose buffers is in use) with an empty one."""
        old = self.pool
        old.close()
        self.pool = BufferPool(self._pool_bytes, pin=pin, resident=old.resident, runtime=old.runtime)

    def close(self) -> None:
        """Free the idle buffers and give the budget back to the ledger (buffers still in use stay
        valid until released, and are freed then)."""
        self.pool.close()
        self._unreserve()


def _checked_sizes(owner: object, budget: object, pool_bytes: object) -> tuple[int, int]:
    """The budget and the pool's capacity (``pool_bytes``, or the budget) in bytes, by the rule of
    every size (`byte_count`); a [`ConfigError`][] names a bad argument (a bool is no number of
    bytes), a [`CapacityError`][] a pool larger than the budget."""
    if not isinstance(owner, str) or not owner:
        raise ConfigError(f"staging: owner must be a non-empty string, not {owner!r}")
    budget_bytes = byte_count(budget)
    if budget_bytes is None:
        raise ConfigError(f"{owner}: budget must be {SIZE_REQUIREMENT}, not {budget!r}")
    if pool_bytes is None:
        return budget_bytes, budget_bytes
    pool = byte_count(pool_bytes)
    if pool is None:
        raise ConfigError(f"{owner}: pool_bytes must be {SIZE_REQUIREMENT}, not {pool_bytes!r}")
    if pool > round_up(budget_bytes):
        raise CapacityError(f"{owner}: a pool of {pool} bytes does not fit a budget of {budget_bytes} bytes")
    return budget_bytes, pool
