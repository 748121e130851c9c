"""TierStore behaviour over each persistent tier kind (DRAM backend and NVMe backend)."""

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tierstore.backends import open_backend
from tierstore.backends.dram import DramBackend, DramOptions

from tierstore import (
    BackendIOError,
    BufferMismatchError,
    CapacityError,
    ConfigError,
    InvalidKeyError,
    KeyNotFoundError,
    StoreClosedError,
    Tier,
    TierStore,
)

from .conftest import StoreFactory

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (13, 17), (2, 3, 4, 5), (1025,)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(dtype)


def tier_objects(store: TierStore) -> list[str]:
    return [name for tier in store.tiers for name in tier.backend.list()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype_and_shape(open_store: StoreFactory, dtype: torch.dtype) -> None:
    store = open_store(cache_budget=64 << 10)
    tensors = {f"{dtype}-{shape}": random_tensor(shape, dtype, i) for i, shape in enumerate(SHAPES)}
    for key, tensor in tensors.items():
        store.put(key, tensor)
    store.flush()
    for key, tensor in tensors.items():
        got = store[key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor), key
        info = store.info(key)
        assert (info.shape, info.dtype, info.nbytes) == (tuple(tensor.shape), dtype, tensor.nbytes)


def test_non_contiguous_input(open_store: StoreFactory) -> None:
    store = open_store()
    base = torch.randn(64, 48)
    views = {"t": base.t(), "sliced": base[::3, 5:40:2], "expanded": torch.randn(5, 1).expand(5, 9)}
    for key, view in views.items():
        store[key] = view
    for key, view in views.items():
        assert torch.equal(store[key], view)


# dtype of the base, and the view: memory unchanged behind a conjugate or negative bit
LAZY_VIEWS: dict[str, tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor]]] = {
    "conj": (torch.complex64, lambda t: t.conj()),
    "conj of a transpose": (torch.complex64, lambda t: t.t().conj()),
    "imag of a conj (negative)": (torch.complex128, lambda t: t.conj().imag),
    "negative view": (torch.float32, torch._neg_view),
}


@pytest.mark.parametrize("route", ["cached", "cache=False", "budget 0", "larger than the budget"])
def test_conjugate_and_negative_views_round_trip(open_store: StoreFactory, route: str) -> None:
    """Resolved before their bytes are taken, on every route that bypasses the cache, as sources
    (put) and as destinations (get out=)."""
    budget = {"budget 0": 0, "larger than the budget": 4096}.get(route, 1 << 20)
    store = open_store(cache_budget=budget)
    cache = route != "cache=False"
    for key, (dtype, lazy) in LAZY_VIEWS.items():
        view = lazy(random_tensor((64, 33), dtype))
        assert view.is_conj() or view.is_neg()
        expected = view.resolve_conj().resolve_neg().clone()
        store.put(key, view, cache=cache).result()
        assert torch.equal(view, expected)  # the caller's tensor is left as it was
        assert store.info(key).cached == (route == "cached")
        assert torch.equal(store.get(key, cache=cache).result(), expected), key
        out = lazy(torch.zeros(64, 33, dtype=dtype))
        assert store.get(key, out=out, cache=cache).result() is out
        assert torch.equal(out, expected), key


def test_put_is_ordered_before_later_get(open_store: StoreFactory) -> None:
    store = open_store(cache_budget=1 << 20)
    for version in range(20):
        store.put("k", torch.full((1000,), float(version)))
    assert torch.equal(store.get("k").result(), torch.full((1000,), 19.0))


def test_get_into_out(open_store: StoreFactory) -> None:
    store = open_store()
    value = torch.randn(32, 16).to(torch.bfloat16)
    store["x"] = value
    out = torch.empty(32, 16, dtype=torch.bfloat16)
    assert store.get("x", out=out).result() is out
    assert torch.equal(out, value)
    strided = torch.empty(16, 32, dtype=torch.bfloat16).t()
    store.get("x", out=strided).result()
    assert torch.equal(strided, value)


