"""The catalogue of a persistent store: which key is which object, where, with which checksums.

A manifest is a directory holding

* ``manifest.json``: a full snapshot of the catalogue (written to a temporary file, fsynced,
  renamed over the old one, directory fsynced: it is either the old or the new snapshot);
* ``journal.jsonl``: one JSON line per change since that snapshot, each appended and fsynced
  before the change is acknowledged. A crash can tear only the last line, which replay ignores.
  Every :data:`COMPACT_AFTER` lines the journal is folded into a new snapshot and truncated; a
  crash between the two steps replays the old journal over the new snapshot, which already holds
  its changes, and ends in the same state;
* ``lock``: an exclusive ``filelock`` held while a store has the manifest open, so a second
  process gets :class:`~tierstore.errors.StoreLockedError` instead of a silently forked catalogue.

Plain JSON only (never pickle); files and the directory are owner-only. A put commits by writing
its data under a fresh backend name first and journaling the new entry after, so a crash at any
moment leaves either the old entry (the new data is unreferenced garbage, collected at the next
open) or the new one.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from filelock import FileLock, Timeout

from .errors import BackendIOError, StoreLockedError

FORMAT = 1
COMPACT_AFTER = 10_000
"""Journal lines after which the manifest compacts itself, so a long-running store's journal (and
the replay at the next open) stays bounded."""


class Manifest:
    """The on-disk catalogue: ``entries`` (key -> JSON entry) plus the backend-name prefixes
    (``tokens``) this store has ever written under, so garbage from torn puts can be found."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as error:
            raise BackendIOError(
                error.errno, f"manifest: cannot create {self.directory}: {error.strerror}"
            ) from error
        self._mutex = threading.Lock()  # journal appends come from several threads
        self._lock = FileLock(self.directory / "lock", mode=0o600, is_singleton=False)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise StoreLockedError(f"manifest {self.directory} is open in another process or store") from None
        try:
            self.entries, self.tokens, self._lines = self._replay()
            self.token = secrets.token_hex(4)
            self._journal = _open_journal(self.directory / "journal.jsonl", truncate=False)
            self._append({"op": "token", "token": self.token})
            self.tokens.add(self.token)
        except BaseException:
            self._lock.release()
            raise

    # -- changes --------------------------------------------------------------------------------
    def commit_many(self, entries: Mapping[str, Mapping[str, Any]]) -> None:
        """Durably make each entry the current version of its key, with one sync for all (a pack
        of small objects): a crash may keep any prefix of them, each one whole."""
        with self._mutex:
            for key, entry in entries.items():
                record = {"op": "put", "key": key, "entry": dict(entry)}
                self._journal.write(json.dumps(record, separators=(",", ":")) + "\n")
                self.entries[key] = dict(entry)
                self._lines += 1
            self._journal.flush()
            os.fdatasync(self._journal.fileno())
            self._compact_if_due()

    def remove(self, key: str) -> None:
        with self._mutex:
            self._append({"op": "delete", "key": key})
            self.entries.pop(key, None)

    def compact(self, live_tokens: set[str]) -> None:
        """Fold the journal into a new snapshot; forget tokens no live object uses."""
        with self._mutex:
            self._compact(live_tokens)

    def _compact(self, live_tokens: set[str]) -> None:
        self.tokens = {*live_tokens, self.token}
        snapshot = {"format": FORMAT, "tokens": sorted(self.tokens), "entries": self.entries}
        temporary = self.directory / "manifest.json.tmp"
        with os.fdopen(
            os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8"
        ) as out:
            out.write(json.dumps(snapshot))  # the C encoder: json.dump streams through Python
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.directory / "manifest.json")
        _fsync_directory(self.directory)
        self._journal.close()
        self._journal = _open_journal(self.directory / "journal.jsonl", truncate=True)
        self._journal.flush()
        os.fsync(self._journal.fileno())
        self._lines = 0

    def close(self) -> None:
        if self._journal.closed:
            return
        self._journal.close()
        self._lock.release()

    # -- internals ------------------------------------------------------------------------------
    def _append(self, record: Mapping[str, Any]) -> None:
        self._journal.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._journal.flush()
        os.fdatasync(self._journal.fileno())
        self._lines += 1
        self._compact_if_due()

    def _compact_if_due(self) -> None:
        """Fold a long journal into the snapshot; every token an entry still uses stays."""
        if self._lines >= COMPACT_AFTER:
            self._compact({token_of(entry["name"]) for entry in self.entries.values()})

    def _replay(self) -> tuple[dict[str, dict[str, Any]], set[str], int]:
        """Entries, tokens and the number of journal lines replayed."""
        entries: dict[str, dict[str, Any]] = {}
        tokens: set[str] = set()
        lines = 0
        snapshot_path = self.directory / "manifest.json"
        if snapshot_path.exists():
            try:
                snapshot = json.loads(snapshot_path.read_text(encoding="utf-8"))
            except ValueError as error:
                raise BackendIOError(
                    errno.EIO, f"manifest {snapshot_path} is not valid JSON: {error}"
                ) from None
            if not isinstance(snapshot, dict) or snapshot.get("format") != FORMAT:
                raise BackendIOError(
                    errno.EIO, f"manifest {snapshot_path}: not a tierstore manifest (format {FORMAT})"
                )
            entries = snapshot["entries"]
            tokens = set(snapshot["tokens"])
        for record in self._journal_lines():
            lines += 1
            if record["op"] == "put":
                entries[record["key"]] = record["entry"]
            elif record["op"] == "delete":
                entries.pop(record["key"], None)
            elif record["op"] == "token":
                tokens.add(record["token"])
        return entries, tokens, lines

    def _journal_lines(self) -> Iterator[dict[str, Any]]:
        path = self.directory / "journal.jsonl"
        if not path.exists():
            return
        with open(path, encoding="utf-8") as journal:
            for number, line in enumerate(journal, start=1):
                if not line.endswith("\n"):
                    return  # the torn tail of a crashed append: never acknowledged
                try:
                    yield json.loads(line)
                except ValueError:
                    raise BackendIOError(errno.EIO, f"journal {path}: line {number} is damaged") from None


def token_of(name: str) -> str:
    """The store session that generated a backend object name (``{token}-{n:x}``)."""
    return name.split("-", 1)[0]


def _open_journal(path: Path, *, truncate: bool) -> TextIO:
    """The journal for appending, created owner-only."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
    return os.fdopen(os.open(path, flags, 0o600), "a", encoding="utf-8")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
