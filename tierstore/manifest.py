"""The catalogue of a persistent store: which key is which object, where, with which checksums.

A manifest is a directory holding

* ``manifest.json``: a full snapshot of the catalogue (written to a temporary file, fsynced,
  renamed over the old one, directory fsynced: it is either the old or the new snapshot);
* ``journal.jsonl``: one JSON line per change since that snapshot, each appended and fsynced before
  the change is acknowledged. A crash can tear only the last line, which replay ignores and the next
  open cuts off before it appends; an append that fails (a full disk) is cut back at once. Every
  line is checked at replay ([`ManifestError`][] names one that is not a record). Every
  `COMPACT_AFTER` lines the journal is folded into a new snapshot and truncated; a crash between the
  two steps replays the old journal over the new snapshot, which already holds its changes, and ends
  in the same state; where the snapshot cannot be written the journal simply grows;
* ``lock``: an exclusive ``filelock`` held while a store has the manifest open, so a second process
  gets [`StoreLockedError`][] instead of a silently forked catalogue.

A reader (``Manifest(directory, read_only=True)``, behind ``TierStore(..., read_only=True)``) takes
no lock, so it opens a manifest that a writer in this or another process has open. It replays the
snapshot and the journal as they are at that moment and changes nothing: a torn last line is
ignored, not cut off; no token is journaled; nothing is compacted or created. It stays consistent
with a writer compacting meanwhile by reading twice: it notes the snapshot's identity (inode, size,
modification and change times), reads the snapshot, then the journal, reads the journal's whole
lines again, and notes the snapshot's identity once more. A compaction renames its snapshot into
place before it truncates the journal, and journals nothing in between, so if the identity did not
change and the journal's lines read are still its first lines, the journal read belongs to the
snapshot read (a journal truncated under the reader, whose first read kept only the lines of an
older snapshot, fails the second check); otherwise it replays again, up to `READ_ATTEMPTS` times.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired

from filelock import FileLock, Timeout
from pydantic import Field, NonNegativeInt, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic's requirement on Python 3.11

from .errors import (
    BackendIOError,
    ManifestError,
    ReadOnlyStoreError,
    StoreLockedError,
    validation_problems,
)

FORMAT = 1
"""The snapshot's format version; a snapshot of any other is refused, never half understood."""
COMPACT_AFTER = 10_000
"""Journal lines after which the manifest compacts itself, so a long-running store's journal (and
the replay at the next open) stays bounded."""
READ_ATTEMPTS = 16
"""How many times a read-only open replays the manifest while a writer keeps compacting it under the
reader, before it gives up with a [`ManifestError`][]."""
SNAPSHOT = "manifest.json"
JOURNAL = "journal.jsonl"
_log = logging.getLogger("tierstore")


