"""The DCP storage layer (``tierstore.checkpoint``): round trips bit for bit (a model with AdamW,
FSDP2 over 2 ranks loaded on 1), the drain to a second directory and to a remote tier, retention,
kill -9 during saves and drains, checksums, typed errors.

Processes (ranks, and the ones killed) come from a forkserver that imported torch once."""

from __future__ import annotations

import builtins
import json
import multiprocessing
import os
import random
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from tierstore.backends import register_backend
from tierstore.backends.wrapper import WrapperBackend
from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter, stored_tensors
from tierstore.checkpoint.save_items import SaveItems
from tierstore.checkpoint.tiers import open_tiers
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from tierstore import (
    CheckpointNotFoundError,
    ChecksumError,
    ConfigError,
    InvalidKeyError,
    TierStore,
)
from tierstore.config import load_config

from . import checkpoint_worker as worker
from .helpers import free_port

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def processes() -> ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tierstore.checkpoint", "tests.checkpoint_worker"])
    return context


def run(context: ForkServerContext, target: Callable[..., None], *arguments: Any, ranks: int = 1) -> None:
    """Run ``target(rank, ...)`` on ``ranks`` processes (no rank argument for one) and check that
    each succeeded."""
    children = [
        context.Process(target=target, args=(rank, *arguments) if ranks > 1 else arguments)
        for rank in range(ranks)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0, f"{target.__name__} failed (exit code {child.exitcode})"


def config(root: Path, slow: str | dict[str, Any] | None = None, budget: str = "64KiB") -> dict[str, Any]:
    """A fast tier striped over two directories, and a slow one (another directory by default)."""
    return {
        "cache": {"budget": budget, "pack_below": "4KiB"},
        "tiers": [
            {
                "name": "fast",
                "paths": [
                    {"backend": f"nvme://{root / 'fast0'}?chunk_bytes=65536"},
                    {"backend": f"nvme://{root / 'fast1'}?chunk_bytes=65536"},
                ],
            },
            {
                "name": "slow",
                **(
                    slow
                    if isinstance(slow, dict) and "paths" in slow
                    else {"backend": slow or f"nvme://{root / 'slow'}"}
                ),
            },
        ],
    }


def only(settings: dict[str, Any], tier: str) -> dict[str, Any]:
    """The config with one of its tiers alone (to load from that tier)."""
    return {**settings, "tiers": [t for t in settings["tiers"] if t["name"] == tier]}


def load_steps(settings: dict[str, Any], name: str) -> dict[str, Any]:
    """Load a checkpoint of :func:`worker.step_state` (any step) and return it."""
    state = worker.step_state(-1)
    with TieredStorageReader(settings) as reader:
        load(state, checkpoint_id=name, storage_reader=reader, no_dist=True)
    return state


TIER_DIRECTORIES = ("fast0", "fast1", "slow", "slow1")


def objects_on_disk(root: Path) -> set[str]:
    """The backend objects in the tiers' directories (the stores' manifests, in hidden
    directories, left out)."""
    return {
        path.name
        for directory in TIER_DIRECTORIES
        for path in (root / directory).rglob("*")  # an absent directory yields nothing
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts)
    }


def referenced(settings: dict[str, Any]) -> set[str]:
    """Every backend object the committed checkpoints use (their records and data), on every tier."""
    names: set[str] = set()
    for tier in open_tiers(load_config(settings), writable=False):
        for record in tier.committed().values():
            used = {record.store: ["record"], **record.keys_by_store()}
            for store_name, keys in used.items():
                with tier.open_store(store_name, read_only=True) as store:
                    names |= {store.info(key).name or "" for key in keys}
    return names


