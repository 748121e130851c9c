"""``zarr+file:///path``, ``zarr+memory://name``, ``zarr+s3://bucket/prefix``: Zarr v3 on any fsspec URL.

Meant for the parallel-file-system tier (Lustre, GPFS, VAST mounted at a path) and object stores.

**Layout.** Each object is a 1-D, uncompressed ``uint8`` Zarr v3 array named after the object at
the root of the store, chunked in ``chunk_bytes`` (16 MiB by default, the fastest size on a local
file system), written with ``write_empty_chunks=True`` (zarr's default skips all-zero chunks,
which costs a comparison of every chunk and halves write throughput). Any Zarr v3 reader can open
it.

**Writes and reads.** Offsets must fall on chunk edges (the declared alignment): through zarr, a
write that starts inside a chunk is a read-modify-write, and two writers sharing a chunk lose data,
so the store never issues one. On a mounted path (``raw_chunks``), zarr writes the array's
metadata and the data moves as the plain chunk files ``<name>/c/<i>`` (uncompressed chunks are
exactly the chunk's bytes), written and read in place with ``os.pwrite``/``os.preadv`` by a thread
pool, straight from and into the caller's buffer: that reads about 2.8x and writes about 1.15x as
fast as zarr's own path, with far less CPU (which a FUSE or network file system needs).
Other stores, or arrays written compressed by someone else, go through zarr
(``array[a:b] = ...``, ``get_basic_selection(out=...)``).

A path uses zarr's ``LocalStore``; any other URL uses ``FsspecStore`` with ``storage_options``. On a
path, a scratch store's objects go to ``<path>/.scratch-<id>/`` (`claim_scratch`), removed at close
or, after a crash, by the next backend opened on the path (`tierstore.backends.private`); other URLs
cannot mark a live owner, so there they stay among the rest.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from fsspec.core import split_protocol
from pydantic import ByteSize, Field
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

from .._futures import when_all
from ..errors import BackendIOError, ConfigError, KeyNotFoundError
from .base import NAME_PATTERN, Backend, BackendOptions, Capabilities, Location, PageMultiple, prepare_root
from .private import PrivateDirectory, remove_abandoned

LOCAL_PROTOCOLS = (None, "file", "local")


class ZarrOptions(BackendOptions):
    """Options of ``zarr+<protocol>://`` (the URL's location and protocol make ``url``)."""

    url: str
    """A local path or ``file://`` URL (LocalStore), or any other fsspec URL (FsspecStore)."""
    chunk_bytes: PageMultiple = Field(ByteSize(16 << 20))
    """Chunk size of new arrays; a multiple of 4096."""
    queue_depth: int = Field(8, ge=1, le=256)
    """Worker threads issuing requests."""
    raw_chunks: bool = True
    """On a mounted path, read and write the uncompressed chunk files directly (see above)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Passed to fsspec for non-local URLs (credentials, endpoint...)."""


