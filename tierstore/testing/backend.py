"""The conformance suite every backend must pass, in the manner of ``zarr.testing.store.StoreTests``.

Subclass [`BackendTests`][] in a class whose name starts with ``Test`` and implement
[`open`][tierstore.testing.BackendTests.open] and the two raw-medium helpers. The raw helpers bypass
the backend (read the file, the dict, the array...) and are the ground truth the tests compare
against. Tests for capabilities a backend does not declare are skipped, never failed.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ..backends.base import Backend
from ..buffers import AlignedBuffer
from ..errors import (
    AlignmentError,
    BufferMismatchError,
    InvalidKeyError,
    KeyNotFoundError,
    OutOfRangeError,
    StoreClosedError,
)

INVALID_NAMES = ["", ".", "..", "../escape", "/absolute", "a/b", "nul\x00byte", ".hidden", "-dash", "x" * 201]


def pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    """Deterministic pseudo-random bytes (never constant, so misplaced bytes are caught)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def aligned_copy(data: np.ndarray) -> AlignedBuffer:
    buffer = AlignedBuffer(max(data.nbytes, 1))
    np.frombuffer(buffer.memoryview(data.nbytes), np.uint8)[:] = data
    return buffer


class BackendTests(ABC):
    """Conformance tests for one backend class."""

    @abstractmethod
    def open(self, root: Path) -> Backend:
        """Open the backend under test on a fresh medium rooted at ``root`` (or reopen it)."""

    @abstractmethod
    def raw_get(self, backend: Backend, name: str) -> bytes:
        """The object's bytes read from the medium directly, bypassing ``backend``."""

    @abstractmethod
    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        """Create an object on the medium directly, bypassing ``backend``."""

    # -- fixtures ---------------------------------------------------------------------------------
    @pytest.fixture
    def root(self, tmp_path: Path) -> Path:
        return tmp_path / "medium"

    @pytest.fixture
    def backend(self, root: Path) -> Iterator[Backend]:
        backend = self.open(root)
        yield backend
        backend.close()

    def sizes(self, backend: Backend) -> list[int]:
        """Object sizes around the backend's alignment and chunk edges."""
        caps = backend.capabilities
        block = max(caps.alignment, 4096)
        chunk = caps.chunk_bytes or (1 << 20)
        return sorted({0, 1, block - 1, block, block + 1, chunk - 1, chunk, chunk + 1, 3 * chunk + block + 7})

    def write_whole(self, backend: Backend, name: str, data: np.ndarray) -> None:
        backend.write(name, 0, aligned_copy(data).memoryview(data.nbytes)).result()

    def read_whole(self, backend: Backend, name: str) -> bytes:
        size = backend.size(name)
        buffer = AlignedBuffer(max(size, 1))
        backend.read_into(name, 0, buffer.memoryview(size)).result()
        return bytes(buffer.memoryview(size))

    # -- data path --------------------------------------------------------------------------------
    def test_round_trip_matches_medium(self, backend: Backend) -> None:
        for index, size in enumerate(self.sizes(backend)):
            data = pattern(size, seed=index)
            name = f"obj-{size}"
            self.write_whole(backend, name, data)
            assert backend.size(name) == size
            assert self.raw_get(backend, name) == data.tobytes(), f"medium differs for {size} bytes"
            assert self.read_whole(backend, name) == data.tobytes(), f"read differs for {size} bytes"

    def test_reads_what_the_medium_holds(self, backend: Backend) -> None:
        data = pattern(3 * 4096 + 5, seed=7).tobytes()
        self.raw_set(backend, "planted", data)
        assert backend.exists("planted")
        assert backend.size("planted") == len(data)
        assert self.read_whole(backend, "planted") == data

    def test_unaligned_caller_buffers(self, backend: Backend) -> None:
        size = 2 * (backend.capabilities.chunk_bytes or 1 << 20) + 123
        data = pattern(size, seed=3).tobytes()
        source = memoryview(bytearray(b"\0" + data))[1:]  # deliberately off alignment
        backend.write("unaligned", 0, source).result()
        assert self.raw_get(backend, "unaligned") == data
        target = bytearray(size + 1)
        backend.read_into("unaligned", 0, memoryview(target)[1:]).result()
        assert bytes(target[1:]) == data

    def test_read_range_at_offset(self, backend: Backend) -> None:
        alignment = max(backend.capabilities.alignment, 4096)
        data = pattern(5 * alignment + 99, seed=11)
        self.write_whole(backend, "ranged", data)
        out = bytearray(2 * alignment + 50)
        backend.read_into("ranged", 2 * alignment, out).result()
        assert bytes(out) == data[2 * alignment : 4 * alignment + 50].tobytes()

    def test_partial_overwrite_keeps_the_rest(self, backend: Backend) -> None:
        if not backend.capabilities.partial_writes:
            pytest.skip("backend does not declare partial writes")
        alignment = max(backend.capabilities.alignment, 4096)
        data = pattern(4 * alignment + 321, seed=5)
        self.write_whole(backend, "patched", data)
        patch = pattern(alignment + 17, seed=6)  # ends inside a block: the rest must survive
        backend.write("patched", alignment, aligned_copy(patch).memoryview(patch.nbytes)).result()
        expected = data.copy()
        expected[alignment : 2 * alignment + 17] = patch
        assert backend.size("patched") == data.nbytes
        assert self.raw_get(backend, "patched") == expected.tobytes()

    def test_write_past_end_grows_object(self, backend: Backend) -> None:
        if not backend.capabilities.partial_writes:
            pytest.skip("backend does not declare partial writes")
        alignment = max(backend.capabilities.alignment, 4096)
        head, tail = pattern(alignment, seed=1), pattern(100, seed=2)
        self.write_whole(backend, "grown", head)
        backend.write("grown", 2 * alignment, aligned_copy(tail).memoryview(100)).result()
        assert backend.size("grown") == 2 * alignment + 100
        raw = self.raw_get(backend, "grown")
        assert raw[:alignment] == head.tobytes() and raw[2 * alignment :] == tail.tobytes()

    def test_many_requests_in_flight(self, backend: Backend) -> None:
        objects = {f"many-{i}": pattern(40_000 + 4096 * i, seed=i) for i in range(24)}
        keep = {name: aligned_copy(data) for name, data in objects.items()}
        writes = [backend.write(n, 0, keep[n].memoryview(d.nbytes)) for n, d in objects.items()]
        for future in writes:
            future.result()
        outs = {name: bytearray(data.nbytes) for name, data in objects.items()}
        reads = [backend.read_into(name, 0, outs[name]) for name in objects]
        for future in reads:
            future.result()
        for name, data in objects.items():
            assert bytes(outs[name]) == data.tobytes()

    def test_thread_safety(self, backend: Backend) -> None:
        def worker(index: int) -> None:
            for round_ in range(5):
                name = f"thread-{index}-{round_}"
                data = pattern(10_000 + index * 4096 + round_, seed=index * 10 + round_)
                self.write_whole(backend, name, data)
                assert self.read_whole(backend, name) == data.tobytes()
                backend.delete(name)

        with ThreadPoolExecutor(8) as workers:
            list(workers.map(worker, range(8)))  # raises what a worker raised
        assert backend.list() == []

    # -- metadata ---------------------------------------------------------------------------------
    def test_exists_list_size_delete(self, backend: Backend) -> None:
        assert backend.list() == []
        for name in ["b", "a", "c.1"]:
            self.write_whole(backend, name, pattern(10))
        assert backend.list() == ["a", "b", "c.1"]
        assert backend.exists("a") and not backend.exists("zzz")
        backend.delete("a")
        assert not backend.exists("a")
        assert backend.list() == ["b", "c.1"]

    def test_copy_from_another_instance(self, backend: Backend, root: Path) -> None:
        """A copy between two instances of this backend either is one (the bytes, whole, under the
        new name, the source intact) or is declined without a trace."""
        data = pattern(2 * 4096 + 5, seed=3)
        medium = root.with_name(f"{root.name}-other")  # beside the first: on the same medium kind
        other = self.open(medium)
        try:
            self.write_whole(other, "source", data)
            if not backend.copy_from("copy", other, "source"):
                assert not backend.exists("copy")
                return
            assert self.raw_get(backend, "copy") == data.tobytes()
            other.delete("source")  # the copy does not depend on the source's name
            assert self.read_whole(backend, "copy") == data.tobytes()
            with pytest.raises(KeyNotFoundError):
                backend.copy_from("copy2", other, "source")
        finally:
            other.close()
            shutil.rmtree(medium, ignore_errors=True)

    def test_missing_object(self, backend: Backend) -> None:
        with pytest.raises(KeyNotFoundError):
            backend.size("missing")
        with pytest.raises(KeyNotFoundError):
            backend.delete("missing")
        with pytest.raises(KeyNotFoundError):
            backend.read_into("missing", 0, bytearray(1))

    def test_read_past_end(self, backend: Backend) -> None:
        self.write_whole(backend, "short", pattern(100))
        with pytest.raises(OutOfRangeError):
            backend.read_into("short", 0, bytearray(101))

    def test_misaligned_offset(self, backend: Backend) -> None:
        alignment = backend.capabilities.alignment
        if alignment == 1:
            pytest.skip("backend has no alignment requirement")
        self.write_whole(backend, "aligned", pattern(3 * alignment))
        with pytest.raises(AlignmentError):
            backend.write("aligned", 1, b"x")
        with pytest.raises(AlignmentError):
            backend.read_into("aligned", alignment - 1, bytearray(1))

    @pytest.mark.parametrize("name", INVALID_NAMES)
    def test_invalid_names(self, backend: Backend, name: str) -> None:
        with pytest.raises(InvalidKeyError):
            backend.write(name, 0, b"x")
        with pytest.raises(InvalidKeyError):
            backend.exists(name)

    def test_read_only_destination(self, backend: Backend) -> None:
        self.write_whole(backend, "ro", pattern(10))
        with pytest.raises(BufferMismatchError):
            backend.read_into("ro", 0, bytes(10))

    # -- life cycle -------------------------------------------------------------------------------
    def test_closed_backend_refuses_work(self, root: Path) -> None:
        backend = self.open(root)
        backend.close()
        backend.close()  # idempotent
        assert backend.closed
        with pytest.raises(StoreClosedError):
            backend.write("x", 0, b"x")
        with pytest.raises(StoreClosedError):
            backend.list()

    def test_objects_survive_reopen(self, root: Path) -> None:
        backend = self.open(root)
        if not backend.capabilities.persistent:
            backend.close()
            pytest.skip("backend is not persistent")
        data = pattern(3 * 4096 + 1, seed=9)
        self.write_whole(backend, "kept", data)
        backend.close()
        reopened = self.open(root)
        try:
            assert reopened.list() == ["kept"]
            assert self.read_whole(reopened, "kept") == data.tobytes()
        finally:
            reopened.close()
