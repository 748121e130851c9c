"""The drain: copying committed checkpoints from the fast tier to the following ones, and
retention, on one background thread of the coordinating writer.

A checkpoint is copied object by object. Where the two tiers' backends can copy without this
process (:meth:`tierstore.Tier.copy_from`: nvme to nvme, a hard link on one file system, a kernel
copy across two), each extent is copied to the destination's path of the same index, keeping its
checksum (a destination with fewer paths takes extents that would meet on one path as objects of
their own); elsewhere (Zarr on a parallel file system, a remote mount) the object is read back,
its checksums checked, into a pool buffer and written out. The destination's commit record is
written last, with the items remapped onto the new objects: until then the checkpoint is not on
that tier, and an interrupted drain leaves only leftovers for the next writer to collect
(:meth:`CheckpointTier.collect`) and the checkpoint still pending, which the next coordinating
writer drains again.

Retention then keeps the newest ``keep`` checkpoints of each tier (None: all), deleting a
checkpoint from a tier before the last only once the last tier holds it (it is *durable*).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Sequence

from ..buffers import AlignedBuffer
from ..errors import CapacityError, ChecksumError
from ..staging import StagingArea
from ..tier import Placement
from .layout import Committed, Item, ObjectTable
from .staging import WAIT_SECONDS
from .tiers import CheckpointTier

_log = logging.getLogger("tierstore")
Layout = list[tuple[int, str, int]]
"""Where an object's bytes went: ``(offset in it, new object, length)`` per piece."""


class Drainer:
    """Drains and applies retention for one writer, in submission order."""

    def __init__(
        self, tiers: Sequence[CheckpointTier], keep: Sequence[int | None], pool: StagingArea
    ) -> None:
        self.tiers = list(tiers)
        self.keep = list(keep)
        self.pool = pool
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
        layouts: dict[str, Layout] = {}
        objects: ObjectTable = {}
        made: list[Placement] = []
        try:
            for name, described in record.objects.items():
                placement = source.placement(name, described)
                linked = target.link(placement)
                if linked is None:
                    linked = [(0, self._through_memory(record, source, target, placement))]
                made.extend(new for _, new in linked)
                layouts[name] = [(offset, new.name, new.nbytes) for offset, new in linked]
                objects.update(
                    {new.name: {"nbytes": new.nbytes, "extents": new.describe()} for _, new in linked}
                )
            storage = {index: _remap(item, layouts) for index, item in record.metadata.storage_data.items()}
            target.commit(
                record.name,
                record.save_id,
                objects,
                dataclasses.replace(record.metadata, storage_data=storage),
            )
        except BaseException:
            target.forget(made)
            raise

    def _through_memory(
        self, record: Committed, source: CheckpointTier, target: CheckpointTier, placement: Placement
    ) -> Placement:
        buffer = self._buffer(placement.nbytes)
        try:
            data = buffer.memoryview(placement.nbytes)
            try:
                source.read(placement, data).result()
            except ChecksumError as error:
                where = f"checkpoint {record.name!r} on tier {source.name!r}, draining to {target.name!r}"
                raise ChecksumError(f"{where}: {error}") from None
            return target.write(data).result()
        finally:
            self.pool.release(buffer)

    def _buffer(self, nbytes: int) -> AlignedBuffer:
        if not self.pool.fits(nbytes):
            raise CapacityError(
                f"draining needs a buffer of {nbytes} bytes, more than cache.budget ({self.pool.capacity}): "
                "the checkpoint was saved with a larger budget"
            )
        while (buffer := self.pool.try_acquire(nbytes, fresh_pages=True)) is None:
            with self._cond:
                self._cond.wait(WAIT_SECONDS)  # a save holds the budget: it gives buffers back as it writes
        return buffer

    def _retain(self) -> None:
        durable = {name: record.save_id for name, record in self.tiers[-1].committed().items()}
        for tier, keep in zip(self.tiers, self.keep, strict=True):
            # One listing decides: a save committing meanwhile is in neither the records superseded
            # nor the ones counted for retention (a second listing would take it for superseded).
            records = sorted(tier.scan(), key=_age)
            committed = {record.name: record for record in records}  # the newest of each name
            for record in records:
                if committed[record.name] is not record:  # a name saved again: the older is superseded
                    tier.delete(record)
            committed = dict(sorted(committed.items(), key=lambda item: _age(item[1])))
            if keep is None:
                continue
            for name, record in list(committed.items())[:-keep]:
                if tier is self.tiers[-1] or durable.get(name) == record.save_id:
                    tier.delete(record)


def _age(record: Committed) -> int:
    return record.committed_at


def _remap(item: Item, layouts: dict[str, Layout]) -> Item:
    """``item`` with its pieces moved onto the objects they were copied to."""
    pieces = []
    for name, offset, length in item["pieces"]:
        for start, new, size in layouts[name]:
            first, last = max(offset, start), min(offset + length, start + size)
            if first < last:
                pieces.append((new, first - start, last - first))
    return {**item, "pieces": pieces}
