"""Stores sharing a directory keep their files apart, and what a killed store leaves is collected.

The kills are real: ``tests/crash_holder.py`` runs a store in a child process and gets ``kill -9``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.backends import open_backend
from tierstore.backends.nvme import NvmeBackend

from tierstore import TierStore

TESTS = Path(__file__).parent
PRIVATE = re.compile(r"\.(spares|scratch|writing)-[0-9a-f]{16}")
SHARED_MEMORY = Path("/dev/shm")


def private_directories(root: Path) -> set[str]:
    """The private directories backend instances keep in ``root`` (spares, scratch, writes)."""
    return {entry.name for entry in root.iterdir() if PRIVATE.fullmatch(entry.name)}


def backing_file(store: TierStore, key: str) -> Path:
    backend = store.tiers[0].paths[0].backend
    assert isinstance(backend, NvmeBackend)
    name = store.info(key).name
    assert name is not None
    return backend.root / name


# -- two stores, one directory ----------------------------------------------------------------------
@pytest.mark.parametrize("persistent", [False, True], ids=["scratch", "persistent"])
def test_two_stores_on_one_directory_keep_their_files_apart(tmp_path: Path, persistent: bool) -> None:
    """Interleaved overwrites and deletes, 2 MiB objects in one store and 1 MiB in the other: every
    file is exactly its object's size, and every object reads back (also after reopening)."""
    directory = tmp_path / "shared"

    def config(name: str) -> dict[str, Any]:
        tier = {"name": "nvme", "backend": f"nvme://{directory}?chunk_bytes=64KiB"}
        manifest = {"manifest": str(tmp_path / f"manifest-{name}")} if persistent else {}
        return {"cache": {"budget": 0}, "tiers": [tier], **manifest}

    elements = {"a": (2 << 20) // 4, "b": (1 << 20) // 4}
    stores = {name: TierStore.from_config(config(name)) for name in elements}
    expected: dict[tuple[str, str], torch.Tensor] = {}
    rng = random.Random(3)
    try:
        for step in range(12):
            for name, store in stores.items():
                key = f"k{rng.randrange(3)}"
                if (name, key) in expected and rng.random() < 0.25:
                    del store[key]
                    del expected[name, key]
                else:
                    store[key] = expected[name, key] = torch.full((elements[name],), step, dtype=torch.int32)
            for (name, key), value in expected.items():
                assert backing_file(stores[name], key).stat().st_size == value.nbytes, (step, name, key)
                assert torch.equal(stores[name][key], value), (step, name, key)
    finally:
        for store in stores.values():
            store.close()
    if persistent:
        for name in elements:
            with TierStore.from_config(config(name)) as store:
                mine = {key: value for (owner, key), value in expected.items() if owner == name}
                assert sorted(store.keys()) == sorted(mine)
                assert all(torch.equal(store[key], value) for key, value in mine.items())


@pytest.mark.parametrize("scheme", ["nvme", "zarr", "adios2"])
def test_scratch_objects_are_private_and_removed_at_close(tmp_path: Path, scheme: str) -> None:
    """Two backends on one directory, one of them a scratch store's: the same object name holds
    two objects, neither sees the other's, and another opener leaves the live scratch alone."""
    url = f"{scheme}://{tmp_path}"
    with open_backend(url) as kept, open_backend(url) as scratch:
        scratch.claim_scratch()
        scratch.write("obj", 0, b"scratch").result()
        kept.write("obj", 0, b"kept").result()
        open_backend(url).close()  # collects abandoned directories only
        for backend, expected in ((kept, b"kept"), (scratch, b"scratch")):
            out = bytearray(backend.size("obj"))
            backend.read_into("obj", 0, out).result()
            assert bytes(out) == expected and backend.list() == ["obj"]
    left = {path.name for path in tmp_path.iterdir()} - {"zarr.json"}  # zarr's root group
    assert left == {"obj.bp" if scheme == "adios2" else "obj"}


def test_concurrent_opens_of_one_directory_never_fail(tmp_path: Path) -> None:
    """Each opener proves the directory writable with a probe file of its own."""

    def open_and_close(opener: int) -> None:
        for _ in range(25):
            open_backend(f"nvme://{tmp_path}").close()

    with ThreadPoolExecutor(8) as openers:
        list(openers.map(open_and_close, range(8)))  # raises what an opener raised
    assert list(tmp_path.iterdir()) == []


# -- leftovers of killed stores -----------------------------------------------------------------------
def three_backends(tmp_path: Path, manifest: str | None) -> dict[str, Any]:
    """One tier striping every object over nvme, zarr and adios2, each in its own directory."""
    paths = [
        {"name": "nvme", "backend": f"nvme://{tmp_path / 'nvme'}?chunk_bytes=64KiB"},
        {"name": "zarr", "backend": f"zarr://{tmp_path / 'zarr'}?chunk_bytes=1MiB"},
        {"name": "adios2", "backend": f"adios2://{tmp_path / 'adios2'}"},
    ]
    config: dict[str, Any] = {"cache": {"budget": 0}, "tiers": [{"name": "v", "paths": paths}]}
    if manifest is not None:
        config["manifest"] = str(tmp_path / manifest)
    return config


def start_child(config: dict[str, Any], mode: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, str(TESTS / "crash_holder.py"), json.dumps(config), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def kill_and_collect_stderr(child: subprocess.Popen[str]) -> str:
    """``kill -9`` the child; its stderr once every process holding it (its workers too) has ended."""
    child.send_signal(signal.SIGKILL)
    _, stderr = child.communicate(timeout=60)
    return stderr


def wait_for(condition: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


def adios2_writes_in_flight(root: Path) -> list[Path]:
    """The ``.bp`` directories being written under ``root`` (their names change meanwhile)."""
    try:
        return list(root.rglob(".writing-*/*.bp"))
    except FileNotFoundError:  # renamed into place while we looked
        return []


def put_and_overwrite(store: TierStore) -> dict[str, torch.Tensor]:
    """Objects of a live store, with recycled files and an ADIOS2 write directory of its own."""
    values = {}
    for version in range(3):
        for key in ("live0", "live1"):
            values[key] = torch.full((300_000,), version, dtype=torch.int32)
            store.put(key, values[key], cache=False).result()
    return values


@pytest.mark.parametrize("persistent", [False, True], ids=["scratch", "persistent"])
def test_a_killed_store_leaves_nothing_behind_and_a_live_one_keeps_its_files(
    tmp_path: Path, persistent: bool
) -> None:
    """A store killed in the middle of a put left a private directory in each path (a scratch
    store's objects; or nvme's recycled files and ADIOS2's half-written object); the next store
    on those directories removes them, while a store open all along keeps all of its files."""
    killed_config = three_backends(tmp_path, "manifest" if persistent else None)
    live_config = three_backends(tmp_path, "live-manifest" if persistent else None)
    roots = [tmp_path / name for name in ("nvme", "zarr", "adios2")]
    with TierStore.from_config(live_config) as live:
        live_values = put_and_overwrite(live)
        live_private = {root: private_directories(root) for root in roots}
        child = start_child(killed_config, "loop")
        nvme, adios2 = tmp_path / "nvme", tmp_path / "adios2"

        def killed_store_is_mid_put() -> bool:
            """An ADIOS2 write of the child in flight (and, if persistent, recycled nvme files)."""
            writing = {path.relative_to(adios2).parts[0] for path in adios2_writes_in_flight(adios2)}
            recycled = not persistent or private_directories(nvme) - live_private[nvme]
            return bool(writing - live_private[adios2]) and bool(recycled)

        wait_for(killed_store_is_mid_put, "the killed store's ADIOS2 write")
        stderr = kill_and_collect_stderr(child)
        assert "Traceback" not in stderr, stderr  # the orphaned ADIOS2 worker went quietly
        abandoned = {root: private_directories(root) - live_private[root] for root in roots}
        expected_kinds = {"scratch"} if not persistent else {"spares", "writing"}
        left_kinds = {name[1:].split("-")[0] for names in abandoned.values() for name in names}
        assert left_kinds == expected_kinds, abandoned

        with TierStore.from_config(killed_config) as reopened:
            if persistent:
                for key in reopened:
                    values = reopened[key]
                    assert bool((values == values[0]).all()), f"{key} is torn"
        for root in roots:
            assert private_directories(root) == live_private[root], root
        assert all(torch.equal(live[key], value) for key, value in live_values.items())
    left = {root.name: sorted(entry.name for entry in root.iterdir()) for root in roots}
    if persistent:
        assert all(not name.startswith(".") for names in left.values() for name in names), left
    else:
        assert left == {"nvme": [], "zarr": [], "adios2": []}


def child_processes(pid: int) -> set[int]:
    """Processes started by any thread of ``pid`` (the ADIOS2 worker comes from a dispatch thread)."""
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children.update(int(child) for child in (task / "children").read_text().split())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return children


def has_ended(pid: int) -> bool:
    """Exited: gone, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def shared_memory_slots() -> set[str]:
    return {path.name for path in SHARED_MEMORY.glob("tierstore-adios2-*")}


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task").is_dir(), reason="needs Linux /proc")
def test_a_kill_during_adios2_worker_start_up_leaves_no_shared_memory_and_no_traceback(
    tmp_path: Path,
) -> None:
    """The store's process dies while its ADIOS2 worker is still starting: nothing is left in
    /dev/shm, and the orphaned worker exits without printing into the terminal."""
    before = shared_memory_slots()
    child = start_child({"tiers": [{"name": "a", "backend": f"adios2://{tmp_path}"}]}, "start")
    (worker,) = wait_for(lambda: child_processes(child.pid), "the ADIOS2 worker to start")
    stderr = kill_and_collect_stderr(child)  # returns once the worker, which shares it, has exited
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    wait_for(lambda: has_ended(worker), "the orphaned worker to exit", 10)
    time.sleep(1)  # other processes' slots live well under a second; a leaked one stays
    assert not (shared_memory_slots() - before)
    with TierStore.from_config({"tiers": [{"name": "a", "backend": f"adios2://{tmp_path}"}]}) as store:
        store["x"] = torch.ones(10)
    assert list(tmp_path.iterdir()) == []
