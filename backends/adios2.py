"""``adios2:///path``: objects as ADIOS2 BP5 files, written and read by a worker process.

**Layout.** ``<path>/<name>.bp`` is a BP5 directory holding one global 1-D ``uint8`` variable,
``data``, written in one step. Any ADIOS2 reader (``bpls``, ``adios2.FileReader``) can open it. A
write goes to ``<path>/.writing-<id>/<name>.bp``, a directory private to this backend instance, and
is renamed into place when complete, so a reader never sees a half-written object. After a crash the
next backend opened on the directory removes it (`tierstore.backends.private`), as it does a scratch
store's ``.scratch-<id>/`` (`claim_scratch`). One file per object, rather than one append-only file
for all objects, means an overwrite or delete frees space at once, with no compaction.

**Nothing outside the directory.** ADIOS2 writes profiles: the writer a ``profiling.json`` into
every ``.bp`` directory (removed once the object is written), and the BP5 reader, at every close,
``/tmp/<base name of the path it opened>_<pid>_profiling.json``, a path no engine parameter changes
(ADIOS2 2.10 to 2.12; ``Profile=Off`` does not stop it) and where a failure to write is ignored. So
objects are read through a symbolic link in the private directory whose name is too long for that
file name to exist (`READER_LINK`: 250 characters, and ``NAME_MAX`` is 255): its write fails, and
nothing lands in ``/tmp``.

**Worker process.** ADIOS2's bindings hold the GIL during put/get, which would stall every other
thread of the store; so ADIOS2 runs in a child process (``_adios2_worker.py``) and data moves
through two shared-memory slots of ``transfer_bytes`` (one filled while the other is written).
The cost is one memcpy per direction. Requests to one backend are served one at a time. The slots
are an anonymous memory file (``memfd_create``) handed to the worker as a file descriptor, so a
crash at any moment leaves nothing in ``/dev/shm``; the worker runs in a session of its own (a
Ctrl-C in the terminal reaches the store's process, not the worker) and exits quietly once the
store's process is gone.

Only whole objects are written (``partial_writes`` is False): ADIOS2 files are append-only.
Writes default to ``StatsLevel=0`` (no min/max per block) and a large ``BufferChunkSize``, which
make writes about 4x as fast as ADIOS2's own defaults.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from pydantic import ByteSize, Field

from ..errors import BackendIOError, KeyNotFoundError
from .base import NAME_PATTERN, BackendOptions, Capabilities, DirectoryBackend, DirectoryOptions, PageMultiple
from .private import PrivateDirectory

SLOTS = 2
SlotCallback = Callable[[np.ndarray, int, int], None]
"""Called with a slot and the object byte range [start, stop) it holds (or is to hold)."""
WORKER = Path(__file__).with_name("_adios2_worker.py")
READER_LINK = "r" * 250
"""The link objects are opened for reading through (see the module docstring)."""


class Adios2Options(DirectoryOptions):
    """Options of ``adios2://`` (``path`` is the objects' directory)."""

    engine: Literal["BP5", "BP4"] = "BP5"
    """The ADIOS2 file engine the objects are written and read with."""
    parameters: dict[str, str] = Field(
        default_factory=lambda: {"StatsLevel": "0", "BufferChunkSize": str(128 << 20)}
    )
    """ADIOS2 engine parameters."""
    transfer_bytes: PageMultiple = Field(ByteSize(64 << 20))
    """Size of each shared-memory slot (one put/get); a multiple of 4096."""


