"""The backend contract: named, byte-addressed objects on one storage medium.

A backend knows nothing of tensors, tiers or caching. It stores objects (flat names, raw bytes)
and moves byte ranges between them and caller buffers. Its life cycle:

1. **open**: the constructor receives validated options ([`Backend.Options`][]), creates or checks
   its medium and raises [`UnwritablePathError`][] if it cannot write there. Use
   [`tierstore.backends.open_backend`][] to open one from a URL or dict.
2. **use**: [`write`][tierstore.backends.Backend.write] and
   [`read_into`][tierstore.backends.Backend.read_into] return futures and may be called from any
   thread, any number at once, for different objects. The caller keeps the buffer alive and
   unchanged until the future resolves. Concurrent writes to the *same* object are not supported
   (the store never issues them).
3. **close**: [`close`][tierstore.backends.Backend.close] waits for I/O in flight and releases
   resources; every call afterwards raises [`StoreClosedError`][].

Two backends of one store must not share a medium (their object names would clash): each reports
where its objects live ([`location`][tierstore.backends.Backend.location]) and the store refuses
equal ones. A scratch store asks its backends to keep its objects apart
([`claim_scratch`][tierstore.backends.Backend.claim_scratch]), so that they are removed even if the
process dies before deleting them.

Object semantics are those of a file: ``write`` creates the object if needed and grows it to
``max(size, offset + len(data))`` (a backend without ``partial_writes`` takes only whole-object
writes at offset 0, which replace the object); ``read_into`` fills the whole buffer or raises
[`OutOfRangeError`][]. Offsets must be multiples of [`Capabilities.alignment`][] (lengths need not
be: the backend handles a partial last block); buffers may have any address (a backend with direct
I/O bounces unaligned buffers through aligned ones, which costs a copy, so give it aligned buffers).
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import tempfile
from abc import abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, ByteSize, ValidationError

from .._checks import ConfigModel
from .._closeable import Closeable
from ..buffers import ALIGNMENT
from ..errors import (
    AlignmentError,
    BufferMismatchError,
    ConfigError,
    InvalidKeyError,
    OutOfRangeError,
    StoreClosedError,
    UnwritablePathError,
    config_error_from_validation,
)
from .private import PrivateDirectory, remove_abandoned

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
"""Valid object names: flat, portable file names that cannot escape a root directory."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the store plans its I/O around these, never around backend types."""

    alignment: int = 1
    """Offsets and lengths (except at an object's end) must be multiples of this."""
    chunk_bytes: int | None = None
    """Preferred size of one request; large transfers should be multiples of it."""
    partial_writes: bool = True
    """``write`` at an offset into an existing object is supported."""
    persistent: bool = False
    """Objects survive the process (False for memory backends)."""
    direct_io: bool = False
    """Transfers bypass the operating system's page cache."""


@dataclass(frozen=True)
class Location:
    """Where a backend keeps its objects: two backends with equal locations would read and write
    the same objects. ``identity`` decides equality; ``shown`` is for messages."""

    identity: tuple[str | int, ...]
    shown: str = field(compare=False)

    @classmethod
    def of_directory(cls, root: Path) -> Location:
        """A directory by device and inode, so aliases (``/d/./``, symlinks, bind mounts) match."""
        status = os.stat(root)
        return cls(("directory", status.st_dev, status.st_ino), str(root.resolve()))


def _page_multiple(value: ByteSize) -> ByteSize:
    if value < ALIGNMENT or value % ALIGNMENT:
        raise ValueError(f"must be a positive multiple of {ALIGNMENT}")
    return value


PageMultiple = Annotated[ByteSize, AfterValidator(_page_multiple)]
"""A byte size (``"4MiB"``) that is a positive multiple of the page size: chunk and slot sizes."""