class ZarrBackend(Backend):
    """Objects as 1-D uint8 Zarr v3 arrays (the module docstring gives the layout).

    Args:
        options: a `ZarrOptions`.

    Raises:
        UnwritablePathError: a local path cannot be created or written.
        ConfigError: a URL whose protocol fsspec does not know, or whose package is missing.
    """

    scheme = "zarr"
    Options = ZarrOptions
    options: ZarrOptions

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert isinstance(options, ZarrOptions)
        protocol, path = split_protocol(options.url)
        self.local_root: Path | None = None
        if protocol in LOCAL_PROTOCOLS:
            self.local_root = prepare_root(Path(path), "zarr")
            self._location = Location.of_directory(self.local_root)
            remove_abandoned(self.local_root, "scratch")  # left by scratch stores that crashed
            self.store: LocalStore | FsspecStore = LocalStore(self.local_root)
        else:
            try:
                self.store = FsspecStore.from_url(options.url, storage_options=options.storage_options)
            except (ValueError, ImportError) as error:  # unknown protocol, or its package missing
                raise ConfigError(f"zarr: cannot open url {options.url!r}: {error}") from None
            # Storage options (credentials, endpoints) are not compared: only the normalised URL.
            url = self.store.fs.unstrip_protocol(posixpath.normpath(self.store.path))
            self._location = Location(("url", url), url)
        self._scratch: PrivateDirectory | None = None
        self._persistent = protocol != "memory"
        self._chunk = int(options.chunk_bytes)
        self._arrays: dict[str, zarr.Array[Any]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(options.queue_depth, thread_name_prefix="tierstore-zarr")

    @classmethod
    def options_from_url(cls, scheme: str, location: str, query: Mapping[str, str]) -> dict[str, Any]:
        """Implements [`Backend.options_from_url`][]: ``zarr+s3://b/p`` is ``url="s3://b/p"``."""
        protocol = scheme.partition("+")[2] or "file"
        return {"url": f"{protocol}://{location}", **query}

    def location(self) -> Location:
        """Implements [`Backend.location`][]: a path's directory, or the normalised URL."""
        return self._location

    def claim_scratch(self) -> None:
        """Implements [`Backend.claim_scratch`][] on a path (``.scratch-<id>/``); other URLs cannot
        mark a live owner, so there it does nothing."""
        self._check_open()
        if self.local_root is not None and self._scratch is None:
            self._scratch = PrivateDirectory(self.local_root, "scratch")
            self.local_root = self._scratch.path
            self._arrays.clear()
            self.store.close()
            self.store = LocalStore(self.local_root)

    @property
    def capabilities(self) -> Capabilities:
        """Implements [`Backend.capabilities`][]: offsets on chunk edges; ``zarr+memory`` is
        volatile."""
        return Capabilities(
            alignment=self._chunk,
            chunk_bytes=self._chunk,
            partial_writes=True,
            persistent=self._persistent,
            direct_io=False,
        )

    # -- data path --------------------------------------------------------------------------------
    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        """Implements `Backend._write`: the array is created or grown before the data moves."""
        array = self._prepare(name, offset + data.nbytes)
        if self._raw(array):
            chunk = int(array.chunks[0])
            chunk_files = self._chunk_files(name)
            chunk_files.mkdir(parents=True, exist_ok=True)
            tasks = [
                self._pool.submit(
                    _write_chunk_file,
                    chunk_files / str(position // chunk),
                    position % chunk,
                    data[start:stop],
                    chunk,
                )
                for start, stop, position in _pieces(offset, data.nbytes, chunk)
            ]
            return when_all(tasks, lambda: None)
        return self._pool.submit(self._write_through_zarr, array, offset, data)

    @staticmethod
    def _write_through_zarr(array: zarr.Array[Any], offset: int, data: memoryview) -> None:
        if data.nbytes:
            array[offset : offset + data.nbytes] = np.frombuffer(data, np.uint8)

    def _prepare(self, name: str, end: int) -> zarr.Array[Any]:
        """The object's array, created or grown to ``end`` bytes (metadata only)."""
        with self._lock:
            array = self._arrays.get(name) or self._open(name, missing_ok=True)
            if array is None:
                array = zarr.create_array(
                    self.store,
                    name=name,
                    shape=(end,),
                    chunks=(self._chunk,),
                    dtype="uint8",
                    compressors=None,
                    filters=None,
                    fill_value=0,
                    config={"write_empty_chunks": True},
                )
                self._arrays[name] = array
            elif array.shape[0] < end:
                array.resize((end,))
        return array

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        """Implements `Backend._read_into`: a chunk never written reads as zeros."""
        array = self._array(name)
        self._check_present(name)
        if self._raw(array):
            chunk = int(array.chunks[0])
            chunk_files = self._chunk_files(name)
            tasks = [
                self._pool.submit(
                    _read_chunk_file, chunk_files / str(position // chunk), position % chunk, out[start:stop]
                )
                for start, stop, position in _pieces(offset, out.nbytes, chunk)
            ]
            return when_all(tasks, lambda: None)
        return self._pool.submit(self._read_through_zarr, array, offset, out)

    def _raw(self, array: zarr.Array[Any]) -> bool:
        return self.local_root is not None and self.options.raw_chunks and _plain_chunks(array)

    def _chunk_files(self, name: str) -> Path:
        assert self.local_root is not None
        return self.local_root / name / "c"

    @staticmethod
    def _read_through_zarr(array: zarr.Array[Any], offset: int, out: memoryview) -> None:
        target = default_buffer_prototype().nd_buffer.from_numpy_array(np.frombuffer(out, np.uint8))
        array.get_basic_selection(slice(offset, offset + out.nbytes), out=target)

    # -- metadata ---------------------------------------------------------------------------------
    def _array(self, name: str) -> zarr.Array[Any]:
        with self._lock:
            array = self._arrays.get(name) or self._open(name, missing_ok=False)
        assert array is not None
        return array

    def _check_present(self, name: str) -> None:
        """An array opened earlier outlives its files, and zarr reads absent chunks as zeros, so a
        read checks that the object was not deleted behind the backend's back."""
        if not self._stored(name):
            with self._lock:
                self._arrays.pop(name, None)
            raise KeyNotFoundError(f"zarr: no object {name!r} in {self.options.url}")

    def _stored(self, name: str) -> bool:
        """Whether the medium holds array ``name``'s metadata (``zarr.json``): on a path, one
        ``stat``, not a round trip through zarr's event loop (a listing makes one per entry)."""
        if self.local_root is not None:
            return (self.local_root / name / "zarr.json").is_file()
        return bool(sync(self.store.exists(f"{name}/zarr.json")))

    def _open(self, name: str, *, missing_ok: bool) -> zarr.Array[Any] | None:
        """Open an existing array and remember it (caller holds the lock)."""
        if not self._stored(name):
            if missing_ok:
                return None
            raise KeyNotFoundError(f"zarr: no object {name!r} in {self.options.url}")
        array = zarr.open_array(self.store, path=name, mode="r+")
        if array.ndim != 1 or array.dtype != np.uint8:
            raise BackendIOError(5, f"zarr: {name!r} is not a 1-D uint8 array, not a tierstore object")
        self._arrays[name] = array
        return array

    def _delete(self, name: str) -> None:
        """Implements `Backend._delete`: the array's whole directory goes."""
        with self._lock:
            if name not in self._arrays and not self._stored(name):
                raise KeyNotFoundError(f"zarr: no object {name!r} in {self.options.url}")
            self._arrays.pop(name, None)
            sync(self.store.delete_dir(name))

    def _exists(self, name: str) -> bool:
        """Implements `Backend._exists`: an array's ``zarr.json`` marks it."""
        return name in self._arrays or self._stored(name)

    def _size(self, name: str) -> int:
        """Implements `Backend._size`: the array's length."""
        return int(self._array(name).shape[0])

    def _list(self) -> list[str]:
        """Implements `Backend._list`: the arrays at the store's root."""
        entries = sync(_collect(self.store.list_dir("")))
        return [entry for entry in entries if NAME_PATTERN.fullmatch(entry) and self._exists(entry)]

    def _close(self) -> None:
        """Implements `Backend._close`: a scratch store's directory is removed."""
        self._pool.shutdown(wait=True)
        self._arrays.clear()
        self.store.close()
        if self._scratch is not None:
            self._scratch.remove()


def _read_chunk_file(path: Path, at: int, out: memoryview) -> None:
    """Fill ``out`` from byte ``at`` of one uncompressed chunk file (a missing chunk is zeros)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        np.frombuffer(out, np.uint8)[:] = 0
        return
    try:
        done = 0
        while done < out.nbytes:
            got = os.preadv(fd, [out[done:]], at + done)
            if got <= 0:
                raise BackendIOError(5, f"zarr: chunk file {path} is shorter than its chunk")
            done += got
    finally:
        os.close(fd)


def _write_chunk_file(path: Path, at: int, data: memoryview, chunk: int) -> None:
    """Write ``data`` at byte ``at`` of one uncompressed chunk file, in place.

    Zarr expects every chunk file, the last included, to hold a whole chunk: a short file is
    extended with ``ftruncate`` (zeros, the fill value, without writing them)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        done = 0
        while done < data.nbytes:
            written = os.pwrite(fd, data[done:], at + done)
            if written <= 0:
                raise BackendIOError(5, f"zarr: could not write chunk file {path}")
            done += written
        if os.fstat(fd).st_size < chunk:
            os.ftruncate(fd, chunk)
    finally:
        os.close(fd)


def _plain_chunks(array: zarr.Array[Any]) -> bool:
    """Whether chunk ``i`` is the raw file ``c/i`` (no compression or filters, '/' keys)."""
    metadata = array.metadata
    codecs: tuple[Any, ...] = tuple(getattr(metadata, "codecs", ()))
    encoding = getattr(metadata, "chunk_key_encoding", None)
    return (
        len(codecs) == 1
        and type(codecs[0]).__name__ == "BytesCodec"
        and getattr(encoding, "name", None) == "default"
        and getattr(encoding, "separator", None) == "/"
    )


def _pieces(offset: int, nbytes: int, chunk: int) -> list[tuple[int, int, int]]:
    """Split ``[offset, offset + nbytes)`` at chunk edges: (start, stop) in the buffer, file position."""
    pieces = []
    position = offset
    while position < offset + nbytes:
        stop = min((position // chunk + 1) * chunk, offset + nbytes)
        pieces.append((position - offset, stop - offset, position))
        position = stop
    return pieces


async def _collect(entries: AsyncIterator[str]) -> list[str]:
    return [entry async for entry in entries]