class Adios2Backend(DirectoryBackend):
    """Whole objects in BP5 files; ADIOS2 itself runs in a worker process, started on first use
    (the module docstring gives the layout and why).

    Args:
        options: an `Adios2Options`.

    Raises:
        UnwritablePathError: the directory cannot be created or written.
    """

    scheme = "adios2"
    Options = Adios2Options
    options: Adios2Options
    PRIVATE_KINDS = ("writing", "scratch")

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert isinstance(options, Adios2Options)
        self._writing: PrivateDirectory | None = None  # made on first use: see _private()
        self._worker: _Worker | None = None
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        # One thread talks to the worker; the store's other threads never wait on ADIOS2's GIL.
        self._dispatch = ThreadPoolExecutor(1, thread_name_prefix="tierstore-adios2")

    @property
    def capabilities(self) -> Capabilities:
        """Implements [`Backend.capabilities`][]: whole-object writes only (append-only files)."""
        return Capabilities(
            alignment=1,
            chunk_bytes=int(self.options.transfer_bytes),
            partial_writes=False,
            persistent=True,
            direct_io=False,
        )

    # -- data path --------------------------------------------------------------------------------
    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        """Implements `Backend._write`: written aside, then renamed over the old object."""
        return self._dispatch.submit(self._write_now, name, data)

    def _write_now(self, name: str, data: memoryview) -> None:
        """Runs on the dispatch thread, one write at a time."""
        final = self._path(name)
        temporary = self._private().path / final.name
        worker = self._ensure_worker()
        try:
            worker.call(
                op="write_begin",
                path=str(temporary),
                size=data.nbytes,
                engine=self.options.engine,
                parameters=self.options.parameters,
            )
            source = np.frombuffer(data, np.uint8)

            def fill(slot: np.ndarray, start: int, stop: int) -> None:
                slot[: stop - start] = source[start:stop]

            worker.stream("put", data.nbytes, fill=fill)
            worker.call(op="write_end")
            with self._lock:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(temporary, final)
                self._sizes[name] = data.nbytes
        except BaseException:
            worker.abandon()
            shutil.rmtree(temporary, ignore_errors=True)
            raise

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        """Implements `Backend._read_into`."""
        return self._dispatch.submit(self._read_now, name, offset, out)

    def _read_now(self, name: str, offset: int, out: memoryview) -> None:
        worker = self._ensure_worker()
        target = np.frombuffer(out, np.uint8)
        try:
            worker.call(
                op="read_begin",
                path=self._reader_path(self._existing(name)),
                engine=self.options.engine,
                parameters=self.options.parameters,
            )

            def drain(slot: np.ndarray, start: int, stop: int) -> None:
                target[start:stop] = slot[: stop - start]

            worker.stream("get", out.nbytes, base=offset, drain=drain)
            worker.call(op="read_end")
        except BaseException:
            worker.abandon()
            raise

    # -- metadata ---------------------------------------------------------------------------------
    def _size(self, name: str) -> int:
        """Implements `Backend._size`: asked of the worker once, then remembered."""
        path = self._existing(name)
        with self._lock:
            if name in self._sizes:
                return self._sizes[name]
        size = self._dispatch.submit(self._query_size, path).result()
        with self._lock:
            self._sizes[name] = size
        return size

    def _query_size(self, path: Path) -> int:
        worker = self._ensure_worker()
        try:
            size = int(
                worker.call(
                    op="read_begin",
                    path=self._reader_path(path),
                    engine=self.options.engine,
                    parameters=self.options.parameters,
                )["size"]
            )
            worker.call(op="read_end")
        except BaseException:
            worker.abandon()
            raise
        return size

    def _delete(self, name: str) -> None:
        """Implements `Backend._delete`: the ``.bp`` directory goes."""
        path = self._existing(name)
        with self._lock:
            self._sizes.pop(name, None)
            shutil.rmtree(path)

    def _exists(self, name: str) -> bool:
        """Implements `Backend._exists`."""
        return self._path(name).is_dir()

    def _list(self) -> list[str]:
        """Implements `Backend._list`: the ``<name>.bp`` directories."""
        return [
            entry.name[: -len(".bp")]
            for entry in os.scandir(self.root)
            if entry.name.endswith(".bp") and NAME_PATTERN.fullmatch(entry.name[: -len(".bp")])
        ]

    def _close(self) -> None:
        """Implements `Backend._close`: the worker stops; private directories go."""
        self._dispatch.shutdown(wait=True)
        if self._worker is not None:
            self._worker.stop()
        if self._writing is not None:
            self._writing.remove()
        self._remove_scratch()

    def _path(self, name: str) -> Path:
        return self.root / f"{name}.bp"

    def _existing(self, name: str) -> Path:
        path = self._path(name)
        if not path.is_dir():
            raise KeyNotFoundError(f"adios2: no object {name!r} in {self.root}")
        return path

    def _private(self) -> PrivateDirectory:
        """This instance's private directory: objects being written, and the reader's link."""
        if self._writing is None:
            self._writing = PrivateDirectory(self.root, "writing")
        return self._writing

    def _reader_path(self, path: Path) -> str:
        """``path`` as the worker opens it for reading: through `READER_LINK` in the private
        directory, pointed at it now (on the dispatch thread: one read at a time)."""
        link = self._private().path / READER_LINK
        link.unlink(missing_ok=True)
        link.symlink_to(path.absolute())
        return str(link)

    def _ensure_worker(self) -> _Worker:
        """The worker process, (re)started if it is not running (called on the dispatch thread)."""
        if self._worker is None or not self._worker.alive:
            self._worker = _Worker(int(self.options.transfer_bytes))
        return self._worker


