"""The catalogue of a persistent store: which key is which object, where, with which checksums.

A manifest is a directory holding

* ``manifest.json``: a full snapshot of the catalogue (written to a temporary file, fsynced,
  renamed over the old one, directory fsynced: it is either the old or the new snapshot);
* ``journal.jsonl``: one JSON line per change since that snapshot, each appended and fsynced
  before the change is acknowledged. A crash can tear only the last line, which replay ignores
  and the next open cuts off before it appends; an append that fails (a full disk) is cut back at
  once. Every line is checked at replay (:class:`~tierstore.errors.ManifestError` names one that
  is not a record). Every :data:`COMPACT_AFTER` lines the journal is folded into a new snapshot
  and truncated; a crash between the two steps replays the old journal over the new snapshot,
  which already holds its changes, and ends in the same state; where the snapshot cannot be
  written the journal simply grows;
* ``lock``: an exclusive ``filelock`` held while a store has the manifest open, so a second
  process gets :class:`~tierstore.errors.StoreLockedError` instead of a silently forked catalogue.

Plain JSON only (never pickle); files and the directory are owner-only. A put commits by writing
its data under a fresh backend name first and journaling the new entry after, so a crash at any
moment leaves either the old entry (the new data is unreferenced garbage, collected at the next
open) or the new one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired

from filelock import FileLock, Timeout
from pydantic import Field, NonNegativeInt, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic's requirement on Python 3.11

from .errors import BackendIOError, ManifestError, StoreLockedError, validation_problems

FORMAT = 1
"""The snapshot's format version; a snapshot of any other is refused, never half understood."""
COMPACT_AFTER = 10_000
"""Journal lines after which the manifest compacts itself, so a long-running store's journal (and
the replay at the next open) stays bounded."""
_log = logging.getLogger("tierstore")