def prepare_root(root: Path, scheme: str) -> Path:
    """Create a backend's root directory (owner-only) and prove it is writable.

    Args:
        root: the directory (``~`` expanded, made absolute).
        scheme: the backend's scheme, which error messages start with.

    Returns:
        The absolute root.

    Raises:
        UnwritablePathError: the directory cannot be created or written (a file stands in its
            way, permissions, a full or read-only file system); the message names the path.
    """
    root = root.expanduser().absolute()
    blocking = next((path for path in (root, *root.parents) if path.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise UnwritablePathError(
            errno.ENOTDIR,
            f"{scheme}: cannot use {root} as a directory: {blocking} is a file, not a directory",
        )
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # A unique name: backends opened at once on one root must not remove each other's probe.
        fd, probe = tempfile.mkstemp(prefix=".tierstore-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UnwritablePathError(
            error.errno, f"{scheme}: cannot write to {root}: {error.strerror}"
        ) from error
    return root


class BackendOptions(ConfigModel):
    """Base of every backend's options: the rules of every option model (unknown fields are errors,
    a bool is no number; see `ConfigModel`)."""


class Backend(Closeable):
    """Abstract base of all backends: named byte objects on one storage medium (the module
    docstring gives the life cycle and the object semantics).

    A subclass sets [`scheme`][] and [`Options`][], implements [`capabilities`][] and the
    underscored hooks (``_write``, ``_read_into``, ``_delete``, ``_exists``, ``_size``, ``_list``;
    ``_copy_from`` and ``_close`` where it has something to do), and overrides the optional public
    hooks that apply to its medium ([`options_from_url`][], [`location`][], [`claim_scratch`][],
    [`spare_bytes`][], [`release_spares`][]). The public methods check names, alignment, ranges and
    the closed state once, here, so every backend rejects bad input the same way and a hook only
    ever sees valid arguments on an open backend.

    Args:
        options: the backend's [`Options`][], already validated; open a backend with
            [`from_options`][] or [`open_backend`][], which validate a table's or a URL's fields
            first.

    Raises:
        UnwritablePathError: (from a subclass) the medium cannot be created or written.
        ConfigError: (from a subclass) options that are valid alone but not together, or not on
            this medium.
    """

    scheme: ClassVar[str]
    """URL scheme and registry name, e.g. ``"nvme"``."""
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    """The pydantic model of this backend's options (fields of a config table or URL query)."""

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self._closed = False

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, where: str = "backend") -> Backend:
        """Validate ``options`` against [`Options`][] and open the backend.

        Args:
            options: the option fields: a config table without its ``type``, or what
                [`options_from_url`][] makes of a URL.
            where: the options' place in a larger config document (``"tiers.0.backend"``), which
                error messages name so that the user finds the field.

        Returns:
            The open backend.

        Raises:
            ConfigError: a field is unknown, missing or invalid; each is named under ``where``.
            UnwritablePathError: the backend cannot write its medium.
        """
        try:
            validated = cls.Options.model_validate(dict(options))
        except ValidationError as error:
            raise config_error_from_validation(error, where) from None
        try:
            return cls(validated)
        except ConfigError as error:  # an option valid alone but not here: say where it came from
            raise ConfigError(f"{where}: {error}") from None

    @classmethod
    def options_from_url(cls, scheme: str, location: str, query: Mapping[str, str]) -> dict[str, Any]:
        """Map a URL ``scheme://location?query`` to option fields. By default ``location`` is the
        ``path`` field and the query gives the others.

        Args:
            scheme: the URL's whole scheme, e.g. ``zarr+s3`` for a backend registered as ``zarr``
                (the part after ``+`` may choose a protocol).
            location: the URL's host and path (``/data`` of ``nvme:///data``); empty if none.
            query: the query's fields, as strings ([`Options`][] converts them).

        Returns:
            The fields for [`from_options`][].
        """
        return {"path": location, **query} if location else dict(query)

    # -- capabilities -----------------------------------------------------------------------------
    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this instance can do. It may depend on the options and on the medium (``nvme``
        aligns to pages only where the file system takes O_DIRECT), but never changes while the
        backend is open: the store plans its I/O around it once."""

    # -- data path --------------------------------------------------------------------------------
    def write(self, name: str, offset: int, data: Any) -> Future[None]:
        """Write the bytes of ``data`` at ``offset`` of object ``name``, creating the object if
        needed and growing it to ``max(size, offset + len(data))``.

        Args:
            name: the object's name (`NAME_PATTERN`).
            offset: where in the object the bytes go: a multiple of [`Capabilities.alignment`][],
                and 0 on a backend without ``partial_writes``, whose writes replace the whole
                object.
            data: any buffer (``memoryview``, numpy array, ``bytes``...), written as raw bytes.
                The caller keeps it alive and unchanged until the future resolves, because the
                backend may copy from it on other threads until then.

        Returns:
            A future that resolves once the bytes are written (synced to the medium only where the
            backend's options say so), or raises [`BackendIOError`][] if the medium failed.

        Raises:
            InvalidKeyError: ``name`` is not a valid object name.
            AlignmentError: ``offset`` is negative or unaligned, or not 0 where only whole
                objects can be written.
            StoreClosedError: the backend is closed.
        """
        self._check_open()
        check_name(name)
        view = memoryview(data).cast("B")
        self._check_aligned(name, offset)
        if offset and not self.capabilities.partial_writes:
            raise AlignmentError(f"{self.scheme}: object {name!r} can only be written from offset 0")
        return self._write(name, offset, view)

    def read_into(self, name: str, offset: int, out: Any) -> Future[None]:
        """Fill ``out`` with the bytes of object ``name`` from ``offset`` on.

        Args:
            name: the object's name.
            offset: where in the object the read starts: a multiple of [`Capabilities.alignment`][].
            out: a writable buffer, whose length is the number of bytes read. The caller keeps
                it alive, and does not use it, until the future resolves.

        Returns:
            A future that resolves once ``out`` is filled, or raises [`BackendIOError`][] if the
            medium failed.

        Raises:
            KeyNotFoundError: there is no object ``name``.
            OutOfRangeError: ``[offset, offset + len(out))`` reaches past the object's end (a
                read never returns fewer bytes than asked for).
            BufferMismatchError: ``out`` is read-only.
            InvalidKeyError, AlignmentError, StoreClosedError: as [`write`][] raises them.
        """
        self._check_open()
        check_name(name)
        view = memoryview(out).cast("B")
        if view.readonly:
            raise BufferMismatchError("read_into needs a writable buffer")
        self._check_aligned(name, offset)
        size = self._size(name)
        if offset < 0 or offset + view.nbytes > size:
            raise OutOfRangeError(
                f"{self.scheme}: bytes [{offset}, {offset + view.nbytes}) are outside object "
                f"{name!r} of {size} bytes"
            )
        return self._read_into(name, offset, view)

    # -- metadata ---------------------------------------------------------------------------------
    def delete(self, name: str) -> None:
        """Remove object ``name``; it is gone from [`list`][] and [`exists`][] on return.

        Args:
            name: the object's name.

        Raises:
            KeyNotFoundError: there is no object ``name``.
            BackendIOError: the medium refused.
            InvalidKeyError, StoreClosedError: as [`write`][] raises them.
        """
        self._check_open()
        check_name(name)
        self._delete(name)

    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists.

        Args:
            name: the object's name.

        Raises:
            InvalidKeyError, StoreClosedError: as [`write`][] raises them.
        """
        self._check_open()
        check_name(name)
        return self._exists(name)

    def size(self, name: str) -> int:
        """The size in bytes of object ``name``.

        Args:
            name: the object's name.

        Raises:
            KeyNotFoundError: there is no object ``name``.
            InvalidKeyError, StoreClosedError: as [`write`][] raises them.
        """
        self._check_open()
        check_name(name)
        return self._size(name)

    def list(self) -> builtins.list[str]:
        """The names of all objects, sorted. A backend's own files (probes, private
        directories, recycled files) are never listed.

        Raises:
            StoreClosedError: the backend is closed.
        """
        self._check_open()
        return sorted(self._list())

    def copy_from(self, name: str, source: Backend, source_name: str) -> bool:
        """Make object ``name`` a copy of ``source``'s object ``source_name`` without the bytes
        passing through this process, where these two backends can (a hard link, a copy inside
        the kernel). It moves data that already sits on one tier to another (a checkpoint
        drained to the persistent tier) without reading it into memory and writing it again.
        Blocks until done.

        Args:
            name: the new object's name here; an existing object of that name is replaced.
            source: the backend holding the original (open; may be this one).
            source_name: the original's name in ``source``.

        Returns:
            True once the copy is made; False, having done nothing, where these two backends
            cannot copy this way (the caller then copies through memory).

        Raises:
            KeyNotFoundError: ``source`` has no object ``source_name`` (where the copy is
                possible at all).
            BackendIOError: the medium failed; no part of the copy is left.
            InvalidKeyError, StoreClosedError: for either backend, as [`write`][] raises them.
        """
        self._check_open()
        source._check_open()
        check_name(name)
        check_name(source_name)
        return self._copy_from(name, source, source_name)

    # -- space held for reuse ---------------------------------------------------------------------
    def spare_bytes(self) -> int:
        """Space the backend holds beyond its objects for reuse (``nvme``'s recycled files),
        which a tier with a capacity counts in it; 0 unless a backend overrides it.

        Returns:
            The bytes held.
        """
        return 0

    def release_spares(self, nbytes: int | None = None) -> int:
        """Give back [`spare_bytes`][] to the medium, so that objects can have the space.

        Args:
            nbytes: give back at least this many bytes if held; None gives back all of them.

        Returns:
            The bytes freed (0 unless a backend overrides it).
        """
        return 0

    # -- sharing a medium -------------------------------------------------------------------------
    def location(self) -> Location | None:
        """Where this backend's objects live, so that a store can refuse two paths on one medium
        (their object names would clash). Persistent backends override this.

        Returns:
            The location, or None where the objects are private to this instance (memory).
        """
        return None

    def claim_scratch(self) -> None:
        """Keep the objects written from now on apart from everyone else's, for a scratch store.

        A backend on a shared medium puts them in a directory private to this instance, removed at
        [`close`][] or, if the process dies first, by the next backend opened on the same medium
        (`tierstore.backends.private`). Memory backends keep this default, which does nothing: their
        objects end with the process. Call it before writing the first object.

        Raises:
            StoreClosedError: (from a backend that overrides it) the backend is closed.
        """

    # -- life cycle -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether [`close`][] has been called."""
        return self._closed

    def close(self) -> None:
        """Wait for the I/O in flight and release the backend's resources (threads, processes,
        private directories). Idempotent; every other method raises [`StoreClosedError`][]
        afterwards."""
        if not self._closed:
            self._closed = True
            self._close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"

    # -- hooks for subclasses -----------------------------------------------------------------------
    @abstractmethod
    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        """Start the write [`write`][] describes; called only on an open backend, after its checks.

        Args:
            name: a valid object name.
            offset: non-negative and aligned; 0 where ``partial_writes`` is False.
            data: the bytes, a 1-D ``memoryview`` of format ``"B"``, valid until the future
                resolves.

        Returns:
            A future that resolves once the bytes are written, or raises [`BackendIOError`][].
        """

    @abstractmethod
    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        """Start the read [`read_into`][] describes; called only on an open backend, after its
        checks.

        Args:
            name: the name of an object that existed at the check.
            offset: non-negative and aligned, with ``offset + len(out)`` within the object.
            out: a writable 1-D ``memoryview`` of format ``"B"`` to fill completely.

        Returns:
            A future that resolves once ``out`` is filled, or raises [`BackendIOError`][].

        Raises:
            KeyNotFoundError: the object was deleted since the check (here or through the
                future).
        """

    @abstractmethod
    def _delete(self, name: str) -> None:
        """Remove the object, as [`delete`][] describes.

        Args:
            name: a valid object name.

        Raises:
            KeyNotFoundError: there is no such object.
        """

    @abstractmethod
    def _exists(self, name: str) -> bool:
        """Whether the object exists.

        Args:
            name: a valid object name.
        """

    @abstractmethod
    def _size(self, name: str) -> int:
        """The object's size in bytes (also called by [`read_into`][] to check its range).

        Args:
            name: a valid object name.

        Raises:
            KeyNotFoundError: there is no such object.
        """

    @abstractmethod
    def _list(self) -> builtins.list[str]:
        """The names of all objects, in any order ([`list`][] sorts them); only names that
        `check_name` accepts, never the backend's own files."""

    def _copy_from(self, name: str, source: Backend, source_name: str) -> bool:
        """Make the copy [`copy_from`][] describes, or return False; backends that can copy without
        this process's memory override this default, which cannot.

        Args:
            name: a valid object name here.
            source: an open backend, of any type.
            source_name: a valid object name in ``source``.

        Returns:
            True once the copy is made; False, having changed nothing, where it cannot be made.

        Raises:
            KeyNotFoundError: ``source`` has no object ``source_name``.
        """
        return False

    def _close(self) -> None:
        """Wait for the I/O in flight and release resources; called once, by [`close`][]. Backends
        without resources keep this default, which does nothing."""

    # -- checks -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.scheme} backend is closed")

    def _check_aligned(self, name: str, offset: int) -> None:
        alignment = self.capabilities.alignment
        if offset < 0 or offset % alignment:
            raise AlignmentError(
                f"{self.scheme}: offset {offset} into {name!r} is not a non-negative multiple "
                f"of the backend's alignment ({alignment})"
            )


def check_name(name: str) -> None:
    """Raise [`InvalidKeyError`][] unless ``name`` is a valid object name."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidKeyError(
            f"invalid object name {name!r}: use 1-200 characters from [A-Za-z0-9._-], "
            "not starting with '.' or '-'"
        )


class DirectoryOptions(BackendOptions):
    """Options of a backend that keeps its objects as files under one local directory."""

    path: Path
    """Root directory of the objects; created (owner-only) if missing."""


class DirectoryBackend(Backend):
    """A backend whose objects are files under one local directory, which other backend instances
    may share: what an instance creates for itself alone goes into private directories (`private`),
    and those of instances that ended without closing are collected at open.

    Args:
        options: a `DirectoryOptions` (or a subclass's); its ``path`` is created owner-only if
            missing.

    Raises:
        UnwritablePathError: ``path`` cannot be created or written.
    """

    PRIVATE_KINDS: ClassVar[tuple[str, ...]] = ("scratch",)
    """The private directories this backend makes (collected at open when abandoned)."""

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert isinstance(options, DirectoryOptions)
        self.root = prepare_root(options.path, self.scheme)
        self._location = Location.of_directory(self.root)
        for kind in self.PRIVATE_KINDS:
            remove_abandoned(self.root, kind)
        self._scratch: PrivateDirectory | None = None

    def location(self) -> Location:
        """Implements [`Backend.location`][]: the directory, by device and inode."""
        return self._location

    def claim_scratch(self) -> None:
        """Implements [`Backend.claim_scratch`][]: a private ``.scratch-<id>/`` directory."""
        self._check_open()
        if self._scratch is None:
            self._scratch = PrivateDirectory(self.root, "scratch")
            self.root = self._scratch.path

    def _remove_scratch(self) -> None:
        """At close: a scratch store's objects go with their directory."""
        if self._scratch is not None:
            self._scratch.remove()
