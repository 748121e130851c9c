"""Typed exceptions raised by tierstore.

Every error the library raises on purpose derives from [`TierStoreError`][], and each also derives
from the builtin a caller would naturally catch (``KeyError``, ``ValueError``, ``OSError``...), so
``except KeyError`` keeps working for code that does not know tierstore.
"""

from __future__ import annotations


class TierStoreError(Exception):
    """Base class of every error raised by tierstore."""


class KeyNotFoundError(TierStoreError, KeyError):
    """The key (or backend object name) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "key not found"


class InvalidKeyError(TierStoreError, ValueError):
    """A key or backend object name is malformed (empty, too long, escapes the root...)."""


class BufferMismatchError(TierStoreError, ValueError):
    """A caller's buffer has the wrong size, dtype, shape or memory layout for the object."""


class OutOfRangeError(TierStoreError, ValueError):
    """A byte range reaches past the end of a stored object."""


class AlignmentError(TierStoreError, ValueError):
    """An offset or length violates the backend's declared alignment."""


class StoreClosedError(TierStoreError, RuntimeError):
    """The store, the backend or the workload (an offloaded optimizer) has been closed."""


class ConfigError(TierStoreError, ValueError):
    """A configuration document or backend URL is invalid; the message names the field."""


class CapacityError(TierStoreError, MemoryError):
    """An object does not fit in a buffer pool, DRAM budget or tier capacity."""


class PinnedMemoryError(CapacityError):
    """Host memory for copies to a device could not be page-locked (``cudaHostRegister`` failed);
    the message names the size and the limits that bound it (``ulimit -l``,
    ``vm.max_map_count``)."""


class BandwidthUnknownError(TierStoreError, LookupError):
    """No bandwidth estimate exists yet for the paths a plan needs: none was configured or probed,
    and too little traffic has been measured."""


class BackendIOError(TierStoreError, OSError):
    """A backend failed to read or write its medium."""


class UnwritablePathError(BackendIOError):
    """A backend's root path cannot be created or written."""


def validation_problems(error: Exception, where: str) -> str:
    """Each bad field of a pydantic ``ValidationError`` with its problem, located under ``where``
    (a dotted path; empty for the document itself)."""
    problems = []
    for item in getattr(error, "errors", lambda: [])():
        field = ".".join(str(part) for part in item.get("loc", ()))
        location = ".".join(part for part in (where, field) if part)
        problems.append(f"{location}: {item.get('msg', 'invalid')}")
    return "; ".join(problems) or f"{where}: {error}"


def config_error_from_validation(error: Exception, where: str) -> ConfigError:
    """Turn a pydantic ``ValidationError`` into a [`ConfigError`][] naming each bad field."""
    return ConfigError("invalid configuration: " + validation_problems(error, where))


class UnsupportedVersionError(TierStoreError, RuntimeError):
    """An integration's host library (e.g. DeepSpeed) is a version tierstore does not support."""


class ChecksumError(BackendIOError):
    """Bytes read back from a tier do not match the checksum recorded when they were written."""


class MissingDataError(BackendIOError):
    """A committed object's bytes are gone from their medium (a deleted file or directory).

    Data loss, not an unknown key: ``except KeyError`` must never swallow it, so it is an
    ``OSError`` (``ENOENT``) naming the key, the tier path and the backend object."""


class ManifestError(BackendIOError):
    """A persistent store's manifest is damaged: a snapshot or journal line that is not what the
    store wrote (the message names the file and line), or a key's entry that does not fit its
    object, e.g. a shape needing more bytes than are stored (the message names the key)."""


class NamespaceInUseError(TierStoreError, ValueError):
    """A workload claimed a namespace (key prefix) that another workload on the same store holds."""


class StoreLockedError(TierStoreError, RuntimeError):
    """The persistent store's manifest is already open in another process (or store object)."""


class ReadOnlyStoreError(TierStoreError, PermissionError):
    """A change (put, delete, being the destination of a copy) asked of a store opened read-only
    (``TierStore(..., read_only=True)``); the message names the manifest directory."""


class CheckpointNotFoundError(KeyNotFoundError):
    """No tier holds a committed checkpoint of that id (never saved, interrupted before its commit,
    or deleted by retention); the message names the id, the tiers searched and what they hold."""
