"""Many objects: per-object costs stay flat as the count grows (issue 11)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.backends import open_backend

from tierstore import ChecksumError, Tier, TierStore, limits

from .helpers import kill_a_crash_writer, map_count, persistent


def flush_comparisons_per_object(count: int, pack_below: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """Request comparisons the path schedulers make per object to flush ``count`` dirty 64-byte
    objects to a DRAM tier: a count, not a time, so a loaded machine cannot change the verdict."""
    compared = 0
    original = limits._Request.__lt__

    def counting(self: limits._Request, other: limits._Request) -> bool:
        nonlocal compared
        compared += 1
        return original(self, other)

    tier = Tier("dram", open_backend("dram://"))
    with TierStore([tier], cache_budget=1 << 30, pack_below=pack_below) as store:
        puts = [store.put(f"k{index}", torch.full((16,), index, dtype=torch.int32)) for index in range(count)]
        for put in puts:
            put.result()
        with monkeypatch.context() as patch:
            patch.setattr(limits._Request, "__lt__", counting)
            store.flush()
    return compared / count


@pytest.mark.parametrize("pack_below", [0, 64 << 10], ids=["one-write-each", "packed"])
def test_flush_cost_per_object_does_not_grow_with_the_count(
    pack_below: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sorting a path's whole queue on every dispatch made 6x the objects cost several times more
    each (one write per object: every object queues at the path's scheduler); a heap costs
    O(log n) comparisons per request."""
    large = flush_comparisons_per_object(6_000, pack_below, monkeypatch)
    assert large <= 4 * math.log2(6_000), f"{large:.0f} comparisons per object at 6k"


def test_cached_small_objects_do_not_cost_a_map_each() -> None:
    """Each cached object had its own mmap, so ~65k of them exhausted vm.max_map_count."""
    with TierStore([Tier("dram", open_backend("dram://"))], cache_budget=1 << 30) as store:
        before = map_count()
        puts = [store.put(f"k{i}", torch.full((16,), i, dtype=torch.int32)) for i in range(20_000)]
        for put in puts:
            put.result()
        stats = store.stats()
        assert map_count() - before < 64
        assert stats["cache_bytes"] <= stats["cache_budget_bytes"] and stats["evictions"] == 0
        assert torch.equal(store["k12345"], torch.full((16,), 12345, dtype=torch.int32))


# -- packs: small objects share backend objects ---------------------------------------------------
BACKENDS = {
    "nvme": "nvme://{root}?chunk_bytes=64KiB",
    "zarr": "zarr+file://{root}?chunk_bytes=64KiB",
    "adios2": "adios2://{root}",
}


def small(index: int) -> torch.Tensor:
    """Objects of 4 to 1,000 bytes whose values name their key."""
    return torch.full((1 + index % 250,), index, dtype=torch.int32)


def packing(tmp_path: Path, backend: str = "nvme", **cache: object) -> dict[str, Any]:
    """A persistent store over one tier named ``tier`` of the ``backend`` in :data:`BACKENDS`
    (in ``tmp_path / backend``): its 64 MiB cache holds thousands of small objects until a flush
    writes them back in packs. ``cache``: other ``[cache]`` settings (``pack_below``)."""
    url = BACKENDS[backend].format(root=tmp_path / backend)
    return persistent(tmp_path, url, tier="tier", budget="64MiB", **cache)


def backend_objects(store: TierStore) -> list[str]:
    return store.tiers[0].paths[0].backend.list()


def all_files(root: Path) -> int:
    return sum(1 for path in root.rglob("*") if path.is_file() and not path.name.startswith("."))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_many_small_objects_take_few_files_and_reopen_whole(tmp_path: Path, backend: str) -> None:
    """One file (nvme), two (zarr) or four (adios2) per object before; now one pack per batch."""
    pytest.importorskip({"nvme": "tierstore", "zarr": "zarr", "adios2": "adios2"}[backend])
    config = packing(tmp_path, backend)
    with TierStore.from_config(config) as store:
        for put in [store.put(f"k{index}", small(index)) for index in range(2000)]:
            put.result()
        store.put("large", torch.arange(50_000, dtype=torch.int32)).result()  # over pack_below
        store.flush()
        assert len(backend_objects(store)) == 2  # one pack of 2,000 objects and the large one
    assert all_files(tmp_path / backend) < 30
    with TierStore.from_config(config) as store:
        assert len(store) == 2001
        for index in range(0, 2000, 7):
            assert torch.equal(store.get(f"k{index}", cache=False).result(), small(index))
        assert torch.equal(store["large"], torch.arange(50_000, dtype=torch.int32))
        assert store.info("k5").extents and store.info("k5").tier == "tier"