# -- round trips ------------------------------------------------------------------------------------
def test_model_and_adamw_round_trip_bit_for_bit(tmp_path: Path) -> None:
    settings = config(tmp_path)
    model, optimizer = worker.model_and_optimizer(seed=0)
    worker.train(model, optimizer, steps=3)
    with TieredStorageWriter(settings) as writer:
        save(
            {"model": model.state_dict(), "optim": optimizer.state_dict()},
            checkpoint_id="tierstore://adamw",
            storage_writer=writer,
        )
        assert writer.checkpoints()["fast"] == ["adamw"]
        writer.wait_durable("tierstore://adamw")
        assert writer.checkpoints() == {"fast": ["adamw"], "slow": ["adamw"]}
    for tier in ("fast", "slow"):  # the nearest tier, then the drained copy alone
        fresh, fresh_optimizer = worker.model_and_optimizer(seed=1)
        worker.train(fresh, fresh_optimizer, steps=1)
        state = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
        with TieredStorageReader(settings if tier == "fast" else only(settings, "slow")) as reader:
            load(state, checkpoint_id="adamw", storage_reader=reader)
            assert reader.tier == tier
        fresh.load_state_dict(state["model"])
        fresh_optimizer.load_state_dict(state["optim"])
        worker.assert_same(
            {"model": model.state_dict(), "optim": optimizer.state_dict()},
            {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()},
        )


def test_strided_tensors_round_trip_whole_and_cut_into_objects(tmp_path: Path) -> None:
    """Transposed tensors (not contiguous), one that fits one data object and one cut into several
    (the budget of 64 KiB makes 16 KiB objects), saved with ``dcp.save`` and ``dcp.async_save``."""
    settings = only(config(tmp_path), "fast")
    saved = {
        "whole": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64).t(),
        "cut": torch.arange(160 * 64, dtype=torch.float32).reshape(160, 64).t(),
    }
    assert not any(tensor.is_contiguous() for tensor in saved.values())
    with TieredStorageWriter(settings) as writer:
        save(saved, checkpoint_id="strided", storage_writer=writer)
        saving = async_save(saved, checkpoint_id="strided-async", storage_writer=writer, no_dist=True)
        assert isinstance(saving, Future)
        saving.result()
    for name in ("strided", "strided-async"):
        loaded = {key: torch.zeros(tensor.shape) for key, tensor in saved.items()}
        with TieredStorageReader(settings) as reader:
            load(loaded, checkpoint_id=name, storage_reader=reader)
        for key, tensor in saved.items():
            worker.assert_same(loaded[key], tensor, f"{name} {key}")


def test_fsdp2_on_two_ranks_loads_on_one(processes: ForkServerContext, tmp_path: Path) -> None:
    """2 ranks save an FSDP2 model with AdamW and load it back on 2 ranks; then one process without
    FSDP loads it (DCP reshards the DTensor shards) and matches the whole state bit for bit."""
    settings = config(tmp_path)
    run(processes, worker.fsdp_save_and_load, 2, free_port(), settings, str(tmp_path), ranks=2)
    assert {path.name for path in tmp_path.glob("rank*.ok")} == {"rank0.ok", "rank1.ok"}
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    model, optimizer = worker.model_and_optimizer(seed=2)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    with TieredStorageReader(only(settings, "slow")) as reader:
        load({"model": model_state, "optim": optimizer_state}, checkpoint_id="fsdp", storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    worker.assert_same(reference, worker.full_state(model, optimizer))


# -- the drain --------------------------------------------------------------------------------------
def test_drain_links_on_one_file_system(tmp_path: Path) -> None:
    """nvme to nvme on one file system, both tiers over two directories: the slow tier's objects
    are hard links of the fast tier's, and stay whole when the fast tier's copies go."""
    slow = {
        "paths": [{"backend": f"nvme://{tmp_path / name}?chunk_bytes=65536"} for name in ("slow", "slow1")]
    }
    settings = config(tmp_path, slow=slow)
    with TieredStorageWriter(settings, keep={"fast": 1}) as writer:
        for step in range(2):
            save(worker.step_state(step), checkpoint_id=f"step-{step}", storage_writer=writer)
            writer.wait_durable()
    slow_files = [
        path for name in ("slow", "slow1") for path in (tmp_path / name).iterdir() if path.is_file()
    ]
    fast = {path.stat().st_ino for name in ("fast0", "fast1") for path in (tmp_path / name).iterdir()}
    linked = [path for path in slow_files if path.stat().st_ino in fast]  # step-1's, still on fast
    assert all(path.stat().st_nlink == 2 for path in linked)
    assert sum(path.stat().st_size for path in linked) >= worker.step_state(1)["large"].nbytes
    worker.assert_same(load_steps(only(settings, "slow"), "step-0"), worker.step_state(0))


def test_drain_to_the_remote_tier(tmp_path: Path, remote_mount: Path) -> None:
    """The slow tier is Zarr on a network file system: the drain goes through memory, checked."""
    remote = remote_mount / f"tierstore-checkpoint-{uuid.uuid4().hex[:8]}"
    try:
        settings = config(tmp_path, slow=f"zarr+file://{remote}?chunk_bytes=65536")
        with TieredStorageWriter(settings) as writer:
            save(worker.step_state(5), checkpoint_id="remote", storage_writer=writer)
            writer.wait_durable("remote")
            assert writer.checkpoints()["slow"] == ["remote"]
        worker.assert_same(load_steps(only(settings, "slow"), "remote"), worker.step_state(5))
    finally:
        shutil.rmtree(remote, ignore_errors=True)


def test_async_save_killed_during_its_drain(processes: ForkServerContext, tmp_path: Path) -> None:
    """``async_save`` commits on the fast tier, and the process dies while draining to a slow tier:
    the fast copy loads; a new writer collects the dead drain's objects and drains again."""
    slowed = {"type": "throttle", "inner": f"nvme://{tmp_path / 'slow'}", "write_bytes_per_s": "2MB"}
    settings = config(tmp_path, slow=slowed)

    def slow_objects() -> set[str]:
        return {path.name for path in (tmp_path / "slow").iterdir() if path.is_file()}

    child = processes.Process(target=worker.async_save_then_drain, args=(settings, str(tmp_path)))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "committed").exists() or not objects_on_disk(tmp_path) & slow_objects():
            assert child.is_alive() and time.monotonic() < deadline, "the drain never started"
            time.sleep(0.01)
        assert not (tmp_path / "durable").exists()
    finally:
        child.kill()
        child.join()
    expected = worker.step_state(7)
    worker.assert_same(load_steps(settings, "tierstore://async"), expected)
    with TieredStorageReader(settings) as reader:
        assert reader.checkpoints() == {"fast": ["async"], "slow": []}
    restarted = config(tmp_path)  # the same directories, not slowed down
    with TieredStorageWriter(restarted) as writer:
        assert not slow_objects()  # the dead drain's copies, collected
        assert not list((tmp_path / "slow" / ".checkpoints").glob("d-*"))
        writer.drain()
        assert writer.checkpoints()["slow"] == ["async"]
    worker.assert_same(load_steps(only(restarted, "slow"), "async"), expected)


