"""Directories private to one open backend instance inside a root that others may share.

Several stores, in one process or many, may use the same backend directory. Whatever a backend
instance creates for itself alone (recycled files, objects being written, a scratch store's
objects) goes into ``<root>/.<kind>-<id>``, so two instances never touch each other's files.

An instance marks its directory as live with an exclusive ``flock`` on ``.lock`` inside it, held
until `PrivateDirectory.remove` or until the process ends, however it ends: the kernel drops the
lock of a process killed with ``kill -9``. The directory gets its name only once its lock is held
(it is made as ``.<kind>-<id>.new`` and renamed), so a named directory always has a lock, held by a
live owner or free because the owner has ended (a process killed between the two steps leaves an
empty ``.new`` directory). The next backend opened on the root removes every private directory whose
lock it can take (`remove_abandoned`), and never one that is held. A regular file, not the
directory, carries the lock: NFS implements ``flock`` with POSIX locks, which need a file open for
writing.

A lock, not a pid file: a pid can be reused by an unrelated process after a crash (the garbage
would then never be collected) and means nothing across pid namespaces (containers) or hosts
sharing a file system, where a live owner's pid could look dead and its files be deleted. A
process forked without ``exec`` inherits the lock, so its directory stays until that child ends
too. Where the file system refuses ``flock``, a directory is never provably abandoned, so it is
left alone; where its locks are local to a node (Lustre's ``localflock``, NFS's
``local_lock=flock``), a store on another node would see a live directory as abandoned, so nodes
must not share a directory there.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

ID_HEX_DIGITS = 16
LOCK = ".lock"
_log = logging.getLogger("tierstore")


class PrivateDirectory:
    """``<root>/.<kind>-<id>``: created owner-only and locked while this instance is open.

    Args:
        root: the shared directory it is made in (a backend's root).
        kind: what it holds (``"spares"``, ``"writing"``, ``"scratch"``, ``"checkpoint"``), so that
            `remove_abandoned` collects each kind where a backend expects it.
    """

    def __init__(self, root: Path, kind: str) -> None:
        self.id = secrets.token_hex(ID_HEX_DIGITS // 2)
        """The directory's id: also names what its owner writes outside it (checkpoint objects)."""
        self.path = root / f".{kind}-{self.id}"
        staging = self.path.with_name(self.path.name + ".new")
        os.mkdir(staging, 0o700)
        self._fd = os.open(staging / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _lock(self._fd)  # nobody else knows the directory yet: taken, or no flock here
        os.rename(staging, self.path)

    def remove(self) -> None:
        """Delete the directory and everything in it, then drop the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)


def remove_abandoned(root: Path, kind: str) -> None:
    """Delete the ``kind`` private directories under ``root`` whose owners have ended."""
    for path in _directories(root, kind).values():
        try:
            fd = os.open(path / LOCK, os.O_RDWR)
        except FileNotFoundError:  # another opener removed it meanwhile
            continue
        try:
            if _lock(fd) and _still_at(fd, path / LOCK):
                shutil.rmtree(path, ignore_errors=True)
                _log.info("removed %s, left by a backend that ended without closing", path)
        finally:
            os.close(fd)


def owner_ids(root: Path, kind: str) -> set[str]:
    """The ids of the ``kind`` private directories under ``root``: after `remove_abandoned`, those
    of owners alive (or not provably ended: no ``flock``)."""
    return set(_directories(root, kind))


def _directories(root: Path, kind: str) -> dict[str, Path]:
    """The ``kind`` private directories under ``root`` by id."""
    pattern = re.compile(rf"\.{re.escape(kind)}-([0-9a-f]{{{ID_HEX_DIGITS}}})")
    with os.scandir(root) as entries:
        return {
            match.group(1): Path(entry.path)
            for entry in entries
            if (match := pattern.fullmatch(entry.name)) and entry.is_dir(follow_symlinks=False)
        }


def _lock(fd: int) -> bool | None:
    """Take the exclusive lock without waiting: True, False if someone holds it, None if the file
    system has no ``flock``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return True


def _still_at(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed by another collector)."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
