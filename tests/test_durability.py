"""Persistent stores under restarts, crashes and faults; snapshots; fuzzed configs and keys."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import unicodedata
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from tierstore.backends import open_backend
from tierstore.backends.fault import FaultBackend
from tierstore.backends.nvme import NvmeBackend

from tierstore import (
    BackendIOError,
    BufferMismatchError,
    ChecksumError,
    ConfigError,
    InvalidKeyError,
    KeyNotFoundError,
    ManifestError,
    MissingDataError,
    StoreConfig,
    StoreLockedError,
    Tier,
    TierStore,
    export_hdf5,
    import_hdf5,
    load_config,
)
from tierstore.manifest import Manifest
from tierstore.testing import BackendTests

from .conftest import TmpfsFactory
from .helpers import kill_a_crash_writer, persistent, run_child

TESTS = Path(__file__).parent


def samples() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w/bf16": torch.randn(3, 1000).bfloat16(),
        "w/int64": torch.arange(12345, dtype=torch.int64),
        "big/fp32": torch.randn(1 << 19),  # larger than the cache: straight to the tier
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


def two_path_tier(tmp_path: Path) -> dict[str, Any]:
    """A scratch store's config without a cache, over one tier ``v`` of two NVMe paths, ``a`` and
    ``b`` (directories of those names under ``tmp_path``): objects are striped over both."""
    return {
        "cache": {"budget": 0},
        "tiers": [
            {
                "name": "v",
                "paths": [
                    {"name": "a", "backend": f"nvme://{tmp_path / 'a'}"},
                    {"name": "b", "backend": f"nvme://{tmp_path / 'b'}"},
                ],
            }
        ],
    }


def nvme_root(store: TierStore) -> Path:
    backend = store.tiers[0].paths[0].backend
    assert isinstance(backend, NvmeBackend)
    return backend.root


def stored_objects(store: TierStore) -> set[str]:
    """The names of the objects on the store's (single) NVMe tier."""
    return {p.name for p in nvme_root(store).iterdir() if not p.name.startswith(".")}