def test_kill_during_saves_keeps_the_previous_checkpoint(
    processes: ForkServerContext, tmp_path: Path
) -> None:
    """10 times: a process saving checkpoints one after another (draining and deleting old ones
    meanwhile) is killed at a random moment. Every checkpoint committed on any tier loads whole
    (each holds its own step everywhere), the last one whose save returned is among them, and
    the next writer collects every leftover."""
    settings = config(tmp_path)
    chance = random.Random(31)
    first = 0
    for _ in range(10):
        saved = tmp_path / "saved"
        saved.unlink(missing_ok=True)
        child = processes.Process(target=worker.save_forever, args=(settings, str(tmp_path), first))
        child.start()
        deadline = time.monotonic() + 60
        while not saved.exists():
            assert child.is_alive() and time.monotonic() < deadline, "no save returned"
            time.sleep(0.005)
        time.sleep(chance.uniform(0.0, 0.3))
        child.kill()
        child.join()
        last = int(saved.read_text())
        with TieredStorageReader(settings) as reader:
            held = reader.checkpoints()
        assert f"step-{last}" in held["fast"] + held["slow"]
        for tier, names in held.items():
            for name in names:
                step = int(name.removeprefix("step-"))
                worker.assert_same(load_steps(only(settings, tier), name), worker.step_state(step), name)
        first = last + 100  # names never reused: a torn save must not pass for an older whole one
    with TieredStorageWriter(settings):
        assert objects_on_disk(tmp_path) == referenced(settings)


def test_retention_keeps_what_it_says(tmp_path: Path) -> None:
    settings = config(tmp_path)
    with TieredStorageWriter(settings, keep={"fast": 2, "slow": 3}) as writer:
        for step in range(6):
            save(worker.step_state(step), checkpoint_id=f"step-{step}", storage_writer=writer)
            writer.wait_durable()
        assert writer.checkpoints() == {"fast": ["step-4", "step-5"], "slow": ["step-3", "step-4", "step-5"]}
        assert objects_on_disk(tmp_path) == referenced(settings)  # the rest is deleted, not only forgotten
        save(worker.step_state(9), checkpoint_id="step-4", storage_writer=writer)  # a name saved again
        writer.wait_durable()
        assert writer.checkpoints() == {"fast": ["step-5", "step-4"], "slow": ["step-3", "step-5", "step-4"]}
        assert objects_on_disk(tmp_path) == referenced(settings)
    worker.assert_same(load_steps(settings, "step-4"), worker.step_state(9))


