"""``nvme:///path``: objects as files on a local (NVMe) file system, read and written with O_DIRECT.

**On-disk layout.** ``<path>/<name>`` holds exactly the object's bytes, nothing else: no header,
no padding (the file size *is* the object size), so any tool can read an object back. O_DIRECT
needs aligned offsets and lengths, so a write whose end is not block-aligned writes its last
block padded (after reading back the block's existing bytes if the object extends past it) and
then truncates the file to the true size. Files and the directory are created owner-only.
Dot-entries (``.tierstore-probe-*``, ``.spares-*``, ``.scratch-*``) are never objects.

**Recycling.** With O_DIRECT, a deleted file is renamed aside (up to ``recycle`` of them) instead of
unlinked, and the next new object of exactly its size is written into it. A store writes every
version of an object under a new name and deletes the old one, so an optimizer that rewrites its
state each step would otherwise make ext4 allocate fresh blocks, and convert them from unwritten to
written, on every write, and free the old blocks with an unlink; overwriting blocks already written
skips all three (unlinking a file of 100 MB can take over a second, and stalls the writes beside it
on ext4's journal). When all ``recycle`` places are taken, the oldest spare is unlinked to make
room: sizes an application stopped writing (DeepSpeed's master weights written alone at start,
before the moments exist) must not hold every place forever. Spares never cost a write its space: a
write that finds the file system full (ENOSPC) gives every spare back and tries again, and a tier
with a ``capacity`` counts them in it, giving back as many as its objects need (`spare_bytes`,
`release_spares`). Spares live in ``<path>/.spares-<id>/``, private to this backend instance
(another store on the same directory has its own), and are removed at ``close()``; after a crash, by
the next backend opened on the directory (`tierstore.backends.private`). A file with another name
linked to it ([`copy_from`][tierstore.backends.Backend.copy_from]) is never recycled: its blocks are
that other object's too.

**Copies** between two nvme backends ([`copy_from`][tierstore.backends.Backend.copy_from]) hard-link
the file where both directories are on one file system (no byte moves), and otherwise copy it inside
the kernel (``sendfile``), never through the process's memory.

**Scratch stores** (`claim_scratch`) keep their objects in ``<path>/.scratch-<id>/``, removed the
same way.

**I/O engine.** A thread pool of ``queue_depth`` workers issues ``os.preadv``/``os.pwritev``
(which release the GIL) in ``chunk_bytes`` pieces; O_DIRECT needs several requests in flight to
reach the device's bandwidth, and a pool of threads reaches what fio does with libaio (the
io_uring/libaio Python wrappers add nothing to it), so no native extension is used. Buffers
whose address is not 4 KiB-aligned are bounced through per-worker aligned buffers.

Where the file system refuses O_DIRECT (EINVAL at open, e.g. some network or overlay file
systems), ``direct=None`` (the default) falls back to buffered I/O with a warning and
``direct=True`` raises. On a full file system the probe's one-block write fails with ENOSPC; the
file system took the O_DIRECT open, so O_DIRECT is used, and the backend opens to serve reads.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from pydantic import ByteSize, Field

from .._futures import when_all
from ..buffers import ALIGNMENT, AlignedBuffer, buffer_address, round_up
from ..errors import BackendIOError, ConfigError, KeyNotFoundError, UnwritablePathError
from .base import Backend, BackendOptions, Capabilities, DirectoryBackend, DirectoryOptions, PageMultiple
from .private import PrivateDirectory

O_DIRECT = getattr(os, "O_DIRECT", 0)
_log = logging.getLogger("tierstore")


class NvmeOptions(DirectoryOptions):
    """Options of ``nvme://`` (``path`` is the objects' directory)."""

    queue_depth: int = Field(16, ge=1, le=256)
    """Requests in flight at once (worker threads). O_DIRECT needs 4 or more to keep an NVMe
    device busy; 16 is where fio's O_DIRECT bandwidth on a local NVMe disk levels off."""
    chunk_bytes: PageMultiple = Field(ByteSize(4 << 20))
    """Size of one request; a multiple of 4096."""
    direct: bool | None = None
    """O_DIRECT: None = where the file system accepts it, True = required, False = never."""
    sync: bool = False
    """fdatasync each object write before its future resolves (durable, slower)."""
    recycle: int = Field(16, ge=0, le=4096)
    """Deleted files kept aside for new objects of the same size to overwrite (O_DIRECT only);
    0 unlinks at once. Bounds the extra disk space to this many deleted objects."""