class Manifest:
    """The on-disk catalogue: ``entries`` (key -> JSON entry) plus the backend-name prefixes
    (``tokens``) this store has ever written under, so garbage from torn puts can be found.

    Opening replays the snapshot and the journal, cuts off a torn last line, and journals a new
    session token (:attr:`token`) that names this session's backend objects.

    Args:
        directory: the manifest's directory; created owner-only if missing.

    Raises:
        StoreLockedError: another process or store has the manifest open.
        ManifestError: the snapshot or a journal line is not what a store wrote (named), or the
            snapshot is of another format than :data:`FORMAT`.
        BackendIOError: the directory cannot be created (a file stands in its way) or written.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except (FileExistsError, NotADirectoryError):
            raise BackendIOError(
                errno.ENOTDIR,
                f"manifest: cannot use {self.directory} as a directory: it, or a folder above it, is a file",
            ) from None
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
        self._path = self.directory / "journal.jsonl"
        try:
            self.entries, self.tokens, self._lines = self._replay()
            self.token = secrets.token_hex(4)
            self._journal = _open_journal(self._path, truncate=False)
            self._append({"op": "token", "token": self.token})
            self.tokens.add(self.token)
        except BaseException:
            self._lock.release()
            raise

    # -- changes --------------------------------------------------------------------------------
    def commit_many(self, entries: Mapping[str, Mapping[str, Any]]) -> None:
        """Durably make each entry the current version of its key, with one sync for all (a pack
        of small objects): a crash may keep any prefix of them, each one whole.

        Args:
            entries: key -> its entry (JSON-ready: :func:`tierstore.catalog._manifest_entry`).

        Raises:
            BackendIOError: the journal cannot be appended to (a full disk); none of the entries
                is committed, and the journal is as it was.
        """
        with self._mutex:
            self._write([{"op": "put", "key": key, "entry": dict(entry)} for key, entry in entries.items()])
            self.entries.update((key, dict(entry)) for key, entry in entries.items())
            self._compact_if_due()

    def remove(self, key: str) -> None:
        """Durably forget ``key``'s entry (journaled even where it has none).

        Raises:
            BackendIOError: the journal cannot be appended to; the entry stays.
        """
        with self._mutex:
            self._append({"op": "delete", "key": key})
            self.entries.pop(key, None)

    def compact(self, live_tokens: set[str]) -> None:
        """Fold the journal into a new snapshot (where the snapshot cannot be written, the
        journal stays as it is and a warning says so).

        Args:
            live_tokens: the tokens still used by an object; the others are forgotten, so the
                next open no longer collects garbage under them.
        """
        with self._mutex:
            self._compact(live_tokens)

    def _compact(self, live_tokens: set[str]) -> None:
        """Write the catalogue as a new snapshot and empty the journal. Compaction only keeps the
        journal short: where the snapshot cannot be written (a full disk), the journal, which holds
        every change, stays as it is, a warning says so, and it is tried again after as many lines
        more."""
        tokens = {*live_tokens, self.token}
        snapshot = {"format": FORMAT, "tokens": sorted(tokens), "entries": self.entries}
        temporary = self.directory / "manifest.json.tmp"
        try:
            with os.fdopen(
                os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8"
            ) as out:
                out.write(json.dumps(snapshot))  # the C encoder: json.dump streams through Python
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.directory / "manifest.json")
            _fsync_directory(self.directory)
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            _log.warning("manifest %s not compacted: %s", self.directory, error.strerror or error)
            self._lines = 0
            return
        self.tokens = tokens
        os.close(self._journal)
        self._journal = _open_journal(self._path, truncate=True)
        os.fsync(self._journal)
        self._lines = 0

    def close(self) -> None:
        """Close the journal and release the lock; idempotent."""
        if self._journal < 0:
            return
        os.close(self._journal)
        self._journal = -1
        self._lock.release()

    # -- internals ------------------------------------------------------------------------------
    def _append(self, record: Mapping[str, Any]) -> None:
        self._write([record])
        self._compact_if_due()

    def _write(self, records: list[Mapping[str, Any]]) -> None:
        """Append ``records``, a line each, and sync them. If that fails (a full disk), the journal
        is cut back to where it was, so that no part of a line is left for the next append to
        follow (the two would make one damaged line), and a :class:`BackendIOError` names it."""
        text = "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records).encode()
        end = os.fstat(self._journal).st_size
        try:
            while text:
                text = text[os.write(self._journal, text) :]
            os.fdatasync(self._journal)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(self._journal, end)
            raise BackendIOError(
                error.errno or errno.EIO,
                f"manifest: cannot append to {self._path}: {error.strerror or error}",
            ) from error
        self._lines += len(records)

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
                raise ManifestError(
                    errno.EIO, f"manifest {snapshot_path} is not valid JSON: {error}"
                ) from None
            if not isinstance(snapshot, dict) or snapshot.get("format") != FORMAT:
                raise ManifestError(
                    errno.EIO, f"manifest {snapshot_path}: not a tierstore manifest (format {FORMAT})"
                )
            _validated(_SNAPSHOT, snapshot, f"manifest {snapshot_path}")
            entries = snapshot["entries"]
            tokens = set(snapshot["tokens"])
        records, complete = self._journal_records()
        if self._path.exists() and self._path.stat().st_size > complete:
            os.truncate(self._path, complete)  # a torn last line: the next append must not follow it
        for record in records:
            lines += 1
            if record["op"] == "put":
                entries[record["key"]] = record["entry"]
            elif record["op"] == "delete":
                entries.pop(record["key"], None)
            else:
                tokens.add(record["token"])
        return entries, tokens, lines

    def _journal_records(self) -> tuple[list[dict[str, Any]], int]:
        """The journal's records, each checked, and the length in bytes of its whole lines (the
        rest is the torn tail of a crashed append, never acknowledged). A line that is not a record
        (damaged, or missing a field an entry needs) raises :class:`ManifestError` naming it, not
        a ``KeyError`` later."""
        records: list[dict[str, Any]] = []
        complete = 0
        if not self._path.exists():
            return records, complete
        with open(self._path, "rb") as journal:
            for number, line in enumerate(journal, start=1):
                if not line.endswith(b"\n"):
                    break
                try:
                    record = json.loads(line)
                except ValueError:
                    raise ManifestError(
                        errno.EIO, f"journal {self._path}: line {number} is damaged"
                    ) from None
                records.append(_validated(_RECORD, record, f"journal {self._path}: line {number}"))
                complete += len(line)
        return records, complete


class _Extent(TypedDict):
    path: str
    offset: NonNegativeInt
    length: NonNegativeInt
    checksum: NotRequired[str]


class _PackMember(TypedDict):
    offset: NonNegativeInt
    checksum: str | None


class _Entry(TypedDict):
    """One key's entry (:func:`tierstore.catalog._manifest_entry` writes them)."""

    shape: list[NonNegativeInt]
    dtype: str
    nbytes: NonNegativeInt
    tier: str
    name: str
    extents: list[_Extent]
    pack: NotRequired[_PackMember]


class _Put(TypedDict):
    op: Literal["put"]
    key: str
    entry: _Entry


class _Delete(TypedDict):
    op: Literal["delete"]
    key: str


class _Token(TypedDict):
    op: Literal["token"]
    token: str


class _Snapshot(TypedDict):
    format: int
    tokens: list[str]
    entries: dict[str, _Entry]


_RECORD: TypeAdapter[_Put | _Delete | _Token] = TypeAdapter(
    Annotated[_Put | _Delete | _Token, Field(discriminator="op")]
)
_SNAPSHOT = TypeAdapter(_Snapshot)


def _validated(adapter: TypeAdapter[Any], document: Any, where: str) -> Any:
    """``document`` if ``adapter`` accepts it as is (JSON types, no coercion), else a
    :class:`ManifestError` naming ``where`` and each bad field."""
    try:
        adapter.validate_python(document, strict=True)
    except ValidationError as error:
        raise ManifestError(errno.EIO, f"{where} is damaged: {validation_problems(error, '')}") from None
    return document


def token_of(name: str) -> str:
    """The store session that generated a backend object name (``{token}-{n:x}``)."""
    return name.split("-", 1)[0]


def _open_journal(path: Path, *, truncate: bool) -> int:
    """A file descriptor of the journal for appending (unbuffered: an append is on disk, or cut
    back, when :meth:`Manifest._write` returns), created owner-only."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
    return os.open(path, flags, 0o600)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
