"""A write-back cache over a tier that fills up: its capacity (the config's ``capacity``) or a real
file system out of space (ENOSPC). Committed objects stay readable, every write-back failure
reaches the caller naming the objects only in memory, and ``close()`` releases the store."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import BackendIOError, CapacityError, StoreClosedError, TierStore

from .conftest import TmpfsFactory
from .helpers import persistent

MIB = 1 << 20


def value(index: int) -> torch.Tensor:
    """1 MiB of float32, every element ``index``."""
    return torch.full((MIB // 4,), float(index))


def full_tier(tmp_path: Path, *, capacity: str, cache: str = "4MiB") -> dict[str, Any]:
    """A persistent store whose one NVMe tier holds at most ``capacity`` bytes of objects."""
    config = persistent(tmp_path, budget=cache)
    config["tiers"][0]["capacity"] = capacity
    return config


@contextmanager
def store_that_cannot_close(tmp_path: Path, *, capacity: str) -> Iterator[TierStore]:
    """A store over :func:`full_tier` that the block leaves holding objects the tier has no room
    for: its close must then fail (and release it)."""
    store = TierStore.from_config(full_tier(tmp_path, capacity=capacity))
    try:
        yield store
    finally:
        with pytest.raises(BackendIOError):
            store.close()


def only_in_memory(store: TierStore) -> list[str]:
    return sorted(key for key in store if store.info(key).tier is None)


def test_committed_objects_stay_readable_behind_a_cache_full_of_unwritable_ones(tmp_path: Path) -> None:
    with store_that_cannot_close(tmp_path, capacity="8MiB") as store:
        puts = [store.put(f"k{i}", value(i)) for i in range(12)]
        assert [put.exception() for put in puts] == [None] * 12
        for i in range(12):  # 8 on the tier, 4 dirty in the cache that the tier has no room for
            assert torch.equal(store[f"k{i}"], value(i))
            out = torch.empty(MIB // 4)
            assert store.get(f"k{i}", out=out).result() is out and torch.equal(out, value(i))
        assert len(only_in_memory(store)) == 4


def test_flush_names_every_object_only_in_memory_and_carries_enospc(tmp_path: Path) -> None:
    with store_that_cannot_close(tmp_path, capacity="2MiB") as store:
        for i in range(3):
            store[f"k{i}"] = value(i)
        with pytest.raises(BackendIOError) as raised:
            store.flush()  # two fit on the tier, one does not
        unwritten = only_in_memory(store)
        assert len(unwritten) == 1
        assert raised.value.errno == errno.ENOSPC
        assert isinstance(raised.value.__cause__, CapacityError)
        assert f"{unwritten[0]!r}" in str(raised.value)


def test_a_write_back_put_is_refused_while_earlier_objects_cannot_be_written(tmp_path: Path) -> None:
    store = TierStore.from_config(full_tier(tmp_path, capacity="2MiB"))
    try:
        for i in range(3):
            store[f"k{i}"] = value(i)
        with pytest.raises(BackendIOError):
            store.flush()
        (unwritten,) = only_in_memory(store)
        # The cache has room for it, but the store could not make it durable either.
        with pytest.raises(BackendIOError, match=f"put\\('small'\\) refused.*{unwritten!r}") as raised:
            store["small"] = torch.ones(16)
        assert raised.value.errno == errno.ENOSPC and "small" not in store
        # Room on the tier again: the next flush writes the object, and puts are taken again.
        for key in list(store):
            if key != unwritten:
                del store[key]
        store.flush()
        assert only_in_memory(store) == []
        store["small"] = torch.ones(16)
        assert torch.equal(store["small"], torch.ones(16))
    finally:
        store.close()


def test_a_write_through_put_goes_around_a_cache_full_of_unwritable_objects(tmp_path: Path) -> None:
    with store_that_cannot_close(tmp_path, capacity="4MiB") as store:
        for i in range(4):
            store.put(f"tier{i}", value(i), cache=False).result()  # the tier is full
            store[f"cached{i}"] = value(i)  # the cache is full
        with pytest.raises(BackendIOError):
            store.flush()
        assert only_in_memory(store) == [f"cached{i}" for i in range(4)]
        del store["tier0"]  # room on the tier, none in the cache
        store.put("through", value(9), write_through=True).result()
        info = store.info("through")
        assert info.tier is not None and not info.cached
        assert torch.equal(store["through"], value(9))


@pytest.mark.parametrize("how", ["close", "with"])
def test_a_close_that_cannot_write_back_releases_the_store_and_names_what_is_lost(
    tmp_path: Path, how: str
) -> None:
    config = full_tier(tmp_path, capacity="4MiB")
    threads = threading.active_count()
    store = TierStore.from_config(config)
    with pytest.raises(BackendIOError) as raised, store:
        store["old"] = value(0)
        for i in range(3):
            store[f"k{i}"] = value(i + 1)
        store.flush()  # the tier is full
        store["old"] = value(10)  # a newer version, only in the cache
        store["new"] = value(11)  # no version on the tier at all
        if how == "close":
            store.close()
    assert raised.value.errno == errno.ENOSPC
    assert isinstance(raised.value.__cause__, CapacityError)
    message = str(raised.value)
    assert "close" in message and "2 object(s)" in message
    assert "'new' (no such key at the next open)" in message
    assert "'old' (its previous version at the next open)" in message
    with pytest.raises(StoreClosedError):
        store.keys()
    assert store.memory.held() == {} and threading.active_count() == threads
    with TierStore.from_config(config) as reopened:  # the lock is free
        assert sorted(reopened.keys()) == ["k0", "k1", "k2", "old"]
        assert torch.equal(reopened["old"], value(0))


def test_a_real_full_file_system(tmp_path: Path, small_tmpfs: TmpfsFactory) -> None:
    """An 8 MiB tmpfs under a 4 MiB cache: once write-backs fail with ENOSPC, puts are refused
    naming the objects only in memory, the puts taken stay readable, and a reopen finds every
    object that reached the tier."""
    mount = small_tmpfs("8m")
    config = persistent(tmp_path, backend=f"nvme://{mount}", budget="4MiB")
    taken, refused = [], []
    store = TierStore.from_config(config)
    try:
        for i in range(16):
            try:
                store[f"k{i}"] = value(i)
                taken.append(f"k{i}")
            except (BackendIOError, CapacityError) as error:
                assert f"k{i}" not in store
                refused.append(error)
        for key in taken:
            assert torch.equal(store[key], value(int(key[1:])))
        lost = only_in_memory(store)
        assert lost and len(refused) >= 4
        # The put that found the cache full of objects the tier has no room for, then every put
        # after it: refused naming those objects, with the file system's errno.
        assert isinstance(refused[0], CapacityError)
        for refusal in refused[1:]:
            assert isinstance(refusal, BackendIOError) and refusal.errno == errno.ENOSPC
            assert all(f"{key!r}" in str(refusal) for key in lost)
        with pytest.raises(BackendIOError) as flushed:
            store.flush()
        assert flushed.value.errno == errno.ENOSPC
        assert isinstance(flushed.value.__cause__, OSError) and flushed.value.__cause__.errno == errno.ENOSPC
        assert all(f"{key!r}" in str(flushed.value) for key in lost)
    finally:
        with pytest.raises(BackendIOError) as closed:
            store.close()
    assert closed.value.errno == errno.ENOSPC
    assert all(f"{key!r} (no such key at the next open)" in str(closed.value) for key in lost)
    with TierStore.from_config(config) as reopened:
        assert sorted(reopened.keys()) == sorted(set(taken) - set(lost))
        assert all(torch.equal(reopened[key], value(int(key[1:]))) for key in reopened)
