import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from adios2 import FileReader
from tierstore.backends import Backend, open_backend
from tierstore.backends.adios2 import READER_LINK, Adios2Backend

from tierstore import AlignmentError
from tierstore.testing import BackendTests


def _bp_write(path: Path, data: bytes) -> None:
    from adios2 import Stream

    with Stream(str(path), "w") as stream:
        for _ in stream.steps(1):
            if data:
                array = np.frombuffer(bytearray(data), np.uint8)
                stream.write("data", array, [array.size], [0], [array.size])


class TestAdios2Backend(BackendTests):
    """Small transfer slots so objects cross several slots."""

    def open(self, root: Path) -> Backend:
        return open_backend(f"adios2://{root}?transfer_bytes=65536")

    def raw_get(self, backend: Backend, name: str) -> bytes:
        """ADIOS2's own reader, through a link named as the backend's (so that it leaves no profile
        in /tmp either), in a directory of its own beside the backend's."""
        assert isinstance(backend, Adios2Backend)
        with tempfile.TemporaryDirectory(dir=backend.root.parent) as directory:
            link = Path(directory) / READER_LINK
            link.symlink_to(backend.root / f"{name}.bp")
            with FileReader(str(link)) as reader:
                if "data" not in reader.available_variables():
                    return b""
                return bytes(reader.read("data"))

    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        assert isinstance(backend, Adios2Backend)
        _bp_write(backend.root / f"{name}.bp", data)


def test_layout_is_one_bp_directory_per_object(tmp_path: Path) -> None:
    with open_backend({"type": "adios2", "path": tmp_path}) as backend:
        backend.write("obj", 0, bytes(range(256)) * 10).result()
        backend.write("obj", 0, b"replaced").result()  # whole-object rewrite
        assert backend.size("obj") == 8
    assert [p.name for p in tmp_path.iterdir()] == ["obj.bp"]
    assert not (tmp_path / "obj.bp" / "profiling.json").exists()


def test_only_whole_object_writes(tmp_path: Path) -> None:
    with open_backend({"type": "adios2", "path": tmp_path}) as backend:
        backend.write("obj", 0, bytes(100)).result()
        with pytest.raises(AlignmentError, match="offset 0"):
            backend.write("obj", 16, b"x")


def test_other_threads_keep_running_during_adios2_io(tmp_path: Path) -> None:
    """ADIOS2 holds the GIL during put/get; the worker process keeps it out of ours."""
    data = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    spins = 0
    done = threading.Event()

    def spin() -> None:
        nonlocal spins
        while not done.is_set():
            spins += 1

    with open_backend({"type": "adios2", "path": tmp_path}) as backend:
        backend.write("warm", 0, b"x").result()  # start the worker outside the measurement
        thread = threading.Thread(target=spin)
        thread.start()
        started = time.perf_counter()
        backend.write("big", 0, data).result()
        elapsed = time.perf_counter() - started
        done.set()
        thread.join()
    # A thread starved of the GIL manages a few thousand spins; a free one millions per second.
    assert spins > 100_000 * elapsed, (spins, elapsed)


def test_worker_restarts_after_dying(tmp_path: Path) -> None:
    with open_backend({"type": "adios2", "path": tmp_path}) as backend:
        assert isinstance(backend, Adios2Backend)
        backend.write("a", 0, b"alpha").result()
        assert backend._worker is not None
        backend._worker._process.kill()
        backend._worker._process.wait()
        backend.write("b", 0, b"beta").result()
        out = bytearray(5)
        backend.read_into("a", 0, out).result()
        assert out == b"alpha"


def test_the_worker_has_a_session_of_its_own(tmp_path: Path) -> None:
    """A Ctrl-C in the terminal signals the foreground process group: the store's process, which
    stops its worker itself, and not the worker (whose KeyboardInterrupt traceback would land in
    the terminal)."""
    with open_backend({"type": "adios2", "path": tmp_path}) as backend:
        assert isinstance(backend, Adios2Backend)
        backend.write("a", 0, b"alpha").result()
        assert backend._worker is not None
        worker = backend._worker._process.pid
        assert os.getsid(worker) == worker != os.getsid(0)


def test_nothing_is_written_outside_the_store_directory(tmp_path: Path) -> None:
    """ADIOS2's BP5 reader drops ``/tmp/<name>_<pid>_profiling.json`` at every close; reads (and
    the size queries of a reopened backend) must leave ``/tmp`` as it was, and the directory with
    the objects alone."""
    names = [f"tierstore-tmp-check-{os.getpid()}-{n}" for n in range(3)]

    def traces() -> set[str]:
        return {
            entry
            for entry in os.listdir("/tmp")
            if "profiling.json" in entry or entry.startswith(names[0][:-1])
        }

    before = traces()
    with open_backend({"type": "adios2", "path": tmp_path}) as backend:
        for name in names:
            backend.write(name, 0, name.encode()).result()
    with open_backend({"type": "adios2", "path": tmp_path}) as backend:
        for name in names:
            out = bytearray(backend.size(name))  # a reopened backend asks the file
            backend.read_into(name, 0, out).result()
            assert out == name.encode()
    assert traces() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{name}.bp" for name in names)