class Manifest:
    """The on-disk catalogue: ``entries`` (key -> JSON entry) plus the backend-name prefixes
    (``tokens``) this store has ever written under, so garbage from torn puts can be found.

    Opening for writing takes the lock, replays the snapshot and the journal, cuts off a torn last
    line, and journals a new session token (`token`) that names this session's backend objects.
    Opening read-only takes no lock and writes nothing (see the module docstring): it is the
    catalogue as of the open, and every change is refused.

    Args:
        directory: the manifest's directory; created owner-only if missing (for writing).
        read_only: read the manifest without locking or changing it, even while a writer has it
            open; the directory must hold a manifest.

    Raises:
        StoreLockedError: (for writing) another process or store has the manifest open.
        ManifestError: the snapshot or a journal line is not what a store wrote (named), or the
            snapshot is of another format than `FORMAT`; read-only: there is no manifest at
            ``directory``, or a writer compacted it under every one of `READ_ATTEMPTS` replays.
        BackendIOError: the directory cannot be created (a file stands in its way), read or
            written.
    """

    def __init__(self, directory: str | os.PathLike[str], *, read_only: bool = False) -> None:
        self.directory = Path(directory)
        self.read_only = read_only
        """Opened without the lock: nothing is ever written (see the module docstring)."""
        self._path = self.directory / JOURNAL
        self._mutex = threading.Lock()  # journal appends come from several threads
        self._journal = -1
        self._lock: FileLock | None = None
        if read_only:
            replayed = _replay(self.directory, attempts=READ_ATTEMPTS, must_exist=True)
            self.entries, self.tokens, self._lines = replayed.entries, replayed.tokens, replayed.lines
            self.token = secrets.token_hex(4)
            """A read-only manifest's token is never journaled: its store writes no object."""
            return
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
        lock = FileLock(self.directory / "lock", mode=0o600, is_singleton=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise StoreLockedError(f"manifest {self.directory} is open in another process or store") from None
        self._lock = lock
        try:
            # The lock keeps every other writer out, so the first replay is consistent.
            replayed = _replay(self.directory, attempts=1, must_exist=False)
            self.entries, self.tokens, self._lines = replayed.entries, replayed.tokens, replayed.lines
            if replayed.journal_bytes > replayed.whole_bytes:
                # a torn last line: the next append must not follow it
                os.truncate(self._path, replayed.whole_bytes)
            self.token = secrets.token_hex(4)
            self._journal = _open_journal(self._path, truncate=False)
            self._append({"op": "token", "token": self.token})
            self.tokens.add(self.token)
        except BaseException:
            lock.release()
            raise

    # -- changes --------------------------------------------------------------------------------
    def commit_many(self, entries: Mapping[str, Mapping[str, Any]]) -> None:
        """Durably make each entry the current version of its key, with one sync for all (a pack
        of small objects): a crash may keep any prefix of them, each one whole.

        Args:
            entries: key -> its entry (JSON-ready: `tierstore.catalog._manifest_entry`).

        Raises:
            BackendIOError: the journal cannot be appended to (a full disk); none of the entries
                is committed, and the journal is as it was.
            ReadOnlyStoreError: the manifest is open read-only.
        """
        self._check_writable("commit")
        with self._mutex:
            self._write([{"op": "put", "key": key, "entry": dict(entry)} for key, entry in entries.items()])
            self.entries.update((key, dict(entry)) for key, entry in entries.items())
            self._compact_if_due()

    def remove(self, key: str) -> None:
        """Durably forget ``key``'s entry (journaled even where it has none).

        Raises:
            BackendIOError: the journal cannot be appended to; the entry stays.
            ReadOnlyStoreError: the manifest is open read-only.
        """
        self._check_writable("remove")
        with self._mutex:
            self._append({"op": "delete", "key": key})
            self.entries.pop(key, None)

    def compact(self, live_tokens: set[str]) -> None:
        """Fold the journal into a new snapshot (where the snapshot cannot be written, the
        journal stays as it is and a warning says so).

        Args:
            live_tokens: the tokens still used by an object; the others are forgotten, so the
                next open no longer collects garbage under them.

        Raises:
            ReadOnlyStoreError: the manifest is open read-only.
        """
        self._check_writable("compact")
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
        """Close the journal and release the lock; idempotent (a read-only manifest holds
        neither)."""
        if self._journal < 0:
            return
        os.close(self._journal)
        self._journal = -1
        assert self._lock is not None
        self._lock.release()

    # -- internals ------------------------------------------------------------------------------
    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyStoreError(f"manifest {self.directory} is open read-only: {what} refused")

    def _append(self, record: Mapping[str, Any]) -> None:
        self._write([record])
        self._compact_if_due()

    def _write(self, records: list[Mapping[str, Any]]) -> None:
        """Append ``records``, a line each, and sync them. If that fails (a full disk), the journal
        is cut back to where it was, so that no part of a line is left for the next append to follow
        (the two would make one damaged line), and a [`BackendIOError`][] names it."""
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


@dataclass(frozen=True)
class _Replayed:
    """A manifest as replayed from its snapshot and journal."""

    entries: dict[str, dict[str, Any]]
    tokens: set[str]
    lines: int
    """Journal records replayed."""
    whole_bytes: int
    """The length of the journal's whole lines (a torn last line follows them)."""
    journal_bytes: int
    """The length of the journal as read."""


def _replay(directory: Path, *, attempts: int, must_exist: bool) -> _Replayed:
    """The manifest in ``directory``: the snapshot, then the journal's whole records over it.

    Consistent against a writer compacting meanwhile (see the module docstring): a replay whose
    snapshot changed while it was read, or whose journal lines are no longer the journal's first
    lines, is done again, ``attempts`` times at most.

    Args:
        directory: the manifest's directory.
        attempts: how many replays to try (1 where the caller holds the lock: nothing else
            changes the files).
        must_exist: a directory without a manifest is a [`ManifestError`][] (read-only opens),
            rather than an empty catalogue (a new store).
    """
    snapshot_path, journal_path = directory / SNAPSHOT, directory / JOURNAL
    if must_exist and not directory.is_dir():
        reason = ": it is not a directory" if directory.exists() else ""
        raise ManifestError(errno.ENOENT, f"no persistent store at {directory}{reason}")
    for _ in range(attempts):
        identity = _identity(snapshot_path)
        snapshot = _read_bytes(snapshot_path)
        journal = _read_bytes(journal_path)
        whole_bytes = 0 if journal is None else journal.rfind(b"\n") + 1
        lines = b"" if journal is None else journal[:whole_bytes]
        again = _read_bytes(journal_path) if attempts > 1 else journal
        if attempts > 1 and ((again or b"")[:whole_bytes] != lines or _identity(snapshot_path) != identity):
            continue  # a writer compacted the manifest while it was read
        if must_exist and snapshot is None and journal is None:
            raise ManifestError(
                errno.ENOENT,
                f"no persistent store at {directory}: it holds neither {SNAPSHOT} nor {JOURNAL}",
            )
        entries, tokens = _parse_snapshot(snapshot_path, snapshot)
        records = _parse_journal(journal_path, lines)
        for record in records:
            if record["op"] == "put":
                entries[record["key"]] = record["entry"]
            elif record["op"] == "delete":
                entries.pop(record["key"], None)
            else:
                tokens.add(record["token"])
        return _Replayed(entries, tokens, len(records), whole_bytes, 0 if journal is None else len(journal))
    raise ManifestError(
        errno.EAGAIN,
        f"manifest {directory} was compacted under each of {attempts} attempts to read it; "
        "its writer is compacting continuously: open it again later",
    )


def _parse_snapshot(path: Path, snapshot: bytes | None) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """The entries and tokens of the snapshot read from ``path`` (none where it is missing)."""
    if snapshot is None:
        return {}, set()
    try:
        document = json.loads(snapshot.decode("utf-8"))
    except ValueError as error:
        raise ManifestError(errno.EIO, f"manifest {path} is not valid JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ManifestError(errno.EIO, f"manifest {path}: not a tierstore manifest (format {FORMAT})")
    _validated(_SNAPSHOT, document, f"manifest {path}")
    return document["entries"], set(document["tokens"])


def _parse_journal(path: Path, lines: bytes) -> list[dict[str, Any]]:
    """The records of the journal's whole ``lines`` read from ``path``, each checked (the torn tail
    of a crashed append, never acknowledged, is not among them). A line that is not a record
    (damaged, or missing a field an entry needs) raises [`ManifestError`][] naming it, not a
    ``KeyError`` later."""
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines.split(b"\n")[:-1], start=1):
        try:
            record = json.loads(line)
        except ValueError:
            raise ManifestError(errno.EIO, f"journal {path}: line {number} is damaged") from None
        records.append(_validated(_RECORD, record, f"journal {path}: line {number}"))
    return records


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    """What changes whenever a file is replaced or rewritten: its inode, size, modification and
    change times; None where it is missing."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _read_bytes(path: Path) -> bytes | None:
    """The whole content of ``path``, or None where it is missing."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise BackendIOError(
            error.errno or errno.EIO, f"manifest: cannot read {path}: {error.strerror or error}"
        ) from error


class _Extent(TypedDict):
    path: str
    offset: NonNegativeInt
    length: NonNegativeInt
    checksum: NotRequired[str]


class _PackMember(TypedDict):
    offset: NonNegativeInt
    checksum: str | None


class _Entry(TypedDict):
    """One key's entry (`tierstore.catalog._manifest_entry` writes them)."""

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
    [`ManifestError`][] naming ``where`` and each bad field."""
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
    back, when `Manifest._write` returns), created owner-only."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
    return os.open(path, flags, 0o600)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