class NvmeBackend(DirectoryBackend):
    """Files under one directory, transferred by a thread pool with O_DIRECT (the module
    docstring gives the layout, recycling and copies).

    Args:
        options: an `NvmeOptions`.

    Raises:
        UnwritablePathError: the directory cannot be created or written.
        ConfigError: ``direct=True`` on a file system that refuses O_DIRECT.
    """

    scheme = "nvme"
    Options = NvmeOptions
    options: NvmeOptions
    PRIVATE_KINDS = ("spares", "scratch")

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert isinstance(options, NvmeOptions)
        self._chunk = int(options.chunk_bytes)
        try:
            self.direct = self._probe_direct(options.direct)
        except OSError as error:
            raise UnwritablePathError(
                error.errno, f"nvme: cannot write to {self.root}: {error.strerror}"
            ) from error
        self._open_flags = O_DIRECT if self.direct else 0
        self._pool = ThreadPoolExecutor(options.queue_depth, thread_name_prefix="tierstore-nvme")
        self._bounce: list[AlignedBuffer] = []
        self._bounce_lock = threading.Lock()
        self._spares: dict[Path, int] = {}
        """Files renamed aside by delete -> their size, oldest first."""
        self._spare_names = itertools.count()
        self._spare_lock = threading.Lock()
        self._spare_directory: PrivateDirectory | None = None  # made with the first spare

    @property
    def capabilities(self) -> Capabilities:
        """Implements [`Backend.capabilities`][]: page-aligned, direct I/O where O_DIRECT is
        used."""
        return Capabilities(
            alignment=ALIGNMENT if self.direct else 1,
            chunk_bytes=self._chunk,
            partial_writes=True,
            persistent=True,
            direct_io=self.direct,
        )

    def _probe_direct(self, wanted: bool | None) -> bool:
        """Open, write and read back one block with O_DIRECT; decide whether to use it."""
        fd, name = tempfile.mkstemp(prefix=".tierstore-probe-", dir=self.root)  # unique per opener
        os.close(fd)
        probe = Path(name)
        try:
            if wanted is False:
                return False
            block = AlignedBuffer(ALIGNMENT)
            try:
                fd = os.open(probe, os.O_RDWR | O_DIRECT)
                try:
                    os.pwritev(fd, [block.memoryview(ALIGNMENT)], 0)
                    os.preadv(fd, [block.memoryview(ALIGNMENT)], 0)
                finally:
                    os.close(fd)
            except OSError as error:
                if error.errno in (errno.ENOSPC, errno.EDQUOT):  # full: the open took O_DIRECT
                    _log.warning("nvme: %s is full: writes fail until space is freed", self.root)
                    return True
                if error.errno != errno.EINVAL or not O_DIRECT:
                    raise
                if wanted:
                    raise ConfigError(f"nvme: {self.root} refuses O_DIRECT but direct=True") from None
                warnings.warn(
                    f"nvme: {self.root} refuses O_DIRECT; using buffered I/O (page cache)",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return False
            return True
        finally:
            probe.unlink(missing_ok=True)

    # -- data path --------------------------------------------------------------------------------
    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        """Implements `Backend._write`: a new object written from 0 takes a spare of its size."""
        path = self.root / name
        end = offset + data.nbytes
        if offset == 0:
            self._adopt_spare(path, end)
        try:
            fd = self._open(path, os.O_RDWR | os.O_CREAT)  # RDWR: a partial last block is read back
        except KeyNotFoundError:  # O_CREAT failing with ENOENT: the directory itself is gone
            raise BackendIOError(
                errno.ENOENT, f"nvme: cannot create {path}: {self.root} has vanished"
            ) from None
        size_before = os.fstat(fd).st_size
        if self.direct and end > size_before:
            self._preallocate(fd, path, size_before, end)
        tasks = [
            self._pool.submit(self._write_chunk, fd, offset + start, data[start:stop], size_before)
            for start, stop in self._chunks(data.nbytes)
        ]

        def finish() -> None:
            try:
                if all(task.exception() is None for task in tasks):
                    true_size = max(size_before, end)
                    if os.fstat(fd).st_size > true_size:  # a padded last block went past the end
                        os.ftruncate(fd, true_size)
                    if self.options.sync:
                        os.fdatasync(fd)
            except OSError as error:
                raise _io_error(error, f"finishing {path}") from error
            finally:
                os.close(fd)

        return when_all(tasks, finish)

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        """Implements `Backend._read_into`."""
        fd = self._open(self.root / name, os.O_RDONLY)
        tasks = [
            self._pool.submit(self._read_chunk, fd, offset + start, out[start:stop])
            for start, stop in self._chunks(out.nbytes)
        ]
        return when_all(tasks, lambda: os.close(fd))

    def _adopt_spare(self, path: Path, size: int) -> None:
        """Give a new object of ``size`` bytes the blocks of a deleted one of the same size."""
        with self._spare_lock:
            spare = next((p for p, n in reversed(self._spares.items()) if n == size), None)
            if spare is None or path.exists():
                return
            del self._spares[spare]
            try:
                os.rename(spare, path)
            except OSError:  # gone behind our back: write a fresh file instead
                spare.unlink(missing_ok=True)

    def _preallocate(self, fd: int, path: Path, start: int, end: int) -> None:
        """Allocate the blocks a growing write will fill, so the write does not extend the file.

        ext4 serialises O_DIRECT writes past the end of file, and runs those within it in
        parallel, so the chunks of one write proceed at once. Only used with O_DIRECT, i.e. on
        local file systems.
        """
        try:
            try:
                os.posix_fallocate(fd, start, round_up(end) - start)
            except OSError as error:  # full: the spares' space goes before the write does
                if error.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.release_spares():
                    raise
                os.posix_fallocate(fd, start, round_up(end) - start)
        except OSError as error:
            os.close(fd)
            raise _io_error(error, f"allocating {end - start} bytes for {path}") from error

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        return [(start, min(start + self._chunk, nbytes)) for start in range(0, nbytes, self._chunk)]

    def _write_chunk(self, fd: int, offset: int, data: memoryview, size_before: int) -> None:
        """Write one chunk (on a worker thread); with O_DIRECT, a partial last block is padded,
        with the object's bytes after it read back first where there are any."""
        with _io_errors(f"writing {data.nbytes} bytes at offset {offset}"):
            if not self.direct:
                _pwrite_all(fd, data, offset)
                return
            with self._bounce_buffer() as bounce:
                tail = self._direct_head(fd, offset, data, bounce, write=True)
                if tail:
                    block = bounce.memoryview(ALIGNMENT)
                    block_offset = offset + data.nbytes - tail
                    if block_offset + tail < size_before:  # keep the object's bytes after ours
                        os.preadv(fd, [block], block_offset)
                    else:
                        np.frombuffer(block, np.uint8)[tail:] = 0
                    _copy(block[:tail], data[-tail:])
                    _pwrite_all(fd, block, block_offset)

    def _read_chunk(self, fd: int, offset: int, out: memoryview) -> None:
        """Read one chunk (on a worker thread); with O_DIRECT, a partial last block is read whole
        into a bounce buffer and its head copied out."""
        with _io_errors(f"reading {out.nbytes} bytes at offset {offset}"):
            if not self.direct:
                _pread_all(fd, out, offset)
                return
            with self._bounce_buffer() as bounce:
                tail = self._direct_head(fd, offset, out, bounce, write=False)
                if tail:
                    block = bounce.memoryview(ALIGNMENT)
                    got = os.preadv(fd, [block], offset + out.nbytes - tail)  # short at end of file
                    if got < tail:
                        raise BackendIOError(errno.EIO, f"nvme: file ended {tail - got} bytes early")
                    _copy(out[-tail:], block[:tail])

    @staticmethod
    def _direct_head(fd: int, offset: int, data: memoryview, bounce: AlignedBuffer, *, write: bool) -> int:
        """Transfer the whole aligned blocks of ``data`` with O_DIRECT (through ``bounce`` when
        ``data`` itself is not aligned); return the length of the partial last block left over,
        which reads and writes finish differently."""
        head = data.nbytes - data.nbytes % ALIGNMENT
        if head:
            aligned = buffer_address(data) % ALIGNMENT == 0
            staged = data[:head] if aligned else bounce.memoryview(head)
            if write:
                if not aligned:
                    _copy(staged, data[:head])
                _pwrite_all(fd, staged, offset)
            else:
                _pread_all(fd, staged, offset)
                if not aligned:
                    _copy(data[:head], staged)
        return data.nbytes - head

    def _open(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags | self._open_flags, 0o600)
        except FileNotFoundError:
            raise KeyNotFoundError(f"nvme: no object {path.name!r} in {self.root}") from None
        except OSError as error:
            raise _io_error(error, f"opening {path}") from error

    @contextmanager
    def _bounce_buffer(self) -> Iterator[AlignedBuffer]:
        """Lend an aligned chunk-sized buffer; at most one per worker thread is ever made."""
        with self._bounce_lock:
            buffer = self._bounce.pop() if self._bounce else AlignedBuffer(self._chunk)
        try:
            yield buffer
        finally:
            with self._bounce_lock:
                self._bounce.append(buffer)

    # -- recycled files -----------------------------------------------------------------------------
    def spare_bytes(self) -> int:
        """Implements [`Backend.spare_bytes`][]: the size of the deleted files kept for reuse."""
        with self._spare_lock:
            return sum(self._spares.values())

    def release_spares(self, nbytes: int | None = None) -> int:
        """Implements [`Backend.release_spares`][]: unlinks spares, oldest first."""
        freed, doomed = 0, []
        with self._spare_lock:
            while self._spares and (nbytes is None or freed < nbytes):
                spare = next(iter(self._spares))
                freed += self._spares.pop(spare)
                doomed.append(spare)
        for spare in doomed:  # outside the lock: an unlink of a large file can take a while
            spare.unlink(missing_ok=True)
        return freed

    # -- metadata ---------------------------------------------------------------------------------
    def _delete(self, name: str) -> None:
        """Implements `Backend._delete`: with O_DIRECT, the file is kept aside as a spare."""
        path = self.root / name
        try:
            if not (self.direct and self.options.recycle):
                os.unlink(path)
                return
            status = os.stat(path)
            if status.st_nlink > 1:  # linked under another name: its blocks are not ours to reuse
                os.unlink(path)
                return
            size = status.st_size
            with self._spare_lock:
                if self._spare_directory is None:
                    self._spare_directory = PrivateDirectory(self.root, "spares")
                spare = self._spare_directory.path / str(next(self._spare_names))
                os.rename(path, spare)
                self._spares[spare] = size
                evicted = next(iter(self._spares)) if len(self._spares) > self.options.recycle else None
                if evicted is not None:
                    del self._spares[evicted]
            if evicted is not None:
                evicted.unlink(missing_ok=True)
        except FileNotFoundError:
            raise KeyNotFoundError(f"nvme: no object {name!r} in {self.root}") from None

    def _copy_from(self, name: str, source: Backend, source_name: str) -> bool:
        """Implements `Backend._copy_from` from another nvme backend (its objects are plain files
        too): a hard link on one file system, else ``sendfile`` into an owner-only file."""
        if not isinstance(source, NvmeBackend):
            return False
        origin, target = source.root / source_name, self.root / name
        if not origin.is_file():
            raise KeyNotFoundError(f"nvme: no object {source_name!r} in {source.root}")
        target.unlink(missing_ok=True)
        try:
            os.link(origin, target)
            return True
        except FileNotFoundError:
            raise KeyNotFoundError(f"nvme: no object {source_name!r} in {source.root}") from None
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                raise _io_error(error, f"linking {origin} as {target}") from error
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # owner-only first
            shutil.copyfile(origin, target)
            if self.options.sync:
                fd = os.open(target, os.O_RDONLY)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
        except OSError as error:
            target.unlink(missing_ok=True)
            if isinstance(error, FileNotFoundError):
                raise KeyNotFoundError(f"nvme: no object {source_name!r} in {source.root}") from None
            raise _io_error(error, f"copying {origin} to {target}") from error
        return True

    def _exists(self, name: str) -> bool:
        """Implements `Backend._exists`."""
        return (self.root / name).is_file()

    def _size(self, name: str) -> int:
        """Implements `Backend._size`: the file's size."""
        try:
            return os.stat(self.root / name).st_size
        except FileNotFoundError:
            raise KeyNotFoundError(f"nvme: no object {name!r} in {self.root}") from None

    def _list(self) -> list[str]:
        """Implements `Backend._list`: every file whose name does not start with a dot."""
        return [entry.name for entry in os.scandir(self.root) if not entry.name.startswith(".")]

    def _close(self) -> None:
        """Implements `Backend._close`: spares and a scratch store's objects are removed."""
        self._pool.shutdown(wait=True)
        with self._spare_lock:
            self._spares.clear()
            if self._spare_directory is not None:
                self._spare_directory.remove()
        self._remove_scratch()
        with self._bounce_lock:
            for buffer in self._bounce:
                buffer.free()
            self._bounce.clear()


def _copy(destination: memoryview, source: memoryview) -> None:
    """memcpy through numpy, which releases the GIL for large copies."""
    np.copyto(np.frombuffer(destination, np.uint8), np.frombuffer(source, np.uint8))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwritev(fd, [data], offset)
        if written <= 0:
            raise BackendIOError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
        data, offset = data[written:], offset + written


def _pread_all(fd: int, out: memoryview, offset: int) -> None:
    while out.nbytes:
        got = os.preadv(fd, [out], offset)
        if got <= 0:
            raise BackendIOError(errno.EIO, f"file ended early at offset {offset}")
        out, offset = out[got:], offset + got


def _io_error(error: OSError, doing: str) -> BackendIOError:
    return BackendIOError(error.errno or errno.EIO, f"nvme: {doing}: {error.strerror or error}")


@contextmanager
def _io_errors(doing: str) -> Iterator[None]:
    """Raise an ``OSError`` of the block as a [`BackendIOError`][] saying what was being done (one
    that is a [`BackendIOError`][] already passes unchanged)."""
    try:
        yield
    except BackendIOError:
        raise
    except OSError as error:
        raise _io_error(error, doing) from error