@pytest.mark.parametrize(
    "out",
    [torch.empty(32, 16), torch.empty(16, 32, dtype=torch.bfloat16), torch.empty(512, dtype=torch.bfloat16)],
    ids=["dtype", "shape", "flat"],
)
def test_get_rejects_mismatched_out(open_store: StoreFactory, out: torch.Tensor) -> None:
    store = open_store()
    store["x"] = torch.zeros(32, 16, dtype=torch.bfloat16)
    with pytest.raises(BufferMismatchError, match="out is"):
        store.get("x", out=out)


@pytest.mark.parametrize("cache_budget", [0, 1 << 20], ids=["from the tier", "through the cache"])
def test_get_refuses_an_out_whose_elements_share_memory(open_store: StoreFactory, cache_budget: int) -> None:
    """An expanded (stride 0) destination cannot hold distinct values: a BufferMismatchError before
    anything is read, on every tier kind and read path."""
    store = open_store(cache_budget=cache_budget)
    store["x"] = torch.arange(8.0).reshape(2, 4)
    store.flush()
    for out in (torch.zeros(1, 4).expand(2, 4), torch.zeros(2, 1).expand(2, 4)):
        with pytest.raises(BufferMismatchError, match="share memory along dimension"):
            store.get("x", out=out)
        assert torch.equal(out, torch.zeros(2, 4))
    assert torch.equal(store.get("x", out=torch.empty(2, 4)).result(), torch.arange(8.0).reshape(2, 4))


def test_overwrite_changes_shape_and_dtype_and_frees_old_copy(open_store: StoreFactory) -> None:
    store = open_store(cache_budget=0 + (64 << 10), policy="write-through")
    store["k"] = torch.randn(100)
    store["k"] = torch.arange(10, dtype=torch.int16)
    assert torch.equal(store["k"], torch.arange(10, dtype=torch.int16))
    assert len(tier_objects(store)) == 1


def test_spill_many_times_the_budget_stays_within_budget(open_store: StoreFactory) -> None:
    budget = 160 << 10
    store = open_store(cache_budget=budget)
    tensors = {f"t{i}": random_tensor((4096 + 37 * i,), torch.float32, i) for i in range(40)}
    futures = [store.put(key, tensor) for key, tensor in tensors.items()]
    for future in futures:
        future.result()
    for key in reversed(list(tensors)):
        assert torch.equal(store[key], tensors[key])
    stats = store.stats()
    assert sum(t.nbytes for t in tensors.values()) > 4 * budget
    assert stats["peak_cache_bytes"] <= budget
    assert stats["evictions"] > 0 and stats["writebacks"] > 0


def test_write_through_persists_before_resolving(open_store: StoreFactory) -> None:
    store = open_store(policy="write-through")
    store["w"] = torch.ones(1000)
    info = store.info("w")
    assert info.tier is not None and info.cached and not info.dirty
    assert len(tier_objects(store)) == 1


def test_a_put_overrides_the_stores_policy(open_store: StoreFactory) -> None:
    """``write_through`` per put: True writes a write-back store's object before resolving, False
    leaves a write-through store's dirty in the cache; a non-bool is refused."""
    back = open_store(policy="write-back")
    back.put("through", torch.ones(1000), write_through=True).result()
    back.put("back", torch.ones(1000)).result()
    assert not back.info("through").dirty and back.info("through").tier is not None
    assert back.info("back").dirty and len(tier_objects(back)) == 1
    through = open_store(policy="write-through")
    through.put("deferred", torch.ones(1000), write_through=False).result()
    assert through.info("deferred").dirty and not tier_objects(through)
    with pytest.raises(ConfigError, match="write_through"):
        through.put("bad", torch.ones(3), write_through="yes")  # type: ignore[arg-type]


def test_write_back_defers_tier_writes_until_flush(open_store: StoreFactory) -> None:
    store = open_store(policy="write-back")
    store["w"] = torch.ones(1000)
    assert store.info("w").dirty and tier_objects(store) == []
    store.flush()
    info = store.info("w")
    assert not info.dirty and info.tier is not None
    assert len(tier_objects(store)) == 1


