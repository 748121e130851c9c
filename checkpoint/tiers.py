"""One tier of a store config as a home for checkpoints, through [`TierStore`][]: opening its data
and commit stores, committing and listing records, deleting checkpoints and collecting leftovers
(the on-tier format is in `format`).

A writer holds a *session* on each tier it writes: a lock file ``s-<session>.lock`` in the
tier's checkpoint directory, held while the process lives (the kernel drops it when the process
dies, ``kill -9`` included), whose id names every store the writer creates. A lock file gets its
name only once it is locked (it is made as ``.new`` and renamed), so a named lock that can be
taken belongs to a session that has ended.

A writer cleans up after itself: a save, drain or deletion that fails removes what it made, and
closing the writer releases the keys of its data store that no record uses, then removes the lock
file. Where that cannot be done (the process died, or the clean-up failed), the lock file stays,
and the next writer that opens the tier collects that session once (commit stores without a whole
record, data-store keys no record uses) and then removes it. Two kinds of marks in the directory
name the stores a deletion touches outside its own session's:

* ``x-<session>-<id>-<store>``: made before a deletion of that session touches the store, removed
  once it is done; an interrupted deletion's stores are collected with its session;
* ``u-<id>-<store>``: the store holds keys no record uses, which a deletion could not delete
  because another process or store had the store open; whoever next deletes the store's unused
  keys (its writer at its next save or close, or the next writer to open the tier) removes it.

So opening a writer where every earlier one closed reads no record and opens no store, however
many checkpoints the tier holds.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

from .._checks import default_of
from .._closeable import Closeable
from ..config import CacheConfig, StoreConfig, StoreOptions, TierConfig
from ..errors import (
    BackendIOError,
    ConfigError,
    KeyNotFoundError,
    ManifestError,
    StoreClosedError,
    StoreLockedError,
)
from ..store import TierStore
from ..tier import Tier
from .format import (
    COMMIT_STORE,
    DATA_STORE,
    DIRECTORY,
    FORMAT,
    RECORD_KEY,
    Committed,
    decode_record,
    encode_record,
)

_log = logging.getLogger("tierstore")
LOCK_SUFFIX = ".lock"
DELETING = re.compile(r"x-([0-9a-f]{8})-[0-9a-f]{8}-(.+)")
"""``x-<session>-<id>-<store>``: a deletion of that session is under way in the store."""
UNUSED = re.compile(r"u-([0-9a-f]{8})-(.+)")
"""``u-<id>-<store>``: the store holds keys no record uses (a deletion found it open elsewhere)."""


class CheckpointTier:
    """Checkpoints on one tier of a config: the stores under ``<root>/.checkpoints``.

    Args:
        config: the tier's settings (its ``capacity`` bounds each store opened on it).
        where: the tier's place in the config (``tiers.1``), for messages.
        writable: whether this instance writes (takes a session, creates stores).
        first: whether it is the config's first tier, where each writer keeps a data store open
            while it lives; on the following tiers a data store is a drained copy, closed before
            the record that uses it is committed.
    """

    def __init__(self, config: TierConfig, where: str, *, writable: bool, first: bool) -> None:
        self.config = config
        self.where = where
        self.name = config.name
        self.first = first
        self.directory = _checkpoint_directory(config, where)
        self._session: FileLock | None = None
        self._session_id: str | None = None
        self._clean = True
        """Whether this session leaves nothing to collect: False once a clean-up has failed (or
        could not be tried), so that its lock file stays for the next writer to collect it."""
        self._serials = itertools.count()
        self._records: dict[str, Committed] = {}
        """Valid records read so far, by commit store (a record never changes)."""
        self._lock = threading.Lock()
        if writable:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    # -- stores -----------------------------------------------------------------------------------
    def open_store(
        self,
        store: str,
        *,
        read_only: bool = False,
        cache_budget: int = 0,
        cache_resident: bool = default_of(CacheConfig, "resident"),
        pack_below: int = default_of(CacheConfig, "pack_below"),
        memory_budget: int | None = default_of(StoreOptions, "memory_budget"),
        workers: int = default_of(StoreOptions, "workers"),
    ) -> TierStore:
        """Open the persistent store ``store`` (``d-...`` or ``c-...``) of this tier (the arguments
        are [`TierStore`][]'s, with their defaults but ``cache_budget``: none, as a store only read
        or drained has nothing to stage).

        Raises:
            StoreLockedError: (writable) another process or store has it open.
            ManifestError: (read-only) there is no such store.
        """
        tier = Tier.from_config(self.config, where=self.where)
        try:
            return TierStore(
                [tier],
                manifest=self.directory / store,
                read_only=read_only,
                cache_budget=cache_budget,
                cache_resident=cache_resident,
                pack_below=pack_below,
                memory_budget=memory_budget,
                workers=workers,
            )
        except BaseException:
            tier.close()
            if not read_only and _session_of(store) == self._session_id:
                self._clean = False  # a store of this session, perhaps half made
            raise

    def write_slots(self) -> int:
        """Writes the tier runs at once: its paths' ``max_writes`` together."""
        return sum(path.max_writes for path in self.config.path_configs())

    def new_store_name(self, kind: str = "d", infix: str = "") -> str:
        """A name for a store of this writer's session: ``d-<session><n>`` or
        ``c-<name>-<session><n>`` (8 hex digits each)."""
        return f"{kind}-{infix}{self.session()}{next(self._serials):08x}"

    def session(self) -> str:
        """This writer's session id on the tier, its lock taken on first use."""
        with self._lock:
            if self._session_id is None:
                session_id = secrets.token_hex(4)
                path = self.directory / f"s-{session_id}{LOCK_SUFFIX}"
                staging = path.with_name(path.name + ".new")
                lock = FileLock(staging, mode=0o600, is_singleton=False)
                lock.acquire(timeout=0)  # nobody else knows the name yet
                os.rename(staging, path)
                self._session, self._session_id = lock, session_id
            return self._session_id

    # -- records ----------------------------------------------------------------------------------
    def commit(self, name: str, save_id: str, metadata: Any, committed_at: int | None = None) -> Committed:
        """Write the record that commits checkpoint ``name`` (its data already committed in its
        data stores) in a commit store of its own.

        Args:
            committed_at: when the save committed (``time.time_ns()``); None for now. A drained
                copy keeps its save's, so that the newest save of a name stays the newest on
                every tier whatever order the drains end in.
        """
        store_name = self.new_store_name("c", f"{name}-")
        committed_at = time.time_ns() if committed_at is None else committed_at
        payload = {
            "format": FORMAT,
            "name": name,
            "save_id": save_id,
            "committed_at": committed_at,
            "metadata": metadata,
        }
        data = torch.frombuffer(bytearray(encode_record(payload)), dtype=torch.uint8)
        try:
            with self.open_store(store_name) as store:
                store.put(RECORD_KEY, data, cache=False).result()  # journaled (fsynced): committed
        except BaseException:
            self.abandon_store(store_name)
            raise
        committed = Committed(name, save_id, committed_at, store_name, metadata)
        with self._lock:
            self._records[store_name] = committed
        return committed

    def scan(self, name: str | None = None) -> list[Committed]:
        """Every valid record on the tier (several per name after a name was saved again); with
        ``name``, those of that checkpoint only (the others are not read)."""
        found = []
        for store_name in self._listing():
            match = COMMIT_STORE.fullmatch(store_name)
            if match is None or (name is not None and match.group(1) != name):
                continue
            with self._lock:
                known = self._records.get(store_name)
            if known is None:
                known = self._read_record(store_name)
            if known is not None:
                found.append(known)
        return found

    def committed(self, name: str | None = None) -> dict[str, Committed]:
        """The committed checkpoints by name (the newest record of each), oldest first; with
        ``name``, that checkpoint alone if the tier holds it."""
        newest: dict[str, Committed] = {}
        for record in sorted(self.scan(name), key=lambda committed: committed.committed_at):
            newest.pop(record.name, None)
            newest[record.name] = record
        return newest

    def _read_record(self, store_name: str) -> Committed | None:
        try:
            with self.open_store(store_name, read_only=True) as store:
                if RECORD_KEY not in store:
                    return None
                data = store.get(RECORD_KEY, cache=False).result()
        except (ManifestError, KeyNotFoundError, BackendIOError):  # being written or deleted, or torn
            return None
        payload = decode_record(data.numpy().tobytes())
        if payload is None:
            return None
        committed = Committed(
            str(payload["name"]),
            str(payload["save_id"]),
            int(payload["committed_at"]),
            store_name,
            payload["metadata"],
        )
        with self._lock:
            self._records[store_name] = committed
        return committed

    # -- deleting ---------------------------------------------------------------------------------
    def delete(self, record: Committed, own: tuple[str, TierStore] | None = None) -> None:
        """Uncommit checkpoint ``record`` (its record goes first), then delete its keys from its
        data stores, each store marked (``x-``) while the deletion is under way. ``own`` is this
        writer's open data store (name, store), whose keys it deletes itself; a data store that
        another writer (or a collection) has open keeps the keys, marked (``u-``), until its holder
        releases them (`release_unreferenced`) or the next writer collects them."""
        with self._lock:
            self._records.pop(record.store, None)
        used = record.keys_by_store()
        deletion = f"x-{self.session()}-{secrets.token_hex(4)}"
        try:
            marks = [self._mark(f"{deletion}-{store_name}") for store_name in (record.store, *used)]
            if self.remove_store(record.store):  # else being committed right now, or deleted
                for store_name, keys in used.items():
                    doomed = set(keys).__contains__
                    if own is not None and store_name == own[0]:
                        _delete_from(own[1], doomed)
                    elif not self._delete_from_closed(store_name, doomed):
                        self._mark(f"u-{secrets.token_hex(4)}-{store_name}")
            for mark in marks:
                mark.unlink(missing_ok=True)
        except BaseException:
            self._clean = False  # the marks stay: the session's collector finishes the deletion
            raise

    def remove_store(self, store_name: str) -> bool:
        """Delete every key of a store no one has open, then its manifest; False if it is open."""
        return self._delete_from_closed(store_name, lambda key: True)

    def abandon_store(self, store_name: str) -> None:
        """Remove a store of this session that a failed save or drain leaves unused; where that
        fails too, the session is left for the next writer to collect."""
        try:
            removed = self.remove_store(store_name)
        except Exception as error:  # the caller raises the error that made the store useless
            _log.warning("tierstore: cannot remove checkpoint store %s: %s", store_name, error)
            removed = False
        if not removed:
            self._clean = False

    def close_writer_store(self, name: str, store: TierStore) -> None:
        """Close this writer's data store ``name`` at the end of its session, no save in flight:
        the keys no record uses are deleted first, and the store once it is empty."""
        try:
            try:
                if len(store):
                    self.release_unreferenced(name, store, set)
                empty = len(store) == 0
            finally:
                store.close()
        except BaseException:
            self._clean = False
            raise
        if empty:
            shutil.rmtree(self.directory / name, ignore_errors=True)

    def _delete_from_closed(self, store_name: str, doomed: Callable[[str], bool]) -> bool:
        """Delete the ``doomed`` keys of a store no one has open, and the store once it is empty
        (one that is gone already has nothing to delete). False where another process or store
        has it open."""
        if not (self.directory / store_name).exists():
            return True
        try:
            store = self.open_store(store_name)
        except StoreLockedError:
            return False
        with store:
            _delete_from(store, doomed)
            empty = len(store) == 0
        if empty:
            shutil.rmtree(self.directory / store_name, ignore_errors=True)
        return True

    # -- leftovers --------------------------------------------------------------------------------
    def collect(self) -> None:
        """Collect what sessions that ended without cleaning up left (commit stores without a whole
        record, data-store keys no record uses, stores left empty; an interrupted deletion's
        stores), each such session once, and the keys of stores marked as holding unused ones.
        Live sessions' stores are never touched. Where there is nothing to collect, this lists
        the tier's directory and nothing more: no record is read, no store opened."""
        entries = self._listing(everything=True)
        dead = self._dead_sessions(entries)
        unused = _unused_marks(entries)  # listed before the records are read
        collected: set[str] = set()
        try:
            if not dead and not unused:
                return
            records = self.scan()
            used = _used_keys(records)
            valid = {record.store for record in records}
            for session_id in dead:
                if self._collect_session(session_id, entries, used, valid):
                    collected.add(session_id)
            for store_name, marks in unused.items():
                if self._delete_from_closed(store_name, _unused(used.get(store_name, set()))):
                    for mark in marks:
                        (self.directory / mark).unlink(missing_ok=True)
        finally:
            for session_id, lock in dead.items():
                if session_id in collected:  # else it stays for the next writer to finish
                    (self.directory / f"s-{session_id}{LOCK_SUFFIX}").unlink(missing_ok=True)
                lock.release()

    def _collect_session(
        self, session_id: str, entries: list[str], used: dict[str, set[str]], valid: set[str]
    ) -> bool:
        """Collect the stores of an ended session and those its unfinished deletions touched;
        False where a store is open elsewhere (the session is collected again later)."""
        deleting = {
            entry: match.group(2)
            for entry in entries
            if (match := DELETING.fullmatch(entry)) is not None and match.group(1) == session_id
        }
        own = {entry for entry in entries if _session_of(entry) == session_id}
        touched = set(deleting.values())
        done = True
        for store_name in sorted(own | touched):
            if COMMIT_STORE.fullmatch(store_name):
                if store_name not in valid:
                    done = self.remove_store(store_name) and done
            elif DATA_STORE.fullmatch(store_name):
                if store_name not in touched and not self.first and store_name in used:
                    continue  # a drained copy its record uses: whole, closed before the commit
                done = self._delete_from_closed(store_name, _unused(used.get(store_name, set()))) and done
        if done:
            for mark in deleting:
                (self.directory / mark).unlink(missing_ok=True)
        return done

    def release_unreferenced(self, name: str, store: TierStore, in_flight: Callable[[], set[str]]) -> None:
        """Delete the keys of this writer's open data store (``name``) that no record on the tier
        uses, but for those of saves in flight (``in_flight()``: their key prefixes), and the
        store's ``u-`` marks.

        The marks are listed first, the keys next, the saves in flight next, the records last: a
        mark is made once its record is gone, and a key listed belongs to a save registered in
        flight before its first put, which leaves that set only once its record is committed
        (and so found) or its save has failed."""
        try:
            marks = _unused_marks(self._listing(everything=True)).get(name, [])
            keys = set(store.keys())
            prefixes = tuple(in_flight())
            used = _used_keys(self.scan()).get(name, set())
            _delete_from(store, lambda key: key in keys and key not in used and not key.startswith(prefixes))
            for mark in marks:
                (self.directory / mark).unlink(missing_ok=True)
        except BaseException:
            self._clean = False
            raise

    def _mark(self, name: str) -> Path:
        """Make the mark file ``name`` in the tier's directory."""
        path = self.directory / name
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        return path

    def _dead_sessions(self, entries: list[str]) -> dict[str, FileLock]:
        """Sessions among ``entries`` that have ended without cleaning up (their lock files are
        left), each with its lock now held by this process."""
        dead: dict[str, FileLock] = {}
        for entry in entries:
            if entry.startswith("s-") and entry.endswith(LOCK_SUFFIX + ".new"):
                self._remove_if_abandoned(entry)  # its writer died before naming it: no stores
                continue
            if not (entry.startswith("s-") and entry.endswith(LOCK_SUFFIX)):
                continue
            session_id = entry[2 : -len(LOCK_SUFFIX)]
            if session_id == self._session_id:
                continue
            lock = self._take_lock(entry)
            if lock is not None:
                dead[session_id] = lock
        return dead

    def _remove_if_abandoned(self, entry: str) -> None:
        lock = self._take_lock(entry)
        if lock is not None:
            (self.directory / entry).unlink(missing_ok=True)
            lock.release()

    def _take_lock(self, entry: str) -> FileLock | None:
        """The lock of file ``entry`` if no one holds it (its session has ended), else None."""
        lock = FileLock(self.directory / entry, mode=0o600, is_singleton=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return None
        return lock

    def _listing(self, *, everything: bool = False) -> list[str]:
        """The checkpoint stores in the tier's directory (``everything``: lock files too)."""
        try:
            entries = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        if everything:
            return entries
        return [entry for entry in entries if DATA_STORE.fullmatch(entry) or COMMIT_STORE.fullmatch(entry)]

    def close(self) -> None:
        """End the session: its lock file goes, unless a clean-up failed (the next writer then
        collects the session)."""
        with self._lock:
            if self._session is not None:
                if self._clean:
                    (self.directory / f"s-{self._session_id}{LOCK_SUFFIX}").unlink(missing_ok=True)
                self._session.release()
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


def open_tiers(config: StoreConfig, *, writable: bool) -> list[CheckpointTier]:
    """Every tier of ``config``, in order; a reader (``writable=False``) ignores the tiers'
    capacities (it claims none)."""
    opened: list[CheckpointTier] = []
    for index, settings in enumerate(config.tiers):
        tier_config = settings if writable else settings.model_copy(update={"capacity": None})
        opened.append(CheckpointTier(tier_config, f"tiers.{index}", writable=writable, first=index == 0))
    return opened


def _checkpoint_directory(config: TierConfig, where: str) -> Path:
    """``<root>/.checkpoints`` for a tier whose paths all persist and whose first path is a local
    directory (the manifests' home); [`ConfigError`][] otherwise."""
    tier = Tier.from_config(config, where=where)
    try:
        for path in tier.paths:
            if not path.backend.capabilities.persistent:
                raise ConfigError(
                    f"tier {tier.name!r} path {path.name!r} ({path.backend!r}) does not persist: "
                    "checkpoints need tiers that outlive the process"
                )
        location = tier.paths[0].backend.location()
        if location is None or location.identity[0] != "directory":
            raise ConfigError(
                f"tier {tier.name!r}: its first path ({tier.paths[0].backend!r}) is not a local directory, "
                "where checkpoints keep their stores' manifests"
            )
        return Path(location.shown) / DIRECTORY
    finally:
        tier.close()


def _session_of(store_name: str) -> str | None:
    """The writer session that created a store (``d-<session><n>``, ``c-<name>-<session><n>``)."""
    match = DATA_STORE.fullmatch(store_name) or COMMIT_STORE.fullmatch(store_name)
    if match is None:
        return None
    return store_name[-16:-8]


def _delete_from(store: TierStore, doomed: Callable[[str], bool]) -> None:
    """Delete the keys of an open store that ``doomed`` picks (one deleted meanwhile is skipped)."""
    for key in list(store):
        if doomed(key):
            with contextlib.suppress(KeyNotFoundError):
                store.delete(key)


def _unused_marks(entries: list[str]) -> dict[str, list[str]]:
    """The `UNUSED` marks among ``entries``, by store."""
    marks: dict[str, list[str]] = {}
    for entry in entries:
        match = UNUSED.fullmatch(entry)
        if match is not None:
            marks.setdefault(match.group(2), []).append(entry)
    return marks


def _used_keys(records: list[Committed]) -> dict[str, set[str]]:
    """The keys ``records`` use, by data store."""
    used: dict[str, set[str]] = {}
    for record in records:
        for store_name, keys in record.keys_by_store().items():
            used.setdefault(store_name, set()).update(keys)
    return used


def _unused(kept: set[str]) -> Callable[[str], bool]:
    """Picks the keys not in ``kept``."""
    return lambda key: key not in kept
