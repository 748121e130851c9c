"""The backend contract: named, byte-addressed objects on one storage medium.

A backend knows nothing of tensors, tiers or caching. It stores objects (flat names, raw bytes)
and moves byte ranges between them and caller buffers. Its life cycle:

1. **open**: the constructor receives validated options (:attr:`Backend.Options`), creates or
   checks its medium and raises :class:`~tierstore.errors.UnwritablePathError` if it cannot
   write there. Use :func:`tierstore.backends.open_backend` to open one from a URL or dict.
2. **use**: :meth:`~Backend.write` and :meth:`~Backend.read_into` return futures and may be
   called from any thread, any number at once, for different objects. The caller keeps the buffer
   alive and unchanged until the future resolves. Concurrent writes to the *same* object are not
   supported (the store never issues them).
3. **close**: :meth:`~Backend.close` waits for I/O in flight and releases resources; every call
   afterwards raises :class:`~tierstore.errors.StoreClosedError`.

Two backends of one store must not share a medium (their object names would clash): each reports
where its objects live (:meth:`~Backend.location`) and the store refuses equal ones. A scratch
store asks its backends to keep its objects apart (:meth:`~Backend.claim_scratch`), so that they
are removed even if the process dies before deleting them.

Object semantics are those of a file: ``write`` creates the object if needed and grows it to
``max(size, offset + len(data))`` (a backend without ``partial_writes`` takes only whole-object
writes at offset 0, which replace the object); ``read_into`` fills the whole buffer or raises
:class:`~tierstore.errors.OutOfRangeError`. Offsets must be multiples of
:attr:`Capabilities.alignment` (lengths need not be: the backend handles a partial last block);
buffers may have any address (a backend with direct I/O bounces unaligned buffers through aligned
ones, which costs a copy, so give it aligned buffers).
"""

from __future__ import annotations

import builtins
import errno
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from ..buffers import ALIGNMENT
from ..config import refuse_bool_as_number
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

    Raises :class:`~tierstore.errors.UnwritablePathError` naming the path otherwise."""
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


class BackendOptions(BaseModel):
    """Base of every backend's options; unknown fields are errors, and so is a bool for a number."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        return refuse_bool_as_number(cls, value, info)


