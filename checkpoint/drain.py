"""The drain: copying committed checkpoints from the fast tier to the following ones, and
retention, on one background thread of the coordinating writer.

A checkpoint is copied data store by data store: each store it uses on the source tier is opened
read-only and copied with [`TierStore.copy_to`][] into a new store of the destination tier, under
the same keys. Where the two tiers' backends can copy without this process (nvme to nvme: a hard
link on one file system, a kernel copy across two), no byte passes through memory and the checksums
are carried over; elsewhere (Zarr on a parallel file system, a remote mount) each key is read back,
its checksums checked, and written out, one key (at most a quarter of ``cache.budget``) at a time.
The destination's commit record is written last, with the items pointing to the new stores: until
then the checkpoint is not on that tier, and an interrupted drain leaves only stores no record uses,
for the next writer to collect (`CheckpointTier.collect`), and the checkpoint still pending, which
the next coordinating writer drains again.

Retention then keeps the newest ``keep`` checkpoints of each tier (None: all), deleting a
checkpoint from a tier before the last only once the last tier holds it (it is *durable*).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from collections import deque
from collections.abc import Sequence

from ..errors import BackendIOError, ChecksumError
from ..store import TierStore
from .format import Committed
from .tiers import CheckpointTier

_log = logging.getLogger("tierstore")


class Drainer:
    """Drains and applies retention for one writer, in submission order."""

    def __init__(
        self, tiers: Sequence[CheckpointTier], keep: Sequence[int | None], own: tuple[str, TierStore]
    ) -> None:
        self.tiers = list(tiers)
        self.keep = list(keep)
        self.own = own
        """The writer's data store on the first tier (name, store), whose keys retention deletes
        through it."""
        self._queue: deque[str] = deque()
        self._current: str | None = None
        self._failures: dict[str, BaseException] = {}
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tierstore-drain", daemon=True)
        self._thread.start()

    def submit(self, name: str) -> None:
        with self._cond:
            self._failures.pop(name, None)
            if name not in self._queue:
                self._queue.append(name)
            self._cond.notify_all()

    def pending(self) -> list[str]:
        """Committed checkpoints some later tier lacks (and would keep), oldest first."""
        newest: dict[str, tuple[int, Committed]] = {}
        for index, tier in enumerate(self.tiers):
            for record in tier.committed().values():
                if record.name not in newest or record.committed_at > newest[record.name][1].committed_at:
                    newest[record.name] = (index, record)
        waiting = []
        for index, record in sorted(newest.values(), key=lambda found: found[1].committed_at):
            for later in range(index + 1, len(self.tiers)):
                held = self.tiers[later].committed()
                copy = held.get(record.name)
                if copy is not None and copy.save_id == record.save_id:
                    continue
                keep = self.keep[later]
                times = sorted(other.committed_at for other in held.values())
                if keep is None or len(times) < keep or record.committed_at > times[-keep]:
                    waiting.append(record.name)
                    break
        return waiting

    def wait(self, name: str | None, timeout: float | None) -> bool:
        """Wait until ``name`` (None: everything submitted) is drained; False on timeout. Raises
        the drain's error if it failed."""
        with self._cond:

            def settled() -> bool:
                if name is None:
                    return not self._queue and self._current is None
                return name not in self._queue and self._current != name

            if not self._cond.wait_for(settled, timeout):
                return False
            failure = (
                self._failures.get(name) if name is not None else next(iter(self._failures.values()), None)
            )
        if failure is not None:
            raise failure
        return True

    def close(self) -> None:
        """Finish what is queued, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                self._current = self._queue.popleft()
            try:
                self._drain(self._current)
                if not self._queue:
                    self._retain()
            except Exception as error:
                _log.warning("tierstore: draining checkpoint %r failed: %s", self._current, error)
                with self._cond:
                    self._failures[self._current] = error
            with self._cond:
                self._current = None
                self._cond.notify_all()

    def _drain(self, name: str) -> None:
        holders = [(tier, tier.committed().get(name)) for tier in self.tiers]
        newest = max((record for _, record in holders if record is not None), key=_age, default=None)
        if newest is None:
            return  # deleted or replaced meanwhile
        source: CheckpointTier | None = None
        for tier, record in holders:
            if record is not None and record.save_id == newest.save_id:
                source = source or tier
                continue
            if source is not None:
                self._copy_checkpoint(newest, source, tier)

    def _copy_checkpoint(self, record: Committed, source: CheckpointTier, target: CheckpointTier) -> None:
        copies: dict[str, str] = {}
        try:
            for store_name, keys in record.keys_by_store().items():
                copy_name = target.new_store_name()
                copies[store_name] = copy_name
                with (
                    source.open_store(store_name, read_only=True) as origin,
                    target.open_store(copy_name) as destination,
                ):
                    try:
                        origin.copy_to(destination, keys)
                    except ChecksumError as error:
                        raise ChecksumError(f"{_where(record, source, target)}: {error}") from None
                    except BackendIOError as error:
                        raise BackendIOError(
                            error.errno or errno.EIO,
                            f"{_where(record, source, target)}: {error.strerror or error}",
                        ) from None
            storage = {
                index: {**item, "store": copies[item["store"]]} for index, item in record.items().items()
            }
            metadata = dataclasses.replace(record.metadata, storage_data=storage)
            target.commit(record.name, record.save_id, metadata, record.committed_at)
        except BaseException:
            for copy_name in copies.values():
                target.abandon_store(copy_name)
            raise

    def _retain(self) -> None:
        durable = {name: record.save_id for name, record in self.tiers[-1].committed().items()}
        for tier, keep in zip(self.tiers, self.keep, strict=True):
            # One listing decides: a save committing meanwhile is in neither the records superseded
            # nor the ones counted for retention (a second listing would take it for superseded).
            records = sorted(tier.scan(), key=_age)
            committed = {record.name: record for record in records}  # the newest of each name
            for record in records:
                if committed[record.name] is not record:  # a name saved again: the older is superseded
                    tier.delete(record, self.own)
            committed = dict(sorted(committed.items(), key=lambda item: _age(item[1])))
            if keep is None:
                continue
            for name, record in list(committed.items())[:-keep]:
                if tier is self.tiers[-1] or durable.get(name) == record.save_id:
                    tier.delete(record, self.own)


def _age(record: Committed) -> int:
    return record.committed_at


def _where(record: Committed, source: CheckpointTier, target: CheckpointTier) -> str:
    return f"checkpoint {record.name!r} on tier {source.name!r}, draining to {target.name!r}"