def test_two_writers_with_default_arguments_on_one_config_keep_apart(tmp_path: Path) -> None:
    """Two writers on the same tiers (two jobs, or two in one process) each save into a store of
    their own: their checkpoints all load, and a name both save is the later save's on every tier,
    though its drain ends first (the slow tier takes 2 MB/s: the earlier save is larger). Once
    both close, nothing is left that no checkpoint uses."""
    slowed = {"type": "throttle", "inner": f"nvme://{tmp_path / 'slow'}", "write_bytes_per_s": "2MB"}
    settings = config(tmp_path, slow=slowed)
    larger = {**worker.step_state(3), "extra": torch.zeros(1 << 18)}  # 1 MiB more to drain
    with TieredStorageWriter(settings) as first, TieredStorageWriter(settings) as second:
        save(larger, checkpoint_id="shared", storage_writer=first)  # its drain starts at once
        save(worker.step_state(4), checkpoint_id="shared", storage_writer=second)
        save(worker.step_state(1), checkpoint_id="first", storage_writer=first)
        save(worker.step_state(2), checkpoint_id="second", storage_writer=second)
        first.wait_durable()
        second.wait_durable()
    for name, step in (("first", 1), ("second", 2), ("shared", 4)):
        worker.assert_same(load_steps(settings, name), worker.step_state(step), name)
    worker.assert_same(load_steps(only(settings, "slow"), "shared"), worker.step_state(4), "slow")
    with TieredStorageWriter(config(tmp_path)):
        assert objects_on_disk(tmp_path) == referenced(settings)


def test_data_deleted_from_a_store_another_writer_holds_goes_when_that_writer_closes(tmp_path: Path) -> None:
    """A writer saves a name again that another writer, still open, saved: the older save leaves
    both tiers, but its data stays in the other writer's store, marked, until that writer closes;
    then nothing is left that no checkpoint uses, without a writer opening to collect it."""
    settings = config(tmp_path)
    held = TieredStorageWriter(settings)
    try:
        save(worker.step_state(1), checkpoint_id="shared", storage_writer=held)
        held.wait_durable()
        with TieredStorageWriter(settings) as writer:
            save(worker.step_state(2), checkpoint_id="shared", storage_writer=writer)
            writer.wait_durable()
        assert list((tmp_path / "fast0" / ".checkpoints").glob("u-*"))
        assert objects_on_disk(tmp_path) != referenced(settings)
    finally:
        held.close()
    assert objects_on_disk(tmp_path) == referenced(settings)
    worker.assert_same(load_steps(settings, "shared"), worker.step_state(2))


class CountingBackend(WrapperBackend):
    """Another backend, counting the listings, existence checks and reads made through it (every
    instance together: a store opened is a backend opened)."""

    scheme = "counting"
    calls: ClassVar[Counter[str]] = Counter()

    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        return self.inner.write(name, offset, data)

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        self.calls["read"] += 1
        return self.inner.read_into(name, offset, out)

    def _exists(self, name: str) -> bool:
        self.calls["exists"] += 1
        return super()._exists(name)

    def _list(self) -> builtins.list[str]:
        self.calls["list"] += 1
        return super()._list()


register_backend(CountingBackend)


