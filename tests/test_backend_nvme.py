import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from tierstore.backends import Backend, nvme, open_backend
from tierstore.backends.nvme import NvmeBackend

from tierstore import Tier, TierStore
from tierstore.errors import ConfigError, UnwritablePathError
from tierstore.testing import BackendTests

from .conftest import TmpfsFactory


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
    for path in (blocker, blocker / "sub"):  # not "File exists": what is in the way, and what it is
        message = f"cannot use {path} as a directory: {blocker} is a file"
        with pytest.raises(UnwritablePathError, match=message):
            open_backend({"type": "nvme", "path": path})


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


def test_copy_from_links_the_file_on_one_file_system(tmp_path: Path) -> None:
    data = bytes(range(256)) * 33
    with (
        open_backend({"type": "nvme", "path": tmp_path / "a"}) as fast,
        open_backend({"type": "nvme", "path": tmp_path / "b"}) as slow,
    ):
        fast.write("x", 0, data).result()
        assert slow.copy_from("y", fast, "x")
        assert os.stat(tmp_path / "b" / "y").st_ino == os.stat(tmp_path / "a" / "x").st_ino
        assert slow.list() == ["y"] and slow.size("y") == len(data)


def test_copy_from_across_file_systems_copies_in_the_kernel(tmp_path: Path) -> None:
    """/dev/shm (tmpfs) and the test directory are two file systems: no link, a private copy."""
    shm = Path(tempfile.mkdtemp(prefix="tierstore-copy-", dir="/dev/shm"))
    data = bytes(reversed(range(256))) * 41
    try:
        with (
            open_backend({"type": "nvme", "path": shm}) as fast,
            open_backend({"type": "nvme", "path": tmp_path / "b"}) as slow,
        ):
            fast.write("x", 0, data).result()
            assert slow.copy_from("y", fast, "x")
            copied = tmp_path / "b" / "y"
            assert copied.read_bytes() == data and copied.stat().st_mode & 0o777 == 0o600
            assert os.stat(shm / "x").st_nlink == 1
    finally:
        shutil.rmtree(shm)


def test_copy_from_declines_other_backends(tmp_path: Path) -> None:
    with open_backend({"type": "nvme", "path": tmp_path}) as disk, open_backend("dram://") as memory:
        memory.write("x", 0, b"abc").result()
        assert not disk.copy_from("y", memory, "x")
        assert disk.list() == []


def test_a_linked_file_is_never_recycled(tmp_path: Path) -> None:
    """The source deletes its name and writes a new object of the same size: recycling the file
    would overwrite the blocks the linked copy still names."""
    old, new = bytes(range(256)) * 40, bytes(reversed(range(256))) * 40
    with (
        open_backend({"type": "nvme", "path": tmp_path / "a", "recycle": 4}) as fast,
        open_backend({"type": "nvme", "path": tmp_path / "b"}) as slow,
    ):
        fast.write("v1", 0, old).result()
        assert slow.copy_from("kept", fast, "v1")
        fast.delete("v1")
        fast.write("v2", 0, new).result()
        assert os.stat(tmp_path / "a" / "v2").st_ino != os.stat(tmp_path / "b" / "kept").st_ino
        assert (tmp_path / "b" / "kept").read_bytes() == old
        assert fast.spare_bytes() == 0


def fill_up(directory: Path) -> None:
    """Write a file in ``directory`` until its file system has no block left."""
    with open(directory / "filler", "wb", buffering=0) as filler:
        for size in (1 << 20, 4096, 512):
            try:
                while True:
                    filler.write(bytes(size))
            except OSError as error:
                assert error.errno == errno.ENOSPC


def disk_bytes(root: Path) -> int:
    """Bytes of every file under ``root``, recycled spares included."""
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def test_spares_give_their_space_back_when_a_write_needs_it(small_tmpfs: TmpfsFactory) -> None:
    """16 MiB: eight deleted objects of 1.5 MiB are kept as spares (12 MiB), and writes of
    another size still find room: the spares go before a write would fail with ENOSPC."""
    mount = small_tmpfs("16m")
    with TierStore([Tier("small", open_backend(f"nvme://{mount}"))], cache_budget=0) as store:
        backend = store.tiers[0].paths[0].backend
        assert isinstance(backend, NvmeBackend)
        if not backend.direct:
            pytest.skip("this tmpfs refuses O_DIRECT, so no file is recycled")
        for index in range(8):
            store[f"old{index}"] = torch.zeros(3 << 17)  # 1.5 MiB
        for index in range(8):
            del store[f"old{index}"]
        assert backend.spare_bytes() == 12 << 20
        for index in range(2):
            store[f"new{index}"] = torch.ones(5 << 18)  # 5 MiB: no spare of that size
        assert torch.equal(store["new1"], torch.ones(5 << 18))
        assert backend.spare_bytes() < 12 << 20


def test_a_tier_capacity_counts_recycled_spares(tmp_path: Path) -> None:
    """Spares are disk space too: a tier of 4 MiB never holds more than 4 MiB with them, and a
    put never fails for their sake."""
    tier = Tier("t", open_backend(f"nvme://{tmp_path}"), capacity=4 << 20)
    with TierStore([tier], cache_budget=0) as store:
        backend = tier.paths[0].backend
        assert isinstance(backend, NvmeBackend) and backend.direct
        for index in range(3):
            store[f"old{index}"] = torch.zeros(1 << 18)  # 1 MiB
        for index in range(3):
            del store[f"old{index}"]
        assert tier.spare_bytes() == 3 << 20 and tier.stats()["spare_bytes"] == 3 << 20
        store["new"] = torch.zeros(1 << 19)  # 2 MiB, another size: one spare has to go
        assert tier.used_bytes + tier.spare_bytes() <= 4 << 20
        assert disk_bytes(tmp_path) <= 4 << 20
        store["newer"] = torch.zeros(1 << 19)  # the tier's whole capacity: every spare goes
        assert tier.spare_bytes() == 0 and disk_bytes(tmp_path) == 4 << 20


@pytest.mark.parametrize("probe", [False, True], ids=["configured", "probed"])
def test_a_store_whose_first_tier_is_full_opens_and_serves_reads(
    small_tmpfs: TmpfsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe: bool
) -> None:
    """Not an unwritable path: the O_DIRECT check at open and the bandwidth probe meet ENOSPC, and
    the keys on both tiers stay readable; new objects go to the tier with room."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    full = small_tmpfs("4m")
    config = {
        "cache": {"budget": 0},
        "manifest": str(tmp_path / "manifest"),
        "tiers": [
            {"name": "full", "backend": f"nvme://{full / 'tier'}", "capacity": "1MiB", "probe": probe},
            {"name": "roomy", "backend": f"nvme://{tmp_path / 'roomy'}"},
        ],
    }
    with TierStore.from_config(config) as store:
        store["a"] = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB: the first tier's capacity
        store["b"] = torch.arange(1000)  # on to the second
        assert store.info("a").tier == "full" and store.info("b").tier == "roomy"
    fill_up(full)
    with TierStore.from_config(config) as store:
        assert torch.equal(store["a"], torch.arange(1 << 18, dtype=torch.int32))
        assert torch.equal(store["b"], torch.arange(1000))
        store["c"] = torch.ones(10)
        assert store.info("c").tier == "roomy" and torch.equal(store["c"], torch.ones(10))