def test_objects_larger_than_budget_bypass_the_cache(open_store: StoreFactory) -> None:
    store = open_store(cache_budget=64 << 10)
    big = torch.randn(100_000)
    store["big"] = big
    info = store.info("big")
    assert not info.cached and info.tier is not None
    assert torch.equal(store["big"], big)
    out = torch.empty_like(big)
    store.get("big", out=out).result()
    assert torch.equal(out, big)
    assert store.stats()["peak_cache_bytes"] == 0
    with pytest.raises(CapacityError, match="exceed the cache budget"):
        store.prefetch(["big"]).result()


def test_cache_reads_off_reads_straight_to_the_destination(open_store: StoreFactory) -> None:
    """A miss reads from the tier into the caller's tensor (or a new one) and caches nothing,
    although each get asks for the cache (``cache=True``); a copy already cached is still used."""
    store = open_store(cache_reads=False, cache_budget=1 << 20)
    value = torch.arange(100.0)
    store.put("x", value, cache=False).result()  # on the tier only
    before = store.stats()
    out = torch.empty_like(value)
    assert store.get("x", out=out).result() is out and torch.equal(out, value)
    assert torch.equal(store.get("x").result(), value)
    after = store.stats()
    assert after["misses"] - before["misses"] == 2 and after["hits"] == before["hits"]
    assert not store.info("x").cached and after["peak_cache_bytes"] == 0  # no cache buffer was used
    (tier_before,), (tier_after,) = before["tiers"].values(), after["tiers"].values()
    assert tier_after["bytes_read"] - tier_before["bytes_read"] == 2 * value.nbytes
    store["y"] = value + 1  # cached by its put
    assert torch.equal(store["y"], value + 1) and store.stats()["hits"] == after["hits"] + 1


def test_prefetch_fills_the_cache(open_store: StoreFactory) -> None:
    store = open_store(cache_budget=64 << 10)
    for i in range(8):
        store[f"p{i}"] = torch.full((4096,), float(i))  # 16 KiB each: only 4 fit
    assert not store.info("p0").cached
    store.prefetch(["p0", "p1"]).result()
    assert store.info("p0").cached and store.info("p1").cached
    hits = store.stats()["hits"]
    assert torch.equal(store["p0"], torch.full((4096,), 0.0))
    assert store.stats()["hits"] == hits + 1


def test_delete(open_store: StoreFactory) -> None:
    store = open_store(policy="write-through")
    store["a"] = torch.ones(3)
    store["b"] = torch.ones(3)
    del store["a"]
    assert "a" not in store and store.keys() == ["b"] and len(store) == 1
    assert len(tier_objects(store)) == 1
    with pytest.raises(KeyNotFoundError):
        store["a"]
    with pytest.raises(KeyNotFoundError):
        store.delete("a")


@pytest.mark.parametrize(
    "key",
    ["", "nul\x00", 3, None, "k" * 1025, "../../etc/passwd", "/abs", "a/../b", "tab\t", "del\x7f", "nel\x85"],
)
def test_invalid_keys(open_store: StoreFactory, key: object) -> None:
    """Every Unicode control character (category Cc: C0, DEL and the C1 controls) is refused."""
    store = open_store()
    with pytest.raises(InvalidKeyError):
        store.put(key, torch.ones(1))  # type: ignore[arg-type]
    assert store.keys() == []


def test_keys_are_opaque_strings(open_store: StoreFactory) -> None:
    store = open_store()
    odd = ["a..b/c", "layer.0/exp_avg", "ünïcode ✓", ".", "..x/y.."]
    for i, key in enumerate(odd):
        store[key] = torch.tensor([i])
    store.flush()
    assert sorted(store.keys()) == sorted(odd)
    assert all(store[key].item() == i for i, key in enumerate(odd))


def test_put_rejects_non_tensors(open_store: StoreFactory) -> None:
    store = open_store()
    with pytest.raises(BufferMismatchError):
        store.put("x", [1, 2, 3])  # type: ignore[arg-type]


