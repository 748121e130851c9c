"""One tier of a store config as a home for checkpoints: writing and reading data objects,
committing and listing records, deleting checkpoints and collecting leftovers.

A writer holds a *session* on each tier it writes: a private directory on the tier's first path,
locked while the process lives (:mod:`tierstore.backends.private`), whose id prefixes every object
and record it writes. Leftovers of an interrupted save, drain or delete (objects no record uses,
torn or superseded records) are collected when a writer opens the tier, but only those of
sessions that have ended: the lock says so even across processes and hosts sharing the file
system. Tiers whose first path is not a local directory (``zarr+s3://``) cannot tell, so nothing
is collected there.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .._closeable import Closeable
from ..backends import Backend
from ..backends.private import PrivateDirectory, owner_ids, remove_abandoned
from ..config import StoreConfig, TierConfig
from ..errors import BackendIOError, ConfigError, KeyNotFoundError, OutOfRangeError, StoreClosedError
from ..limits import Priority
from ..tier import Placement, Tier
from .layout import FORMAT, Committed, ObjectTable, decode_record, encode_record, record_name, session_of

SESSION_KIND = "checkpoint"


class CheckpointTier:
    """Checkpoints on one :class:`~tierstore.Tier` (which it owns and closes)."""

    def __init__(self, tier: Tier) -> None:
        for path in tier.paths:
            if not path.backend.capabilities.persistent:
                raise ConfigError(
                    f"tier {tier.name!r} path {path.name!r} ({path.backend!r}) does not persist: "
                    "checkpoints need tiers that outlive the process"
                )
        self.tier = tier
        self.name = tier.name
        self.records = tier.paths[0].backend
        """Where the commit records live: the tier's first path."""
        self.root = local_root(self.records)
        self._session: PrivateDirectory | None = None
        self._token: str | None = None
        self._serials = itertools.count()
        self._read: dict[str, Committed] = {}
        """Valid records read so far, by record object name (a record never changes)."""
        self._placements: dict[str, Placement] = {}
        """Data objects this instance has adopted or written (their capacity claimed)."""
        self._lock = threading.Lock()

    # -- the session ------------------------------------------------------------------------------
    def token(self) -> str:
        """This writer's session id on the tier, started on first use."""
        with self._lock:
            if self._token is None:
                if self.root is not None:
                    self._session = PrivateDirectory(self.root, SESSION_KIND)
                    self._token = self._session.id
                else:
                    self._token = secrets.token_hex(8)
            return self._token

    def new_name(self, kind: str = "d", infix: str = "") -> str:
        return f"{kind}-{infix}{self.token()}-{next(self._serials):x}"

    # -- data -------------------------------------------------------------------------------------
    def write(self, data: memoryview) -> Future[Placement]:
        """Write a new data object (striped over the tier's paths, checksummed)."""
        name = self.new_name()
        written = self.tier.write(name, data, Priority.CRITICAL)
        written.add_done_callback(self._keep_written)
        return written

    def _keep_written(self, written: Future[Placement]) -> None:
        if written.exception() is None:
            self._keep(written.result())

    def _keep(self, placement: Placement) -> None:
        with self._lock:
            self._placements[placement.name] = placement

    def placement(self, name: str, described: dict[str, Any]) -> Placement:
        """The placement of a data object a record describes (adopted once: its capacity claimed)."""
        with self._lock:
            known = self._placements.get(name)
            if known is None:
                known = self.tier.placement_from(name, int(described["nbytes"]), described["extents"])
                self._placements[name] = known
            return known

    def read(self, placement: Placement, out: memoryview) -> Future[None]:
        """Read a data object whole, checking every extent's checksum."""
        return self.tier.read_into(placement, out, Priority.CRITICAL, verify=True)

    def link(self, placement: Placement) -> list[tuple[int, Placement]] | None:
        """Copy an object of another tier (another checkpoint tier's, or a store's) here without
        reading it into memory (:meth:`Tier.copy_from`: a hard link on one file system, a kernel
        copy otherwise), keeping its checksums; on a tier with fewer paths its extents become
        objects of their own. Returns ``(offset in the object, new placement)`` per new object in
        order, or None, leaving nothing behind, where a backend cannot."""
        made = self.tier.copy_from(placement, self.new_name, split=True)
        for _, copied in made or ():
            self._keep(copied)
        return made

    def forget(self, placements: Iterable[Placement]) -> None:
        """Delete data objects this instance wrote or adopted, giving their capacity back."""
        for placement in placements:
            with self._lock:
                self._placements.pop(placement.name, None)
            self.tier.discard(placement)

    # -- records ----------------------------------------------------------------------------------
    def commit(self, name: str, save_id: str, objects: ObjectTable, metadata: Any) -> Committed:
        """Write the record that commits checkpoint ``name`` (its data objects already written)."""
        committed_at = time.time_ns()
        record = self.new_name("c", f"{name}-")
        payload = {
            "format": FORMAT,
            "record": record,
            "name": name,
            "save_id": save_id,
            "committed_at": committed_at,
            "objects": objects,
            "metadata": metadata,
        }
        self.records.write(record, 0, encode_record(payload)).result()
        committed = Committed(name, save_id, committed_at, record, objects, metadata)
        with self._lock:
            self._read[record] = committed
        return committed

    def scan(self) -> list[Committed]:
        """Every valid record on the tier (several per name after a name was saved again)."""
        found = []
        for record in self.records.list():
            if record_name(record) is None:
                continue
            with self._lock:
                known = self._read.get(record)
            if known is None:
                known = self._load(record)
            if known is not None:
                found.append(known)
        return found

    def committed(self) -> dict[str, Committed]:
        """The committed checkpoints by name (the newest record of each), oldest first."""
        newest: dict[str, Committed] = {}
        for record in sorted(self.scan(), key=lambda committed: committed.committed_at):
            newest.pop(record.name, None)
            newest[record.name] = record
        return newest

    def _load(self, record: str) -> Committed | None:
        try:
            data = bytearray(self.records.size(record))
            self.records.read_into(record, 0, data).result()
        except (KeyNotFoundError, OutOfRangeError, BackendIOError):  # deleted, or still being written
            return None
        payload = decode_record(bytes(data))
        # A record names itself: a write into a recycled file that a crash cut short leaves the
        # file's old contents (an older, whole record) under the new name, which must not count.
        if payload is None or payload.get("record") != record:
            return None
        committed = Committed(
            str(payload["name"]),
            str(payload["save_id"]),
            int(payload["committed_at"]),
            record,
            payload["objects"],
            payload["metadata"],
        )
        with self._lock:
            self._read[record] = committed
        return committed

    def adopt(self) -> None:
        """Claim the capacity of every committed checkpoint's objects (a writer's tier accounts
        for what it already holds; :class:`~tierstore.CapacityError` if it cannot)."""
        for record in self.committed().values():
            for name, described in record.objects.items():
                self.placement(name, described)

    def delete(self, record: Committed) -> None:
        """Uncommit (the record goes first), then delete the checkpoint's objects."""
        with contextlib.suppress(KeyNotFoundError):
            self.records.delete(record.record)
        with self._lock:
            self._read.pop(record.record, None)
        self.forget([self.placement(name, described) for name, described in record.objects.items()])

    # -- leftovers --------------------------------------------------------------------------------
    def collect(self) -> None:
        """Delete what ended sessions left: data objects no newest record uses, and torn or
        superseded records. Live sessions' objects are never touched."""
        if self.root is None:
            return
        listed = [(path.backend, path.backend.list()) for path in self.tier.paths]
        remove_abandoned(self.root, SESSION_KIND)
        live = owner_ids(self.root, SESSION_KIND)
        kept: set[str] = set()
        for record in self.committed().values():
            kept.add(record.record)
            kept.update(record.objects)
        for backend, names in listed:
            for name in names:
                session = session_of(name)
                if session is None or session in live or name in kept:
                    continue
                with contextlib.suppress(KeyNotFoundError, BackendIOError):
                    backend.delete(name)
                with self._lock:
                    self._read.pop(name, None)
                    self._placements.pop(name, None)

    def close(self) -> None:
        """Close the tier and end the session (what it left uncommitted is collected later)."""
        self.tier.close()
        if self._session is not None:
            self._session.remove()
            self._session = None