def test_deleting_every_member_frees_the_pack(tmp_path: Path) -> None:
    config = packing(tmp_path)
    with TierStore.from_config(config) as store:
        for index in range(100):
            store[f"k{index}"] = small(index)
        store.flush()
        (pack,) = backend_objects(store)
        for index in range(99):
            del store[f"k{index}"]
        store["k50"] = small(50)  # a new version, in the cache only
        assert backend_objects(store) == [pack]  # k99 still lives in it
    with TierStore.from_config(config) as store:  # closing wrote k50 back as an object of its own
        assert sorted(store.keys()) == ["k50", "k99"] and len(backend_objects(store)) == 2
        assert torch.equal(store["k99"], small(99)) and torch.equal(store["k50"], small(50))
        del store["k99"]
        assert pack not in backend_objects(store)
        assert store.tiers[0].used_bytes == small(50).nbytes


def test_a_damaged_pack_names_the_key(tmp_path: Path) -> None:
    config = packing(tmp_path, pack_below="4KiB")
    with TierStore.from_config(config) as store:
        for index in range(10):
            store[f"k{index}"] = small(index)
        store.flush()
        (pack,) = backend_objects(store)
    with open(tmp_path / "nvme" / pack, "r+b") as damaged:  # k0 is 4 bytes at 0, k1 8 bytes at 4
        damaged.seek(5)
        damaged.write(b"\xff")
    with TierStore.from_config(config) as store:
        with pytest.raises(ChecksumError, match="key 'k1'"):
            store.get("k1", cache=False).result()
        assert torch.equal(store["k2"], small(2))


def test_stores_written_without_packs_reopen_with_them(tmp_path: Path) -> None:
    """Manifest entries without the ``pack`` field (older stores) keep their meaning."""
    with TierStore.from_config(packing(tmp_path, pack_below=0)) as store:
        for index in range(20):
            store[f"k{index}"] = small(index)
    with TierStore.from_config(packing(tmp_path)) as store:
        assert len(backend_objects(store)) == 20
        assert all(torch.equal(store[f"k{index}"], small(index)) for index in range(20))


def test_kill_9_during_pack_writes_loses_nothing_flushed(tmp_path: Path) -> None:
    """A writer flushes rounds of 300 small objects (one pack each) and is killed at random moments;
    every key then holds a whole version, at least the last round flushed, and no unreferenced
    pack is left on disk."""
    config = packing(tmp_path)
    rng = random.Random(11)
    version = 0
    for kill in range(8):
        started = kill_a_crash_writer(config, version, kill, rng.uniform(0.2, 1.5), "packs")
        flushed = (
            int((tmp_path / "manifest.flushed").read_text())
            if (tmp_path / "manifest.flushed").exists()
            else -1
        )
        with TierStore.from_config(config) as store:
            for key in store:
                values = store.get(key, cache=False).result()
                assert bool((values == values[0]).all()) and values.numel() == 1 + int(values[0]) % 250, key
                assert flushed <= int(values[0]) <= started, key
            if flushed >= 0:
                assert len(store) == 300
            referenced = {store.info(key).name for key in store}
            assert set(backend_objects(store)) == referenced
        version = started + 1
    assert version > 3


def test_packed_objects_read_back_across_the_paths_of_a_striped_tier() -> None:
    """A pack is striped like any object; an object may straddle two paths' extents. The reads
    come from the pack itself: a filler takes the whole cache first, evicting every clean copy
    the flush left, and ``cache_reads=False`` keeps what is read out of the cache."""
    paths = [open_backend("dram://"), open_backend({"type": "fault", "inner": "dram://"})]
    budget = 1 << 20
    with TierStore([Tier("striped", paths)], cache_budget=budget, cache_reads=False) as store:
        for put in [store.put(f"k{index}", small(index)) for index in range(200)]:
            put.result()
        store.flush()
        assert [len(path.list()) for path in paths] == [1, 1]  # one pack, split in two extents
        (pack,) = set(paths[0].list()) | set(paths[1].list())
        store["filler"] = torch.zeros(budget, dtype=torch.uint8)
        keys = [f"k{index}" for index in range(200)]
        assert not any(store.info(key).cached for key in keys)
        both = [path.name for path in store.tiers[0].paths]
        before = store.stats()
        for index, key in enumerate(keys):
            info = store.info(key)
            assert info.name == pack and [extent["path"] for extent in info.extents] == both
            assert torch.equal(store[key], small(index)), index
        after = store.stats()
        assert after["misses"] - before["misses"] == 200 and after["hits"] == before["hits"]
        assert not any(store.info(key).cached for key in keys)
        tier, earlier = after["tiers"]["striped"], before["tiers"]["striped"]
        assert tier["bytes_read"] - earlier["bytes_read"] == sum(small(index).nbytes for index in range(200))
        for name in both:  # each extent of the pack served reads
            assert tier["paths"][name]["read"]["bytes"] > earlier["paths"][name]["read"]["bytes"], name