def test_closed_store(open_store: StoreFactory) -> None:
    store = open_store(policy="write-through")
    store["x"] = torch.ones(10)
    store.close()
    assert all(tier.backend.closed for tier in store.tiers)
    call: Callable[[], object]
    for call in (lambda: store.put("y", torch.ones(1)), lambda: store.get("x"), store.flush):
        with pytest.raises(StoreClosedError):
            call()
    # not KeyNotFoundError, an empty key list or False: the store is closed
    every_other_call: dict[str, Callable[[], object]] = {
        "info": lambda: store.info("x"),
        "keys": store.keys,
        "contains": lambda: store.contains("x"),
        "in": lambda: "x" in store,
        "len": lambda: len(store),
        "iter": lambda: list(store),
        "getitem": lambda: store["x"],
        "setitem": lambda: store.__setitem__("x", torch.ones(1)),
        "delitem": lambda: store.__delitem__("x"),
        "delete": lambda: store.delete("x"),
        "prefetch": lambda: store.prefetch(["x"]),
    }
    for name, call in every_other_call.items():
        with pytest.raises(StoreClosedError):
            call()
            pytest.fail(f"{name} after close")
    (tier_stats,) = store.stats()["tiers"].values()  # still readable, for a final report
    assert tier_stats["bytes_written"] == 40
    store.close()  # idempotent


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"tiers": []},
            r"^tiers: a TierStore needs a non-empty list of Tier or Backend objects \(open 'dram://'",
        ),
        ({"tiers": ["dram://"]}, r"^tiers\.0: expected a Tier or a Backend, got str"),
        ({"policy": "bogus"}, r"^policy: must be 'write-back' or 'write-through', not 'bogus'"),
        ({"workers": 0}, r"^workers: must be an integer >= 1, not 0"),
        ({"workers": True}, r"^workers: must be an integer >= 1, not True"),
        ({"cache_budget": True}, r"^cache_budget: must be a number of bytes >= 0, not True"),
        ({"cache_budget": -1}, r"^cache_budget: must be a number of bytes >= 0 \(.*\), not -1"),
        ({"cache_budget": 1.5}, r"^cache_budget: must be a number of bytes >= 0 \(.*\), not 1\.5"),
        ({"verify": "never"}, r"^verify: must be 'always', 'sampled' or 'off', not 'never'"),
    ],
)
def test_bad_constructor_arguments_are_config_errors_naming_them(
    arguments: dict[str, object], message: str
) -> None:
    backend = DramBackend(DramOptions())
    with pytest.raises(ConfigError, match=message):
        TierStore(**{"tiers": [backend], **arguments})  # type: ignore[arg-type]
    assert not backend.closed  # nothing was taken over


def test_the_empty_budget_and_a_budget_of_several_gigabytes_are_fine() -> None:
    for budget in (0, 8 << 30):
        with TierStore([DramBackend(DramOptions())], cache_budget=budget) as store:
            store["x"] = torch.ones(3)
            assert torch.equal(store["x"], torch.ones(3))


UNSTORABLE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "meta": (lambda: torch.empty(3, device="meta"), "meta tensors have no data"),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        "quantized tensors are not supported",
    ),
    "nested": (
        lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "nested tensors are not supported",
    ),
    "sparse": (lambda: torch.ones(3).to_sparse(), "only dense \\(strided\\) tensors .* not torch.sparse_coo"),
    "sparse csr": (lambda: torch.eye(3).to_sparse_csr(), "only dense .* not torch.sparse_csr"),
}


@pytest.mark.parametrize("kind", list(UNSTORABLE))
def test_tensors_without_plain_memory_are_refused_and_nothing_is_written(
    open_store: StoreFactory, kind: str
) -> None:
    make, reason = UNSTORABLE[kind]
    store = open_store(cache_budget=0)
    store["k"] = torch.arange(3.0)
    tensor = make()
    with pytest.raises(BufferMismatchError, match=rf"put\('k'\): {reason}"):
        store.put("k", tensor)
    assert torch.equal(store["k"], torch.arange(3.0)) and len(tier_objects(store)) == 1
    if not tensor.is_quantized:  # a quantized out already differs in dtype
        with pytest.raises(BufferMismatchError, match=rf"get\('k'\): out: {reason}"):
            store.get("k", out=tensor)