class TierSet(Closeable):
    """The config's tiers opened for checkpoints: what the writer and the reader share."""

    def __init__(self, tiers: list[CheckpointTier]) -> None:
        self._tiers = tiers
        self._closed = False

    def checkpoints(self) -> dict[str, list[str]]:
        """The committed checkpoints on each tier, by tier name, oldest first."""
        self._check_open()
        return {tier.name: list(tier.committed()) for tier in self._tiers}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for tier in self._tiers:
                tier.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the {type(self).__name__} is closed")


def local_root(backend: Backend) -> Path | None:
    """The local directory a backend keeps its objects in, None if it has none (a URL)."""
    location = backend.location()
    if location is None or location.identity[0] != "directory":
        return None
    return Path(location.shown)


def open_tiers(config: StoreConfig, *, capacity: bool) -> list[CheckpointTier]:
    """Every tier of ``config``, in order; ``capacity=False`` ignores the tiers' capacities (a
    reader claims none)."""
    opened: list[CheckpointTier] = []
    try:
        for index, settings in enumerate(config.tiers):
            tier_config: TierConfig = settings if capacity else settings.model_copy(update={"capacity": None})
            tier = Tier.from_config(tier_config, where=f"tiers.{index}")
            try:
                opened.append(CheckpointTier(tier))
            except BaseException:
                tier.close()
                raise
    except BaseException:
        for done in opened:
            done.close()
        raise
    return opened