class _Worker:
    """A running ``_adios2_worker.py`` process, its pipes and its shared-memory slots."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        memory_fd = _anonymous_memory_file("tierstore-adios2")
        try:
            os.ftruncate(memory_fd, slot_bytes * SLOTS)
            self._memory = mmap.mmap(memory_fd, slot_bytes * SLOTS)
            request_read, self._request_write = os.pipe()
            self._reply_read, reply_write = os.pipe()
            self._process = subprocess.Popen(
                # -P: the script's folder (this package) must not shadow the real adios2 module
                [
                    sys.executable,
                    "-P",
                    str(WORKER),
                    str(request_read),
                    str(reply_write),
                    str(memory_fd),
                    str(slot_bytes),
                    str(SLOTS),
                ],
                pass_fds=(request_read, reply_write, memory_fd),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            os.close(request_read)
            os.close(reply_write)
            self._requests: IO[str] = os.fdopen(self._request_write, "w")
            self._replies: IO[str] = os.fdopen(self._reply_read, "r")
            self._receive()  # "ready": the worker has mapped the slots
        finally:
            os.close(memory_fd)  # both mappings stay valid
        self.slots = [
            np.frombuffer(self._memory, np.uint8, slot_bytes, index * slot_bytes) for index in range(SLOTS)
        ]
        self._in_session = False

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def call(self, **message: Any) -> dict[str, Any]:
        self._send(message)
        return self._receive()

    def stream(
        self,
        operation: Literal["put", "get"],
        nbytes: int,
        *,
        base: int = 0,
        fill: SlotCallback | None = None,
        drain: SlotCallback | None = None,
    ) -> None:
        """Move ``nbytes`` through the slots, two requests in flight: ``fill`` a slot before a put,
        ``drain`` it after a get. ``base`` offsets the object positions of a get."""
        pending: deque[tuple[int, int, int]] = deque()
        pieces = [
            (start, min(start + self.slot_bytes, nbytes)) for start in range(0, nbytes, self.slot_bytes)
        ]
        for index, (start, stop) in enumerate(pieces):
            slot = index % SLOTS
            if len(pending) == SLOTS:
                self._finish(pending.popleft(), drain)
            if fill is not None:
                fill(self.slots[slot], start, stop)
            self._send({"op": operation, "slot": slot, "offset": base + start, "length": stop - start})
            pending.append((slot, start, stop))
        while pending:
            self._finish(pending.popleft(), drain)

    def _finish(self, request: tuple[int, int, int], drain: SlotCallback | None) -> None:
        slot, start, stop = request
        self._receive()
        if drain is not None:
            drain(self.slots[slot], start, stop)

    def abandon(self) -> None:
        """After a failure mid-session: close the worker's engine, or kill a worker in a bad state."""
        try:
            if self.alive:
                self._send({"op": "abort"})
                self._receive()
        except BackendIOError:
            self._process.kill()

    def stop(self) -> None:
        try:
            self._send({"op": "quit"})
            self._process.wait(timeout=30)
        except (BackendIOError, subprocess.TimeoutExpired):
            self._process.kill()
        self._requests.close()
        self._replies.close()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._requests.write(json.dumps(message) + "\n")
            self._requests.flush()
        except (BrokenPipeError, ValueError) as error:
            raise BackendIOError(32, f"adios2: worker process is gone ({error})") from error

    def _receive(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            raise BackendIOError(32, f"adios2: worker process exited (status {self._process.poll()})")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise BackendIOError(5, f"adios2: {reply.get('error', 'unknown error')}")
        return reply


def _anonymous_memory_file(name: str) -> int:
    """A file descriptor of shared memory that has no name anywhere, so it cannot outlive the
    processes that map it: ``memfd_create`` on Linux, elsewhere a temporary file unlinked at once."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name)
    fd, path = tempfile.mkstemp(prefix=f"{name}-")
    os.unlink(path)
    return fd