def test_prefetch_of_one_string_is_refused(open_store: StoreFactory) -> None:
    store = open_store()
    store["layer"] = torch.ones(3)
    for wrong in ("layer", None, 3):
        with pytest.raises(
            InvalidKeyError, match=rf"prefetch takes an iterable of keys, not {wrong!r}: use \[key\]"
        ):
            store.prefetch(wrong)  # type: ignore[arg-type]
    store.prefetch(["layer"]).result()


def test_close_removes_tier_objects(tmp_path: Path) -> None:
    from tierstore.backends import open_backend

    store = TierStore([open_backend(f"nvme://{tmp_path}")], cache_budget=0)
    store["x"] = torch.ones(10_000)
    assert len(list(tmp_path.iterdir())) == 1
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_concurrent_clients(open_store: StoreFactory) -> None:
    store = open_store(cache_budget=128 << 10)

    def client(index: int) -> None:
        for round_ in range(10):
            key = f"c{index}-{round_ % 4}"
            value = random_tensor((2000 + index,), torch.float32, index * 100 + round_)
            store[key] = value
            assert torch.equal(store[key], value)

    with ThreadPoolExecutor(8) as clients:
        list(clients.map(client, range(8)))  # raises what a client raised
    assert store.stats()["peak_cache_bytes"] <= 128 << 10