class Backend(ABC):
    """Abstract base of all backends (see the module docstring for the life cycle).

    Subclasses implement the underscored hooks; the public methods check names, alignment,
    ranges and the closed state once, here, so every backend rejects bad input the same way.
    """

    scheme: ClassVar[str]
    """URL scheme and registry name, e.g. ``"nvme"``."""
    Options: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self._closed = False

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, where: str = "backend") -> Backend:
        """Validate ``options`` against :attr:`Options` and open the backend."""
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
        """Map a URL (``scheme://location?query``) to option fields.

        ``scheme`` is the whole scheme, e.g. ``zarr+s3`` for a backend registered as ``zarr``.
        """
        return {"path": location, **query} if location else dict(query)

    # -- capabilities -----------------------------------------------------------------------------
    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """This instance's capabilities (they may depend on options and on the medium)."""

    # -- data path --------------------------------------------------------------------------------
    def write(self, name: str, offset: int, data: Any) -> Future[None]:
        """Write the bytes of ``data`` (any buffer) at ``offset`` of object ``name``."""
        self._check_open()
        check_name(name)
        view = memoryview(data).cast("B")
        self._check_aligned(name, offset)
        if offset and not self.capabilities.partial_writes:
            raise AlignmentError(f"{self.scheme}: object {name!r} can only be written from offset 0")
        return self._write(name, offset, view)

    def read_into(self, name: str, offset: int, out: Any) -> Future[None]:
        """Fill the writable buffer ``out`` with the object's bytes starting at ``offset``."""
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
        """Remove an object; raises :class:`~tierstore.errors.KeyNotFoundError` if absent."""
        self._check_open()
        check_name(name)
        self._delete(name)

    def exists(self, name: str) -> bool:
        self._check_open()
        check_name(name)
        return self._exists(name)

    def size(self, name: str) -> int:
        """Size in bytes; raises :class:`~tierstore.errors.KeyNotFoundError` if absent."""
        self._check_open()
        check_name(name)
        return self._size(name)

    def list(self) -> builtins.list[str]:
        """Names of all objects, sorted."""
        self._check_open()
        return sorted(self._list())

    def copy_from(self, name: str, source: Backend, source_name: str) -> bool:
        """Make object ``name`` (replaced if it exists) a copy of ``source``'s object
        ``source_name`` without the bytes passing through this process, and return True; or do
        nothing and return False where these two backends cannot (the caller then copies through
        memory). Blocks until done. Raises :class:`~tierstore.errors.KeyNotFoundError` if the
        source object is absent (where the copy is possible at all).

        For moving data that already sits on one tier to another (a checkpoint drained to the
        persistent tier) without reading it into memory and writing it out again."""
        self._check_open()
        source._check_open()
        check_name(name)
        check_name(source_name)
        return self._copy_from(name, source, source_name)

    # -- space held for reuse ---------------------------------------------------------------------
    def spare_bytes(self) -> int:
        """Space the backend holds beyond its objects for reuse (nvme's recycled files), which a
        tier with a capacity counts in it; none by default."""
        return 0

    def release_spares(self, nbytes: int | None = None) -> int:
        """Give back at least ``nbytes`` of :meth:`spare_bytes` if it holds them (None: all of it);
        returns the bytes freed."""
        return 0

    # -- sharing a medium -------------------------------------------------------------------------
    def location(self) -> Location | None:
        """Where this backend's objects live; None if they are private to this instance (memory).

        Persistent backends override this: a store refuses two paths with the same location."""
        return None

    def claim_scratch(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Keep the objects written from now on apart from everyone else's, for a scratch store.

        A backend on a shared medium puts them in a directory private to this instance, removed
        at :meth:`close` or, if the process dies first, by the next backend opened on the same
        medium (:mod:`tierstore.backends.private`). Memory backends need nothing: their objects
        end with the process. Call it before writing the first object.
        """

    # -- life cycle -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for I/O in flight, release resources. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"

    # -- hooks for subclasses -----------------------------------------------------------------------
    @abstractmethod
    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]: ...

    @abstractmethod
    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]: ...

    @abstractmethod
    def _delete(self, name: str) -> None: ...

    @abstractmethod
    def _exists(self, name: str) -> bool: ...

    @abstractmethod
    def _size(self, name: str) -> int: ...

    @abstractmethod
    def _list(self) -> builtins.list[str]: ...

    def _copy_from(self, name: str, source: Backend, source_name: str) -> bool:
        """Backends that can copy without this process's memory override this (see
        :meth:`copy_from`); by default they cannot."""
        return False

    def _close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources; called once. Backends without resources keep this default."""

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
    """Raise :class:`~tierstore.errors.InvalidKeyError` unless ``name`` is a valid object name."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidKeyError(
            f"invalid object name {name!r}: use 1-200 characters from [A-Za-z0-9._-], "
            "not starting with '.' or '-'"
        )


class DirectoryOptions(BackendOptions):
    path: Path
    """Root directory of the objects; created (owner-only) if missing."""


class DirectoryBackend(Backend):
    """A backend whose objects are files under one local directory, which other backend
    instances may share: what an instance creates for itself alone goes into private directories
    (:mod:`.private`), and those of instances that ended without closing are collected at open."""

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
        return self._location

    def claim_scratch(self) -> None:
        """Objects written from now on go to a private ``.scratch-<id>/`` directory."""
        self._check_open()
        if self._scratch is None:
            self._scratch = PrivateDirectory(self.root, "scratch")
            self.root = self._scratch.path

    def _remove_scratch(self) -> None:
        """At close: a scratch store's objects go with their directory."""
        if self._scratch is not None:
            self._scratch.remove()