# -- reopen ---------------------------------------------------------------------------------------
def test_reopen_finds_every_committed_object(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        for key, tensor in samples().items():
            store[key] = tensor
        store["w/bf16"] = samples()["w/bf16"] * 2  # an overwrite: only the new version survives
        del store["scalar"]
    with TierStore.from_config(config) as store:  # dirty cached objects were written back at close
        expected = {**samples(), "w/bf16": samples()["w/bf16"] * 2}
        del expected["scalar"]
        assert sorted(store.keys()) == sorted(expected)
        for key, tensor in expected.items():
            got = store[key]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
        objects = stored_objects(store)
        assert objects == {_name(store, key) for key in expected if store.info(key).extents}


def _name(store: TierStore, key: str) -> str:
    return store.info(key).name or ""


def test_reopen_across_nvme_and_zarr_tiers(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    config["tiers"] = [
        {"name": "nvme", "backend": f"nvme://{tmp_path / 'nvme'}", "capacity": "1MiB"},
        {"name": "zarr", "backend": f"zarr://{tmp_path / 'zarr'}"},
    ]
    data = {f"k{i}": torch.full((100_000,), i, dtype=torch.int32) for i in range(6)}  # 400 kB each
    with TierStore.from_config(config) as store:
        for key, tensor in data.items():
            store.put(key, tensor, cache=False).result()
        assert {store.info(k).tier for k in data} == {"nvme", "zarr"}
    with TierStore.from_config(config) as store:
        assert all(torch.equal(store[k], t) for k, t in data.items())


def test_a_second_opener_is_refused(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config):
        with pytest.raises(StoreLockedError, match="open in another"):
            TierStore.from_config(config)
        child = run_child(
            [
                sys.executable,
                "-c",
                "import sys, json; from tierstore import TierStore; "
                "TierStore.from_config(json.loads(sys.argv[1]))",
                json.dumps(config),
            ],
            timeout=120,
        )
        assert child.returncode != 0 and "StoreLockedError" in child.stderr
    TierStore.from_config(config).close()  # released at close


def test_a_manifest_naming_a_missing_tier_is_a_config_error(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store["x"] = torch.ones(10)
    config["tiers"][0]["name"] = "renamed"
    with pytest.raises(ConfigError, match="tier 'nvme'"):
        TierStore.from_config(config)


# -- checksums and damaged files ----------------------------------------------------------------------
def test_corruption_is_detected_and_names_the_key_and_path(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store.put("victim", torch.arange(50_000, dtype=torch.int32), cache=False).result()
        store.put("bystander", torch.ones(50_000), cache=False).result()
        file = nvme_root(store) / _name(store, "victim")
    with open(file, "r+b") as damaged:
        damaged.seek(12_345)
        byte = damaged.read(1)
        damaged.seek(12_345)
        damaged.write(bytes([byte[0] ^ 0x01]))
    with TierStore.from_config(config) as store:
        with pytest.raises(ChecksumError, match=r"key 'victim'.*path nvme\.0"):
            store.get("victim", cache=False).result()
        assert torch.equal(store["bystander"], torch.ones(50_000))
    with TierStore.from_config({**config, "verify": "off"}) as store:  # explicitly unchecked
        assert int((store["victim"] != torch.arange(50_000, dtype=torch.int32)).sum()) == 1


def test_a_truncated_file_is_a_typed_error(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store.put("cut", torch.ones(100_000), cache=False).result()
        file = nvme_root(store) / _name(store, "cut")
    os.truncate(file, 1000)
    with TierStore.from_config(config) as store, pytest.raises(BackendIOError):
        store.get("cut", cache=False).result()


BACKEND_URLS = {
    "nvme": "nvme://{root}?chunk_bytes=64KiB",
    "zarr": "zarr+file://{root}?chunk_bytes=64KiB",
    "adios2": "adios2://{root}",
}


def remove_backing_object(root: Path, name: str) -> None:
    """Delete an object's file (nvme) or directory (zarr array, ADIOS2 .bp) behind the store's back."""
    for entry in root.iterdir():
        if entry.name in (name, f"{name}.bp"):
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            return
    raise AssertionError(f"no backing object {name} in {root}")


@pytest.mark.parametrize("kind", list(BACKEND_URLS))
def test_a_deleted_backing_object_is_lost_data_not_a_missing_key(tmp_path: Path, kind: str) -> None:
    """``except KeyError`` must not mistake data loss for an absent key, through any read route."""
    root = tmp_path / kind
    config = persistent(tmp_path)
    config["tiers"] = [{"name": kind, "backend": BACKEND_URLS[kind].format(root=root)}]
    value = torch.arange(50_000, dtype=torch.int32)

    def check_lost(read: Any, name: str) -> None:
        where = rf"key 'lost': object {name} on path {kind}\.0 "
        with pytest.raises(MissingDataError, match=where) as caught:
            read()
        assert not isinstance(caught.value, KeyError) and caught.value.errno == errno.ENOENT
        assert str(root) in str(caught.value)  # the directory the object was in

    with TierStore.from_config(config) as store:
        for key in ("lost", "kept"):
            store.put(key, value, cache=False).result()
        name = _name(store, "lost")
        remove_backing_object(root, name)
        for read in (
            lambda: store.get("lost", cache=False).result(),
            lambda: store.get("lost", out=torch.empty_like(value), cache=False).result(),
            lambda: store.get("lost").result(),  # through a cache buffer
            lambda: store.prefetch(["lost"]).result(),
        ):
            check_lost(read, name)
        assert "lost" in store and not store.info("lost").cached
        assert torch.equal(store["kept"], value)
    with TierStore.from_config(config) as store:  # the manifest still lists it after reopen
        assert sorted(store.keys()) == ["kept", "lost"]
        check_lost(lambda: store["lost"], name)
        del store["lost"]  # the way out: forget the lost object
        assert store.keys() == ["kept"] and torch.equal(store["kept"], value)


def test_a_lost_extent_of_a_striped_object_names_its_path(tmp_path: Path) -> None:
    config = two_path_tier(tmp_path)
    with TierStore.from_config(config) as store:
        store["x"] = torch.arange(1 << 18, dtype=torch.int32)
        assert [e["path"] for e in store.info("x").extents] == ["a", "b"]
        next((tmp_path / "b").rglob(_name(store, "x"))).unlink()  # in the store's private directory
        with pytest.raises(MissingDataError, match=rf"key 'x': object {_name(store, 'x')} on path b "):
            store["x"]


# -- crashes ----------------------------------------------------------------------------------------
def test_kill_9_at_random_moments_never_tears_an_object(tmp_path: Path) -> None:
    """20 kills of a writer at random points; after each, every key holds a whole version no newer
    than the last one started, and no garbage file is left behind."""
    config = persistent(tmp_path, budget=0)
    rng = random.Random(7)
    version, seen = 0, 0
    for kill in range(20):
        started = kill_a_crash_writer(config, version, kill, rng.uniform(0.05, 0.6))
        with TierStore.from_config(config) as store:
            for key in store:
                values = store[key]
                assert values.numel() == 4096 + 997 * (int(values[0]) % 300), key
                assert bool((values == values[0]).all()), f"{key} is torn"
                assert int(values[0]) <= started
            seen = max(seen, len(store.keys()))
            referenced = {_name(store, key) for key in store}
            on_disk = stored_objects(store)
            assert on_disk == referenced  # interrupted writes were collected at reopen
        version = started + 1
    assert version > 40 and seen == 8  # the writer made real progress between kills


def test_write_backs_journal_and_delete_off_the_io_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal sync or a stale copy's delete on a backend's I/O thread would stall its queue."""
    threads: dict[str, set[str]] = {"sync": set(), "delete": set()}
    sync, delete = os.fdatasync, NvmeBackend._delete

    def recorded_sync(fd: int) -> None:
        threads["sync"].add(threading.current_thread().name)
        sync(fd)

    def recorded_delete(backend: NvmeBackend, name: str) -> None:
        threads["delete"].add(threading.current_thread().name)
        delete(backend, name)

    monkeypatch.setattr("tierstore.manifest.os.fdatasync", recorded_sync)
    monkeypatch.setattr(NvmeBackend, "_delete", recorded_delete)
    with TierStore.from_config(persistent(tmp_path)) as store:
        for version in range(3):
            store["x"] = torch.full((1000,), version)
            store.flush()  # written back: journaled, and the previous version deleted
        assert int(store["x"][0]) == 2
    assert threads["sync"] and threads["delete"]
    assert not any(name.startswith("tierstore-nvme") for name in threads["sync"] | threads["delete"]), threads


def test_the_journal_stays_bounded_while_the_store_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tierstore.manifest.COMPACT_AFTER", 50)
    config = persistent(tmp_path)
    journal = tmp_path / "manifest" / "journal.jsonl"
    longest = 0
    with TierStore.from_config(config) as store:
        for version in range(400):
            store.put(f"k{version % 10}", torch.full((100,), version), cache=False).result()
            longest = max(longest, len(journal.read_text().splitlines()))
    assert longest <= 50  # without compaction while running: 401 lines before close
    with TierStore.from_config(config) as store:
        assert {key: int(store[key][0]) for key in store} == {f"k{k}": 390 + k for k in range(10)}


def _hold_write_back_journaling(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold a write-back on the completion thread just before it journals its version, for a
    moment or until released: the window in which another operation on the same key can run."""
    reached, release = threading.Event(), threading.Event()
    commit_many = Manifest.commit_many

    def held(manifest: Manifest, entries: Any) -> None:
        if threading.current_thread().name.startswith("tierstore-commit") and not reached.is_set():
            reached.set()
            release.wait(timeout=1.0)  # a correct store makes the other operation wait for this
        commit_many(manifest, entries)

    monkeypatch.setattr(Manifest, "commit_many", held)
    return reached, release


@pytest.mark.parametrize("operation", ["uncached put", "delete"])
def test_a_write_back_racing_a_newer_operation_never_wins_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """A write-back that looked up its key before a newer put or a delete, but journals after it,
    must not leave the manifest naming the old version (which a reopen would bring back)."""
    reached, release = _hold_write_back_journaling(monkeypatch)
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store.put("x", torch.full((1000,), 1.0)).result()  # only in the cache
        flushing = threading.Thread(target=store.flush)
        flushing.start()
        assert reached.wait(timeout=30)
        if operation == "delete":
            store.delete("x")
        else:
            store.put("x", torch.full((1000,), 2.0), cache=False).result()
        release.set()
        flushing.join()
        expected = {} if operation == "delete" else {"x": 2.0}
        assert {key: float(store[key][0]) for key in store} == expected
    with TierStore.from_config(config) as store:
        assert {key: float(store[key][0]) for key in store} == expected
        referenced = {_name(store, key) for key in store}
        assert stored_objects(store) == referenced


def test_a_put_whose_journal_line_fails_keeps_the_old_version_and_leaves_no_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store.put("x", torch.full((1000,), 1.0), cache=False).result()

        def failing(manifest: Manifest, entries: Any) -> None:
            raise BackendIOError(errno.EIO, "journal: injected failure")

        monkeypatch.setattr(Manifest, "commit_many", failing)
        with pytest.raises(BackendIOError, match="injected"):
            store.put("x", torch.full((1000,), 2.0), cache=False).result()
        monkeypatch.undo()
        assert float(store["x"][0]) == 1.0
        assert stored_objects(store) == {_name(store, "x")}
    with TierStore.from_config(config) as store:
        assert float(store["x"][0]) == 1.0


@pytest.mark.parametrize("step", ["snapshot-written", "snapshot-renamed", "journal-truncated"])
def test_a_crash_during_compaction_loses_nothing(tmp_path: Path, step: str) -> None:
    config = persistent(tmp_path)
    child = run_child(
        [sys.executable, str(TESTS / "crash_compactor.py"), json.dumps(config), step], timeout=300
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    done: dict[str, int] = {}
    started: dict[str, int] = {}
    for line in child.stdout.splitlines():
        event, key, version = line.split()
        (done if event == "done" else started)[key] = int(version)
    assert len(done) == 8  # the crash came after every key had a version
    with TierStore.from_config(config) as store:
        assert set(store.keys()) == set(done)
        for key in store:
            values = store[key]
            assert bool((values == values[0]).all()) and values.numel() == 1000 + int(values[0]), key
            assert int(values[0]) in (done[key], started[key]), (
                key
            )  # the last acknowledged, or the one in flight
        referenced = {_name(store, key) for key in store}
        assert stored_objects(store) == referenced


CRASH_AFTER_A_PUT = """
import json, os, sys, torch
from tierstore import TierStore
store = TierStore.from_config(json.loads(sys.argv[1]))
store["after"] = torch.arange(3)
store.flush()  # journaled
os._exit(0)  # a crash: no close, no compaction
"""


def test_a_torn_journal_line_survives_two_crashes(tmp_path: Path) -> None:
    """A crash tears the journal's last line; the next session appends and crashes too. Its lines
    must not follow the torn one (together they would be one damaged line, and the store would
    not open): the torn tail is cut off before anything is appended."""
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store["before"] = torch.ones(3)
    journal = tmp_path / "manifest" / "journal.jsonl"
    with open(journal, "a") as torn:
        torn.write('{"op":"put","key":"lost","ent')
    run_child([sys.executable, "-c", CRASH_AFTER_A_PUT, json.dumps(config)], timeout=120).check_returncode()
    with TierStore.from_config(config) as store:
        assert sorted(store.keys()) == ["after", "before"]
        assert torch.equal(store["after"], torch.arange(3))


def test_a_full_manifest_disk_fails_puts_typed_and_tears_no_line(
    tmp_path: Path, small_tmpfs: TmpfsFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest on a file system that fills up: a put whose journal line cannot be written
    fails with a BackendIOError (ENOSPC), keeps the previous version and leaves no part of a line;
    a compaction that cannot write its snapshot leaves the journal as it is; once there is room
    again, puts work and a reopened store has every acknowledged version."""
    monkeypatch.setattr("tierstore.manifest.COMPACT_AFTER", 4)
    manifest = small_tmpfs("64k") / "manifest"
    config = {**persistent(tmp_path, budget=0), "manifest": str(manifest)}
    with TierStore.from_config(config) as store:
        store["a"] = torch.zeros(3)
        filler = manifest.parent / "filler"
        with open(filler, "wb", buffering=0) as fill, contextlib.suppress(OSError):
            while True:
                fill.write(bytes(512))
        acknowledged = 0.0
        for attempt in range(1, 500):  # the journal's last page fills up (compactions fail on the way)
            try:
                store["a"] = torch.full((3,), float(attempt))
            except BackendIOError as error:
                assert error.errno == errno.ENOSPC
                break
            acknowledged = float(attempt)
        else:
            pytest.fail("the journal never filled its file system")
        with pytest.raises(BackendIOError):
            store["b"] = torch.ones(2)
        assert torch.equal(store["a"], torch.full((3,), acknowledged)) and "b" not in store
        lines = (manifest / "journal.jsonl").read_text().split("\n")
        assert lines[-1] == "" and all(json.loads(line)["op"] for line in lines[:-1])  # none torn
        filler.unlink()
        for version in range(1, 7):
            store["a"] = torch.full((3,), float(version))
            store[f"k{version}"] = torch.ones(version)
    with TierStore.from_config(config) as store:
        assert torch.equal(store["a"], torch.full((3,), 6.0)) and len(store) == 7
        assert not (manifest / "manifest.json.tmp").exists()


def test_a_failed_put_keeps_the_previous_version_across_reopen(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    config["tiers"][0]["backend"] = {"type": "fault", "inner": f"nvme://{tmp_path / 'nvme'}"}
    with TierStore.from_config(config) as store:
        store.put("x", torch.ones(10_000), cache=False).result()
        fault = store.tiers[0].paths[0].backend
        assert isinstance(fault, FaultBackend)
        fault.inject("write", errno.EIO, torn=True)
        with pytest.raises(BackendIOError, match="EIO"):
            store.put("x", torch.zeros(10_000), cache=False).result()
        fault.clear()
    with TierStore.from_config(config) as store:
        assert torch.equal(store["x"], torch.ones(10_000))


# -- faults ---------------------------------------------------------------------------------------
def fault_tier(name: str, inner: str = "dram://") -> Tier:
    return Tier(name, open_backend({"type": "fault", "inner": inner}))


def faults(tier: Tier) -> FaultBackend:
    backend = tier.paths[0].backend
    assert isinstance(backend, FaultBackend)
    return backend


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES])
def test_a_failing_tier_hands_objects_to_the_next(code: int) -> None:
    first, second = fault_tier("first"), fault_tier("second")
    with TierStore([first, second], cache_budget=0) as store:
        faults(first).inject("write", code)
        store["x"] = torch.ones(1000)
        assert store.info("x").tier == "second" and torch.equal(store["x"], torch.ones(1000))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES])
def test_with_no_tier_left_the_error_is_typed_and_nothing_is_lost(code: int) -> None:
    only = fault_tier("only")
    with TierStore([only], cache_budget=0) as store:
        store["x"] = torch.ones(1000)
        faults(only).inject("write", code)
        with pytest.raises(BackendIOError) as raised:
            store["x"] = torch.zeros(1000)
        assert raised.value.errno == code
        faults(only).clear()
        assert torch.equal(store["x"], torch.ones(1000)) and faults(only).list() == [_name(store, "x")]


def test_read_errors_are_typed() -> None:
    only = fault_tier("only")
    with TierStore([only], cache_budget=0) as store:
        store["x"] = torch.ones(1000)
        faults(only).inject("read", errno.EIO, count=1)
        with pytest.raises(BackendIOError, match="EIO"):
            store["x"]
        assert torch.equal(store["x"], torch.ones(1000))  # transient: the next read works


def test_write_back_failure_keeps_the_data_cached_until_flush_succeeds() -> None:
    only = fault_tier("only")
    with TierStore([only], cache_budget=1 << 20) as store:
        store["x"] = torch.ones(1000)
        faults(only).inject("write", errno.ENOSPC)
        with pytest.raises(BackendIOError, match="write-back failed"):
            store.flush()
        assert torch.equal(store["x"], torch.ones(1000))
        faults(only).clear()
        store.flush()
        assert not store.info("x").dirty


def test_a_vanished_path_is_excluded_and_the_tier_keeps_serving(tmp_path: Path) -> None:
    config = two_path_tier(tmp_path)
    with TierStore.from_config(config) as store:
        store["before"] = torch.arange(1 << 18, dtype=torch.int32)  # striped over a and b
        subprocess.run(["rm", "-rf", str(tmp_path / "b")], check=True)
        store["after"] = torch.arange(1 << 18, dtype=torch.int32)  # b fails; rewritten on a alone
        assert [e["path"] for e in store.info("after").extents] == ["a"]
        assert torch.equal(store["after"], torch.arange(1 << 18, dtype=torch.int32))
        with pytest.raises((KeyNotFoundError, BackendIOError)):  # its half on b is gone
            store["before"]


def test_enospc_on_a_real_full_file_system(small_tmpfs: TmpfsFactory) -> None:
    """A 1 MiB tmpfs: the put fails with ENOSPC, the old version stays."""
    mount = small_tmpfs("1m")
    with TierStore([Tier("small", open_backend(f"nvme://{mount}"))], cache_budget=0) as store:
        store["x"] = torch.ones(100_000)  # 400 kB
        with pytest.raises(BackendIOError) as raised:
            store["y"] = torch.ones(200_000)  # 800 kB: no room
        assert raised.value.errno == errno.ENOSPC
        assert "y" not in store and torch.equal(store["x"], torch.ones(100_000))


class TestFaultBackend(BackendTests):
    """With nothing injected, the wrapper honours the backend contract."""

    def open(self, root: Path) -> Any:
        return open_backend({"type": "fault", "inner": f"nvme://{root}?chunk_bytes=65536"})

    def raw_get(self, backend: Any, name: str) -> bytes:
        return (backend.inner.root / name).read_bytes()

    def raw_set(self, backend: Any, name: str, data: bytes) -> None:
        (backend.inner.root / name).write_bytes(data)


# -- snapshots ------------------------------------------------------------------------------------
def test_snapshot_round_trip_into_other_backends(tmp_path: Path) -> None:
    with TierStore.from_config(persistent(tmp_path)) as source:
        for key, tensor in samples().items():
            source[key] = tensor
        assert export_hdf5(source, tmp_path / "snap.h5", metadata={"step": 7}) == len(samples())
    target_config = {"tiers": [{"name": "zarr", "backend": f"zarr://{tmp_path / 'zarr'}"}]}
    with TierStore.from_config(target_config) as target:
        assert import_hdf5(tmp_path / "snap.h5", target) == {"step": 7}
        for key, tensor in samples().items():
            got = target[key]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert got.reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8)), (
                key
            )  # bit for bit
    assert not list(tmp_path.glob(".snap.h5.tmp"))


# -- soak -----------------------------------------------------------------------------------------
def test_soak_eight_threads_against_a_dict_model(tmp_path: Path) -> None:
    seconds = float(os.environ.get("TIERSTORE_SOAK_SECONDS", "8"))
    config = {
        "cache": {"budget": "2MiB"},
        "manifest": str(tmp_path / "manifest"),
        "tiers": [
            {"name": "nvme", "backend": f"nvme://{tmp_path / 'nvme'}?chunk_bytes=64KiB", "capacity": "4MiB"},
            {"name": "zarr", "backend": f"zarr://{tmp_path / 'zarr'}"},
        ],
    }
    mismatches: list[str] = []
    deadline = time.monotonic() + seconds
    models: list[dict[str, torch.Tensor]] = [{} for _ in range(8)]

    def worker(index: int, store: TierStore) -> None:
        rng, model = random.Random(index), models[index]
        while time.monotonic() < deadline:
            key = f"t{index}/k{rng.randrange(12)}"
            action = rng.random()
            if action < 0.45:
                value = torch.full((rng.randrange(1, 150_000),), rng.randrange(1 << 30), dtype=torch.int32)
                store.put(key, value, cache=rng.random() < 0.7).result()
                model[key] = value
            elif action < 0.9:
                if key in model:
                    got = store.get(key, cache=rng.random() < 0.5).result()
                    if not torch.equal(got, model[key]):
                        mismatches.append(key)
                elif key in store:
                    mismatches.append(f"{key} should not exist")
            elif key in model:
                store.delete(key)
                del model[key]

    with TierStore.from_config(config) as store:
        threads = [threading.Thread(target=worker, args=(i, store)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not mismatches
    expected = {k: v for model in models for k, v in model.items()}
    with TierStore.from_config(config) as store:  # and everything survives a reopen
        assert sorted(store.keys()) == sorted(expected)
        assert all(torch.equal(store[k], v) for k, v in expected.items())


# -- fuzzing --------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
config_like = st.fixed_dictionaries(
    {},
    optional={
        "cache": st.dictionaries(st.sampled_from(["budget", "policy", "cache_reads", "x"]), json_values),
        "tiers": st.lists(
            st.dictionaries(
                st.sampled_from(["name", "backend", "paths", "capacity", "placement"]), json_values
            ),
            max_size=3,
        ),
        "workers": json_values,
        "manifest": json_values,
        "verify": json_values,
    },
)


@settings(max_examples=300, deadline=None)
@given(config_like)
def test_config_parser_either_validates_or_names_the_problem(document: dict[str, Any]) -> None:
    try:
        assert isinstance(load_config(document), StoreConfig)
    except ConfigError as error:
        assert "invalid configuration" in str(error) or "expected a mapping" in str(error)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_keys_either_work_or_are_refused(key: str) -> None:
    with TierStore([Tier("ram", open_backend("dram://"))], cache_budget=0) as store:
        try:
            store[key] = torch.ones(1)
        except InvalidKeyError:
            assert (
                not key
                or key.startswith("/")
                or ".." in key.split("/")
                or any(unicodedata.category(c) == "Cc" for c in key)
            )
            return
        assert torch.equal(store[key], torch.ones(1)) and store.keys() == [key]


def test_a_path_that_becomes_very_slow_loses_its_share() -> None:
    def throttled(name: str) -> dict[str, Any]:
        inner = {
            "type": "throttle",
            "inner": "dram://",
            "read_bytes_per_s": "400MB",
            "write_bytes_per_s": "400MB",
        }
        return {"name": name, "backend": inner}

    config = {"cache": {"budget": 0}, "tiers": [{"name": "v", "paths": [throttled("a"), throttled("b")]}]}
    data = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB
    with TierStore.from_config(config) as store:
        for index in range(4):  # written and read back, so both directions are measured
            store[f"warm{index}"] = data
            assert torch.equal(store[f"warm{index}"], data)
        slow = store.tiers[0].paths[1].backend
        slow.set_rates(read=10e6, write=10e6)  # type: ignore[attr-defined]
        for index in range(12):
            store[f"after{index}"] = data
            assert torch.equal(store[f"after{index}"], data)
        share = {e["path"]: e["length"] for e in store.info("after11").extents}
        assert share.get("b", 0) < 0.2 * data.numel() * 4, share  # from about half to a sliver


def test_manifest_files_are_owner_only(tmp_path: Path) -> None:
    with TierStore.from_config(persistent(tmp_path)) as store:
        store["x"] = torch.ones(3)
    manifest = tmp_path / "manifest"
    modes = {p.name: p.stat().st_mode & 0o777 for p in [manifest, *manifest.iterdir()]}
    assert modes == {"manifest": 0o700, "manifest.json": 0o600, "journal.jsonl": 0o600, "lock": 0o600}


def test_damaged_manifests_snapshots_and_fault_requests_are_typed_errors(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store["x"] = torch.ones(3)
    (tmp_path / "manifest" / "manifest.json").write_text("{not json")
    with pytest.raises(BackendIOError, match="not valid JSON"):
        TierStore.from_config(config)
    (tmp_path / "not.h5").write_bytes(b"plain text")
    with (
        TierStore([Tier("ram", open_backend("dram://"))]) as store,
        pytest.raises(BufferMismatchError, match="not a readable HDF5 snapshot"),
    ):
        import_hdf5(tmp_path / "not.h5", store)
    with open_backend({"type": "fault", "inner": "dram://"}) as backend:
        assert isinstance(backend, FaultBackend)
        with pytest.raises(ConfigError, match="operation"):
            backend.inject("rename", errno.EIO)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="True is not an errno"):
            backend.inject("read", True)  # would be EPERM (1)
        with pytest.raises(ConfigError, match="count True is below 1"):
            backend.inject("read", errno.EIO, count=True)


def test_exporting_one_string_of_keys_is_refused(tmp_path: Path) -> None:
    with TierStore([Tier("ram", open_backend("dram://"))]) as store:
        store["layer"] = torch.ones(3)
        with pytest.raises(InvalidKeyError, match=r"keys or None, not 'layer': use \[key\]"):
            export_hdf5(store, tmp_path / "s.h5", keys="layer")
        assert not list(tmp_path.iterdir())


# -- a damaged manifest ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "record",
    [
        {"op": "put", "key": "a", "entry": {}},
        {"op": "put", "key": "a"},
        {
            "op": "put",
            "key": "a",
            "entry": {"shape": [3], "dtype": "float32", "nbytes": "12", "tier": "nvme"},
        },
        {"op": "delete"},
        {"op": "token", "token": 7},
        {"op": "rename", "key": "a"},
        [1, 2],
    ],
    ids=["empty entry", "no entry", "string nbytes", "delete without key", "numeric token", "op", "list"],
)
def test_a_journal_line_that_is_not_a_record_is_a_typed_error_naming_it(
    tmp_path: Path, record: object
) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store["a"] = torch.ones(3)
    journal = tmp_path / "manifest" / "journal.jsonl"
    good = journal.read_text()
    journal.write_text(
        good + json.dumps({"op": "token", "token": "0123abcd"}) + "\n" + json.dumps(record) + "\n"
    )
    with pytest.raises(ManifestError, match=rf"journal {re.escape(str(journal))}: line 2 is damaged"):
        TierStore.from_config(config)
    journal.write_text(good)
    with TierStore.from_config(config) as store:
        assert torch.equal(store["a"], torch.ones(3))


def test_a_snapshot_entry_missing_a_field_is_a_typed_error_naming_the_key(tmp_path: Path) -> None:
    config = persistent(tmp_path)
    with TierStore.from_config(config) as store:
        store["a"] = torch.ones(3)
    snapshot = tmp_path / "manifest" / "manifest.json"
    document = json.loads(snapshot.read_text())
    del document["entries"]["a"]["tier"]
    snapshot.write_text(json.dumps(document))
    with pytest.raises(ManifestError, match=r"manifest\.json is damaged: entries\.a\.tier: Field required"):
        TierStore.from_config(config)


@pytest.mark.parametrize(
    "backend",
    ["nvme://{root}?chunk_bytes=64KiB", "zarr+file://{root}?chunk_bytes=64KiB", "adios2://{root}"],
    ids=["nvme", "zarr", "adios2"],
)
def test_an_entry_that_does_not_fit_its_object_is_refused_on_every_read_path(
    tmp_path: Path, backend: str
) -> None:
    """Shapes edited to need more (or fewer) bytes than the object holds, or extents that hold
    fewer than the entry records: every read is a ManifestError naming the key, never zero-padded
    data, a part-filled ``out`` or a raw error; the key can still be deleted, the others read."""
    config = persistent(tmp_path, backend.format(root=tmp_path / "t"), tier="t")
    values = {
        "packed": torch.arange(5000),  # below pack_below: written back in a pack
        "alone": torch.arange(20000),
        "smaller": torch.arange(20000),
        "short extents": torch.arange(20000),
        "fine": torch.arange(7),
    }
    with TierStore.from_config(config) as store:
        for key, value in values.items():
            store[key] = value
    snapshot = tmp_path / "manifest" / "manifest.json"
    document = json.loads(snapshot.read_text())
    entries = document["entries"]
    assert "pack" in entries["packed"] and "pack" not in entries["alone"]
    entries["packed"]["shape"] = [50000]
    entries["alone"]["shape"] = [200000]
    entries["smaller"]["shape"] = [2000]
    entries["short extents"]["shape"], entries["short extents"]["nbytes"] = [200000], 1600000
    snapshot.write_text(json.dumps(document))
    for cache_budget in ("0", "4MiB"):  # straight from the tier, and through the cache
        with TierStore.from_config({**config, "cache": {"budget": cache_budget}}) as store:
            for key in ("packed", "alone", "smaller", "short extents"):
                shape = tuple(entries[key]["shape"])
                out = torch.full(shape, -1, dtype=torch.int64)
                reads: list[Future[Any]] = [store.get(key), store.get(key, out=out)]
                if cache_budget != "0":
                    reads.append(store.prefetch([key]))
                for read in reads:
                    with pytest.raises(ManifestError, match=f"key {key!r}: the manifest's entry is damaged"):
                        read.result()
                assert bool((out == -1).all())  # not part-filled
            assert torch.equal(store["fine"], values["fine"])
    with TierStore.from_config(config) as store:
        del store["alone"]
        store["alone"] = torch.ones(2)
        assert torch.equal(store["alone"], torch.ones(2))