@pytest.mark.parametrize("durable", ["nvme", "zarr+file"])
def test_opening_a_writer_costs_the_same_with_20_checkpoints_held_as_with_3(
    tmp_path: Path, durable: str
) -> None:
    """Writers save 3 checkpoints, then 17 more, and close. Opening the next writer, and a reader
    of one checkpoint, makes as many backend listings, existence checks and reads with 20 held on
    the durable tier as with 3: neither reads another checkpoint's record nor opens its stores
    (a writable open of one lists the whole tier). A session that ended without cleaning up is
    collected by the next writer, once."""

    def counted(url: str) -> dict[str, Any]:
        return {"backend": {"type": "counting", "inner": url}}

    settings = {
        "cache": {"budget": "64KiB", "pack_below": "4KiB"},
        "tiers": [
            {"name": "fast", **counted(f"nvme://{tmp_path / 'fast'}")},
            {"name": "slow", **counted(f"{durable}://{tmp_path / 'slow'}?chunk_bytes=65536")},
        ],
    }

    def calls(opening: Callable[[], TieredStorageWriter | TieredStorageReader]) -> Counter[str]:
        CountingBackend.calls.clear()
        opening().close()
        return Counter(CountingBackend.calls)

    state = {"x": torch.arange(8.0)}
    writer_calls: dict[int, Counter[str]] = {}
    reader_calls: dict[int, Counter[str]] = {}
    for held in (3, 20):
        with TieredStorageWriter(settings) as writer:
            for step in range(3 if held == 20 else 0, held):
                save(state, checkpoint_id=f"step-{step}", storage_writer=writer)
        writer_calls[held] = calls(lambda: TieredStorageWriter(settings))
        reader_calls[held] = calls(lambda: TieredStorageReader(settings, "step-0"))  # on "slow" alone
    assert writer_calls[3] == writer_calls[20], writer_calls
    assert reader_calls[3] == reader_calls[20], reader_calls
    (tmp_path / "slow" / ".checkpoints" / "s-0123abcd.lock").touch()  # as a writer that died leaves it
    assert calls(lambda: TieredStorageWriter(settings))["read"] >= 20  # every record read, to collect it
    assert calls(lambda: TieredStorageWriter(settings)) == writer_calls[20]
    with TieredStorageReader(settings) as reader:
        assert reader.checkpoints() == {
            "fast": ["step-18", "step-19"],
            "slow": [f"step-{n}" for n in range(20)],
        }


def test_store_objects_are_linked_into_the_checkpoint_and_loaded_back(tmp_path: Path) -> None:
    """An offloaded optimizer's state lives in a store on the same file system: the save hard-links
    its files (no byte read), the store then replaces them, and the load puts the saved ones back."""
    settings = config(tmp_path)
    state_tier = {"name": "state", "backend": f"nvme://{tmp_path / 'state'}"}
    generator = torch.Generator().manual_seed(5)
    saved = {f"adamw/{index}": torch.randn(20_000 + index, generator=generator) for index in range(3)}
    with TierStore.from_config({"manifest": str(tmp_path / "manifest"), "tiers": [state_tier]}) as store:
        for key, value in saved.items():
            store.put(key, value).result()  # still dirty in the store's cache: the save writes it back
        with TieredStorageWriter(settings) as writer:
            state = {"optimizer": stored_tensors(store, saved), "step": 3}
            save(state, checkpoint_id="offloaded", storage_writer=writer)
            writer.wait_durable()
        store_files = {path.stat().st_ino for path in (tmp_path / "state").iterdir() if path.is_file()}
        fast_files = {path.stat().st_ino for path in tmp_path.glob("fast*/*") if path.is_file()}
        assert len(store_files) == 3 and store_files <= fast_files
        for key, value in saved.items():  # the optimizer steps on: new versions, the old ones deleted
            store.put(key, torch.zeros_like(value)).result()
        store.flush()
        state = {"optimizer": stored_tensors(store, saved), "step": 0}
        with TieredStorageReader(only(settings, "slow")) as reader:
            load(state, checkpoint_id="offloaded", storage_reader=reader)
        assert state["step"] == 3
        for key, value in saved.items():
            worker.assert_same(store[key], value, key)


