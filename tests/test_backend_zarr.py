from pathlib import Path

import numpy as np
import pytest
import zarr
from tierstore.backends import Backend, open_backend
from tierstore.backends.zarr import ZarrBackend
from zarr.abc.store import Store
from zarr.storage import LocalStore

from tierstore.testing import BackendTests

SMALL_CHUNKS = "chunk_bytes=65536&queue_depth=4"


def _raw_get(store: Store, name: str) -> bytes:
    data = zarr.open_array(store, path=name, mode="r")[:]
    assert isinstance(data, np.ndarray)  # a slice of a 1-d array, never a scalar
    return data.tobytes()


def _raw_set(store: Store, name: str, data: bytes) -> None:
    array = zarr.create_array(store, name=name, shape=(len(data),), chunks=(65536,), dtype="uint8")
    if data:
        array[:] = np.frombuffer(data, np.uint8)


class TestZarrLocalBackend(BackendTests):
    """A mounted path: LocalStore, with raw chunk-file reads."""

    def open(self, root: Path) -> Backend:
        return open_backend(f"zarr+file://{root}?{SMALL_CHUNKS}")

    def raw_get(self, backend: Backend, name: str) -> bytes:
        assert isinstance(backend, ZarrBackend) and backend.local_root is not None
        return _raw_get(LocalStore(backend.local_root), name)

    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        assert isinstance(backend, ZarrBackend) and backend.local_root is not None
        _raw_set(LocalStore(backend.local_root), name, data)  # zarr's default: compressed


class TestZarrLocalThroughZarr(TestZarrLocalBackend):
    """raw_chunks off: every byte goes through zarr's own read and write paths."""

    def open(self, root: Path) -> Backend:
        return open_backend(f"zarr+file://{root}?{SMALL_CHUNKS}&raw_chunks=false")


class TestZarrMemoryBackend(BackendTests):
    """Any fsspec URL: FsspecStore (here fsspec's in-memory file system)."""

    def open(self, root: Path) -> Backend:
        return open_backend(f"zarr+memory://{root.name}-{id(self)}?{SMALL_CHUNKS}")

    def raw_get(self, backend: Backend, name: str) -> bytes:
        assert isinstance(backend, ZarrBackend)
        return _raw_get(backend.store, name)

    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        assert isinstance(backend, ZarrBackend)
        _raw_set(backend.store, name, data)


def test_objects_are_uncompressed_arrays_with_write_empty_chunks(tmp_path: Path) -> None:
    with open_backend({"type": "zarr", "url": str(tmp_path), "chunk_bytes": "64KiB"}) as backend:
        backend.write("obj", 0, bytes(200_000)).result()  # all zeros: every chunk still written
    chunks = sorted((tmp_path / "obj" / "c").iterdir())
    assert [p.name for p in chunks] == ["0", "1", "2", "3"]
    assert all(p.stat().st_size == 65536 for p in chunks)
    array = zarr.open_array(LocalStore(tmp_path), path="obj", mode="r")
    assert array.shape == (200_000,) and array.chunks == (65536,) and array.compressors == ()


def test_unaligned_write_offset_is_refused(tmp_path: Path) -> None:
    from tierstore import AlignmentError

    with open_backend(f"zarr+file://{tmp_path}?chunk_bytes=65536") as backend:
        backend.write("x", 0, bytes(100_000)).result()
        with pytest.raises(AlignmentError):
            backend.write("x", 4096, b"y")