# -- tiers, capacity and failures ------------------------------------------------------------------
class FlakyDram(DramBackend):
    """Writes half of each object, then fails, while ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__(DramOptions())
        self.failing = False

    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        if not self.failing:
            return super()._write(name, offset, data)
        super()._write(name, offset, data[: data.nbytes // 2])
        future: Future[None] = Future()
        future.set_exception(BackendIOError(5, "injected write failure"))
        return future


def test_spill_over_to_the_next_tier_when_full() -> None:
    small = Tier("small", DramBackend(DramOptions()), capacity=10_000)
    large = Tier("large", DramBackend(DramOptions()))
    with TierStore([small, large], cache_budget=0) as store:
        for i in range(5):
            store[f"k{i}"] = torch.ones(1000)  # 4000 bytes each
        placed = [store.info(f"k{i}").tier for i in range(5)]
        assert placed == ["small", "small", "large", "large", "large"]
        del store["k0"]
        store["k5"] = torch.ones(1000)
        assert store.info("k5").tier == "small"


def test_all_tiers_full() -> None:
    with TierStore([Tier("t", DramBackend(DramOptions()), capacity=100)], cache_budget=0) as store:
        with pytest.raises(CapacityError, match="no tier has room"):
            store["k"] = torch.ones(1000)
        assert "k" not in store


def test_failed_put_keeps_previous_version_and_leaves_no_partial_object() -> None:
    backend = FlakyDram()
    with TierStore([backend], cache_budget=0) as store:
        store["k"] = torch.zeros(1000)
        backend.failing = True
        with pytest.raises(BackendIOError, match="injected"):
            store["k"] = torch.ones(1000)
        assert torch.equal(store["k"], torch.zeros(1000))
        assert len(backend.list()) == 1
        with pytest.raises(BackendIOError):
            store["new"] = torch.ones(1000)
        assert "new" not in store and len(backend.list()) == 1


def test_failed_write_back_keeps_data_cached_until_flush_succeeds() -> None:
    backend = FlakyDram()
    with TierStore([backend], cache_budget=1 << 20) as store:
        store["k"] = torch.arange(1000.0)
        backend.failing = True
        with pytest.raises(BackendIOError, match="write-back failed"):
            store.flush()
        assert backend.list() == []
        assert torch.equal(store["k"], torch.arange(1000.0))
        backend.failing = False
        store.flush()
        assert store.info("k").tier is not None and not store.info("k").dirty


def test_failed_write_backs_blocking_the_cache_raise_instead_of_hanging() -> None:
    backend = FlakyDram()
    with TierStore([backend], cache_budget=8192) as store:
        store["a"] = torch.ones(1024)  # 4 KiB
        store["b"] = torch.ones(1024)
        backend.failing = True
        with pytest.raises(CapacityError, match="write-back failed"):
            store["c"] = torch.ones(1024)
        backend.failing = False
        store.flush()  # retries the failed write-backs, which frees their room
        store["c"] = torch.ones(1024)
        assert all(torch.equal(store[k], torch.ones(1024)) for k in "abc")


def test_cache_hint_bypasses_the_cache(open_store: StoreFactory) -> None:
    store = open_store(cache_budget=1 << 20)
    value = torch.arange(1000.0)
    store.put("x", value, cache=False).result()
    info = store.info("x")
    assert not info.cached and info.tier is not None and store.stats()["cache_bytes"] == 0
    out = torch.empty_like(value)
    store.get("x", out=out, cache=False).result()
    assert torch.equal(out, value) and not store.info("x").cached
    store["x"] = value  # cached now
    store.put("x", value + 1, cache=False).result()  # replaces the cached copy
    assert not store.info("x").cached and torch.equal(store["x"], value + 1)


def test_concurrent_puts_get_distinct_backend_names() -> None:
    from tierstore.backends import open_backend

    with TierStore([open_backend("dram://")], cache_budget=0, workers=8) as store:

        def put_many(thread: int) -> None:
            for index in range(200):
                store.put(f"t{thread}/{index}", torch.full((8,), index), cache=False).result()

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put_many, range(8)))
        names = {store.info(key).name for key in store}
        assert len(store) == len(names) == 1600


@pytest.mark.parametrize("cache_budget", [0, 1 << 20], ids=["on the tier", "dirty in the cache"])
def test_copy_to_commits_every_key_in_the_destination(
    open_store: StoreFactory, tmp_path: Path, cache_budget: int
) -> None:
    """Objects on a tier, small ones in a pack and dirty cached ones all arrive in a persistent
    destination, which reopens with them after the source is gone."""
    source = open_store(cache_budget=cache_budget, pack_below=1 << 10)
    tensors = {f"k{i}": torch.arange(1000 * (i + 1), dtype=torch.float32) for i in range(3)}
    tensors["small"] = torch.arange(10)
    for key, tensor in tensors.items():
        source.put(key, tensor).result()
    if cache_budget == 0:
        source.flush()

    def open_destination() -> TierStore:
        tier = Tier("copy", open_backend(f"nvme://{tmp_path / 'destination'}"))
        return TierStore([tier], cache_budget=0, manifest=tmp_path / "manifest")

    with open_destination() as destination:
        source.copy_to(destination)
        assert destination.keys() == list(tensors)
    source.close()
    with open_destination() as destination:
        for key, tensor in tensors.items():
            assert torch.equal(destination[key], tensor), key


def test_copy_to_links_files_and_a_linked_file_is_never_recycled(tmp_path: Path) -> None:
    """Between nvme tiers on one file system the copy is a hard link: the destination's file is
    the source's (no byte moved). The source then deleting its version must not hand those
    blocks to a new object (recycling would overwrite the destination's copy)."""

    def store(name: str) -> TierStore:
        return TierStore([Tier(name, open_backend(f"nvme://{tmp_path / name}"))], cache_budget=0)

    source, destination = store("source"), store("destination")
    source.put("state", torch.full((1 << 18,), 1.0)).result()
    source.copy_to(destination, ["state"])
    (linked,) = [
        p for p in (tmp_path / "destination").rglob("*") if p.is_file() and p.stat().st_size == 1 << 20
    ]
    assert linked.stat().st_nlink == 2
    source.put("state", torch.full((1 << 18,), 2.0)).result()  # new version: the old one deleted
    source.put("other", torch.full((1 << 18,), 3.0)).result()  # same size: would take a recycled file
    assert torch.equal(destination["state"], torch.full((1 << 18,), 1.0))
    assert linked.stat().st_nlink == 1
    source.close()
    destination.close()


def test_copy_to_rejects_bad_input_and_copies_nothing(tmp_path: Path) -> None:
    """Not a store, the store itself, a bare string, an unknown key: a typed error each, and the
    destination holds nothing afterwards (the keys are checked before the first copy)."""
    source = TierStore([Tier("t", open_backend(f"nvme://{tmp_path / 'source'}"))], cache_budget=0)
    destination = TierStore([Tier("t", open_backend(f"nvme://{tmp_path / 'destination'}"))], cache_budget=0)
    source.put("a", torch.ones(4)).result()
    with pytest.raises(ConfigError, match="destination must be a TierStore"):
        source.copy_to(tmp_path, ["a"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="destination is this store"):
        source.copy_to(source)
    with pytest.raises(InvalidKeyError, match="iterable of keys"):
        source.copy_to(destination, "a")
    with pytest.raises(KeyNotFoundError):
        source.copy_to(destination, ["a", "missing"])
    with pytest.raises(InvalidKeyError, match="leading '/'"):
        source.copy_to(destination, ["a"], prefix="/abs/")
    with pytest.raises(InvalidKeyError, match="prefix must be a str"):
        source.copy_to(destination, ["a"], prefix=3)  # type: ignore[arg-type]
    assert destination.keys() == []
    source.close()
    destination.close()


@pytest.mark.parametrize("cache_budget", [0, 1 << 20])
def test_copy_to_a_prefix_keeps_two_copies_of_one_key_apart(tmp_path: Path, cache_budget: int) -> None:
    """The same key copied twice under two prefixes (two checkpoints of one object): both
    versions stay, each under its own key, linked or read and put alike."""
    source = TierStore([Tier("t", open_backend(f"nvme://{tmp_path / 'source'}"))], cache_budget=cache_budget)
    destination = TierStore([Tier("t", open_backend(f"nvme://{tmp_path / 'destination'}"))], cache_budget=0)
    source.put("state", torch.full((4096,), 1.0)).result()
    source.copy_to(destination, ["state"], prefix="step-1/")
    source.put("state", torch.full((4096,), 2.0)).result()
    source.copy_to(destination, ["state"], prefix="step-2/")
    assert destination.keys() == ["step-1/state", "step-2/state"]
    assert torch.equal(destination["step-1/state"], torch.full((4096,), 1.0))
    assert torch.equal(destination["step-2/state"], torch.full((4096,), 2.0))
    source.close()
    destination.close()


def test_a_resident_cache_refills_its_pages_with_objects_of_any_size() -> None:
    """``cache_resident``: 32 MiB of objects, deleted, then 30 MiB of objects of another size. A
    resident cache puts them in the pages it already has (the process's RSS does not grow); the
    default pool keeps idle buffers by size and maps new pages for the new size."""
    growth = {}
    for resident in (False, True):
        store = TierStore([open_backend("dram://")], cache_budget=64 << 20, cache_resident=resident)
        try:
            for index in range(8):
                store.put(f"large{index}", torch.ones(1 << 20)).result()  # 4 MiB each
            for index in range(8):
                store.delete(f"large{index}")
            before = _rss()
            for index in range(40):
                store.put(f"small{index}", torch.full((3 << 16,), float(index))).result()  # 768 KiB each
            growth[resident] = _rss() - before
            assert torch.equal(store["small7"], torch.full((3 << 16,), 7.0))
        finally:
            store.close()
    assert growth[True] <= 2 << 20
    assert growth[False] >= growth[True] + (16 << 20)


def _rss() -> int:
    """The process's resident set, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_scratch_store_says_why_a_key_put_by_an_earlier_store_is_gone(tmp_path: Path) -> None:
    """The README's newcomer: a config without a manifest, closed and opened again. The key went
    with the first store, and the error says why and how to keep objects across opens; a
    persistent store's error for a key it never had stays plain."""
    config: dict[str, object] = {"tiers": [{"name": "nvme", "backend": f"nvme://{tmp_path / 'data'}"}]}
    with TierStore.from_config(config) as store:
        store["x"] = torch.ones(3)
    scratch = r"^no object with key 'x' in this scratch store: .* give it a manifest directory"
    with TierStore.from_config(config) as store:
        with pytest.raises(KeyNotFoundError, match=scratch):
            store["x"]
        with pytest.raises(KeyNotFoundError, match=scratch):
            store.info("x")
    persistent = {**config, "manifest": str(tmp_path / "manifest")}
    with TierStore.from_config(persistent) as store:
        store["x"] = torch.ones(3)
    with TierStore.from_config(persistent) as store:
        assert torch.equal(store["x"], torch.ones(3))
        with pytest.raises(KeyNotFoundError, match=r"^no object with key 'y'$"):
            store["y"]
