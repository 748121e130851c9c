"""One DRAM ledger for every workload on a store.

The store's cache, the optimizer's staging buffers and the activations held for backward all live
in the same host memory. Each sizes itself with a budget of its own; the ledger makes the sum one
number: a workload reserves its budget when it starts and gives it back when it ends, and a
reservation that would take the total over the ledger's capacity fails at once, naming who holds
what, instead of the process running out of memory mid-step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .errors import CapacityError


@dataclass(frozen=True, eq=False)
class Reservation:
    """A hold on memory; compared by identity, so one owner may hold several alike."""

    owner: str
    nbytes: int


class MemoryLedger:
    """Reservations of host memory by named owners under one capacity.

    Args:
        capacity: the bytes all reservations may hold together; None for no limit (reservations
            are only counted).

    Raises:
        CapacityError: a negative capacity.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise CapacityError(f"memory capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._held: set[Reservation] = set()
        self._lock = threading.Lock()

    def reserve(self, owner: str, nbytes: int, *, replacing: Reservation | None = None) -> Reservation:
        """Hold memory for an owner until `release`.

        Args:
            owner: who holds it, as `held` reports it.
            nbytes: the bytes to hold.
            replacing: a reservation given back in the same step (a workload changing its budget
                needs room for the difference only); it is kept if the new one does not fit.

        Returns:
            The reservation, to give to `release`.

        Raises:
            CapacityError: ``nbytes`` is negative, or does not fit beside what the others hold
                (the message names who holds what).
        """
        if nbytes < 0:
            raise CapacityError(f"{owner}: cannot reserve {nbytes} bytes")
        with self._lock:
            held = sum(r.nbytes for r in self._held if r is not replacing)
            if self.capacity is not None and held + nbytes > self.capacity:
                holders = ", ".join(f"{owner} {n}" for owner, n in sorted(self._totals().items())) or "nobody"
                raise CapacityError(
                    f"{owner}: {nbytes} bytes of DRAM do not fit the store's memory budget of "
                    f"{self.capacity} bytes beside what is reserved already ({holders})"
                )
            reservation = Reservation(owner, nbytes)
            if replacing is not None:
                self._held.discard(replacing)
            self._held.add(reservation)
            return reservation

    def release(self, reservation: Reservation) -> None:
        """Give a reservation back (one already given back is ignored).

        Args:
            reservation: what `reserve` returned.
        """
        with self._lock:
            self._held.discard(reservation)

    def held(self) -> dict[str, int]:
        """Bytes reserved per owner.

        Returns:
            By owner (sorted), the bytes its reservations hold together.
        """
        with self._lock:
            return self._totals()

    def _totals(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for reservation in self._held:
            totals[reservation.owner] = totals.get(reservation.owner, 0) + reservation.nbytes
        return dict(sorted(totals.items()))