# -- staging ----------------------------------------------------------------------------------------
def test_async_staging_holds_its_budget_and_writes_only_planned_items(tmp_path: Path) -> None:
    """12 x 64 KiB through a 64 KiB cache: spilled to the fast tier as it fills, never holding more
    than the budget; the items the plan leaves out (another rank's) are deleted."""
    (fast, _) = open_tiers(load_config(config(tmp_path)), writable=True)
    with fast.open_store(fast.new_store_name(), cache_budget=64 << 10, pack_below=4096) as store:
        staging = SaveItems(store, "d-test", "save", key_bytes=16 << 10, copy=True)
        staging.add("fits", torch.arange(2000, dtype=torch.int32))  # 8000 bytes: stays in DRAM
        staging.wait()
        assert not objects_on_disk(tmp_path)
        for index in range(12):
            staging.add(f"big{index}", torch.full((16384,), index, dtype=torch.int32))
        staging.wait()
        assert objects_on_disk(tmp_path) and store.stats()["peak_cache_bytes"] <= 64 << 10
        written = staging.write(["fits", "big3"])  # the plan gave the rest to another rank
        assert set(written) == {"fits", "big3"} and len(written["big3"]["keys"]) == 4
        assert sorted(store.keys()) == sorted(written["fits"]["keys"] + written["big3"]["keys"])
        assert len(objects_on_disk(tmp_path)) == len({store.info(key).name for key in store})
        for key in written["big3"]["keys"]:
            assert torch.equal(store[key], torch.full((4096,), 3, dtype=torch.int32))
    fast.close()


# -- errors -----------------------------------------------------------------------------------------
def test_a_corrupted_object_raises_checksum_error_naming_checkpoint_and_key(tmp_path: Path) -> None:
    settings = only(config(tmp_path), "fast")
    with TieredStorageWriter(settings) as writer:
        save({"weights": torch.arange(50_000.0)}, checkpoint_id="broken", storage_writer=writer)
    victim = max(
        (path for path in tmp_path.glob("fast*/*") if path.is_file()), key=lambda path: path.stat().st_size
    )
    with open(victim, "r+b") as medium:
        medium.seek(100)
        byte = medium.read(1)
        medium.seek(100)
        medium.write(bytes([byte[0] ^ 0xFF]))
    state = {"weights": torch.zeros(50_000)}
    with TieredStorageReader(settings) as reader, pytest.raises(CheckpointException) as caught:
        load(state, checkpoint_id="broken", storage_reader=reader)
    error = caught.value.failures[0][0]
    assert isinstance(error, ChecksumError)
    assert "tierstore://broken" in str(error) and "'weights'" in str(error) and victim.name in str(error)


def test_an_unknown_checkpoint_id_is_a_typed_error(tmp_path: Path) -> None:
    settings = config(tmp_path)
    with TieredStorageWriter(settings) as writer:
        save({"x": torch.ones(3)}, checkpoint_id="present", storage_writer=writer)
    state = {"x": torch.zeros(3)}
    with TieredStorageReader(settings) as reader:
        with pytest.raises(CheckpointNotFoundError, match=r"tierstore://absent.*fast: present"):
            load(state, checkpoint_id="tierstore://absent", storage_reader=reader)
        with pytest.raises(InvalidKeyError, match="checkpoint id '/not/a/name'"):
            reader.reset("/not/a/name")
    with pytest.raises(CheckpointNotFoundError, match="any checkpoint"):
        TieredStorageReader(config(tmp_path / "empty")).read_metadata()
    assert TieredStorageWriter.validate_checkpoint_id("tierstore://step-1")
    assert not TieredStorageReader.validate_checkpoint_id("/some/path")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"keep": {"nope": 1}}, "keep.nope"),
        ({"keep": {"fast": 0}}, "keep.fast"),
        ({"budget": "8KiB"}, "cache.budget"),
        ({"slow": "dram://"}, "tier 'slow'"),
    ],
)
def test_bad_settings_name_the_field(tmp_path: Path, change: dict[str, Any], field: str) -> None:
    settings = config(tmp_path, slow=change.get("slow"), budget=change.get("budget", "64KiB"))
    with pytest.raises(ConfigError, match=field):
        TieredStorageWriter(settings, keep=change.get("keep"))


def test_a_config_file_works_where_a_dict_does(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints.json"
    path.write_text(json.dumps(config(tmp_path)))
    with TieredStorageWriter(path) as writer:
        save({"x": torch.ones(2)}, checkpoint_id="file", storage_writer=writer)
    assert os.listdir(tmp_path / "fast0")


@pytest.fixture(autouse=True)
def _no_session_left(tmp_path: Path) -> Iterator[None]:
    """Every writer ends its session: no session lock, and no mark of a deletion, outlives the
    test's writers."""
    yield
    assert not list(tmp_path.rglob("s-*.lock*"))
    assert not [path for path in tmp_path.rglob(".checkpoints/*") if path.name[:2] in ("x-", "u-")]
