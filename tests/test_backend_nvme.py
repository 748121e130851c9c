import errno
import os
from pathlib import Path

import pytest
from tierstore.backends import Backend, nvme, open_backend
from tierstore.backends.nvme import NvmeBackend

from tierstore.errors import ConfigError, UnwritablePathError
from tierstore.testing import BackendTests


class TestNvmeBackend(BackendTests):
    """Small chunks and a shallow queue so chunk edges and queueing are exercised on small data."""

    def open(self, root: Path) -> Backend:
        return open_backend(f"nvme://{root}?queue_depth=4&chunk_bytes=65536")

    def raw_get(self, backend: Backend, name: str) -> bytes:
        assert isinstance(backend, NvmeBackend)
        return (backend.root / name).read_bytes()

    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        assert isinstance(backend, NvmeBackend)
        (backend.root / name).write_bytes(data)


class TestNvmeBufferedBackend(TestNvmeBackend):
    """The buffered fallback path must honour the same contract."""

    def open(self, root: Path) -> Backend:
        return open_backend({"type": "nvme", "path": root, "direct": False, "chunk_bytes": "64KiB"})


def test_direct_io_is_used_where_accepted(tmp_path: Path) -> None:
    with open_backend({"type": "nvme", "path": tmp_path}) as backend:
        assert isinstance(backend, NvmeBackend)
        assert backend.direct and backend.capabilities.direct_io
        assert backend.capabilities.alignment == 4096


def test_files_are_owner_only(tmp_path: Path) -> None:
    with open_backend({"type": "nvme", "path": tmp_path / "d"}) as backend:
        backend.write("x", 0, b"abc").result()
        assert (tmp_path / "d").stat().st_mode & 0o777 == 0o700
        assert (tmp_path / "d" / "x").stat().st_mode & 0o777 == 0o600


def _refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def fake_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & nvme.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", fake_open)  # the module nvme opens its files through


def test_falls_back_to_buffered_io_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_o_direct(monkeypatch)
    with pytest.warns(RuntimeWarning, match="refuses O_DIRECT"):
        backend = open_backend({"type": "nvme", "path": tmp_path})
    with backend:
        assert isinstance(backend, NvmeBackend) and not backend.direct
        backend.write("x", 0, b"hello").result()
        out = bytearray(5)
        backend.read_into("x", 0, out).result()
        assert out == b"hello"


def test_direct_required_but_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_o_direct(monkeypatch)
    with pytest.raises(ConfigError, match="O_DIRECT"):
        open_backend({"type": "nvme", "path": tmp_path, "direct": True})


def test_unwritable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(UnwritablePathError, match="cannot write"):
        open_backend({"type": "nvme", "path": blocker / "sub"})


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"queue_depth": 0}, "queue_depth"),
        ({"chunk_bytes": 1000}, "chunk_bytes"),
        ({"chunk_bytes": "lots"}, "chunk_bytes"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_options_name_the_field(tmp_path: Path, options: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        open_backend({"type": "nvme", "path": tmp_path, **options})


def test_deleted_files_are_recycled_for_objects_of_the_same_size(tmp_path: Path) -> None:
    old, new, other = bytes(range(256)) * 40, bytes(reversed(range(256))) * 40, b"x" * 5000
    with open_backend({"type": "nvme", "path": tmp_path, "recycle": 1}) as backend:
        assert isinstance(backend, NvmeBackend)
        backend.write("v1", 0, old).result()
        blocks = os.stat(tmp_path / "v1").st_ino
        backend.delete("v1")
        assert backend.list() == [] and not backend.exists("v1")
        backend.write("v2", 0, new).result()  # same size: written into v1's blocks
        assert os.stat(tmp_path / "v2").st_ino == blocks
        out = bytearray(len(new))
        backend.read_into("v2", 0, out).result()
        assert bytes(out) == new
        backend.write("w", 0, other).result()
        other_blocks = os.stat(tmp_path / "w").st_ino
        backend.delete("v2")
        backend.delete("w")  # the one place is taken: the older spare (v2's) makes room
        (directory,) = [p for p in tmp_path.iterdir() if p.name.startswith(".spares")]

        def spares() -> list[int]:
            return [os.stat(p).st_size for p in directory.iterdir() if p.name != ".lock"]

        assert spares() == [len(other)]
        backend.write("v3", 0, old).result()  # v2's size: no spare left for it, a fresh file
        assert spares() == [len(other)]
        backend.write("w2", 0, other).result()  # w's size: written into w's blocks
        assert os.stat(tmp_path / "w2").st_ino == other_blocks and spares() == []
        out = bytearray(len(other))
        backend.read_into("w2", 0, out).result()
        assert bytes(out) == other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3", "w2"]  # close() removed no object
