"""Virtual tiers: objects striped or placed across several paths, through the whole store."""

import inspect
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from tierstore.backends import open_backend
from tierstore.backends.dram import DramBackend, DramOptions

from tierstore import BackendIOError, CapacityError, ConfigError, Tier, TierStore
from tierstore._checks import ConfigModel
from tierstore.bandwidth import Bandwidth, InFlight, PathSpeed, ThroughputMeter
from tierstore.config import PathConfig, PathOptions, TierConfig, TierOptions
from tierstore.limits import NodeLimiter, PathScheduler, Priority
from tierstore.pass_plan import transfer_seconds
from tierstore.tier import TierPath


def dram_path(name: str, read: float, write: float) -> TierPath:
    return TierPath(name, DramBackend(DramOptions()), bandwidth=Bandwidth(read, write), adapt=False)


@pytest.mark.parametrize("seed", range(6))
def test_striped_objects_reassemble_under_random_weights(seed: int) -> None:
    rng = random.Random(seed)
    paths = [dram_path(f"p{i}", rng.uniform(1, 100), rng.uniform(1, 100)) for i in range(rng.randint(2, 5))]
    with TierStore([Tier("v", paths)], cache_budget=0) as store:
        values = {}
        for index in range(10):
            shape = (rng.randint(0, 50_000),)
            values[f"k{index}"] = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32)
            store[f"k{index}"] = values[f"k{index}"]
        for key, value in values.items():
            assert torch.equal(store[key], value)
            extents = store.info(key).extents
            assert sum(e["length"] for e in extents) == value.nbytes
            out = torch.empty_like(value)
            store.get(key, out=out).result()
            assert torch.equal(out, value)


def test_stripe_shares_follow_bandwidth_and_are_recorded() -> None:
    paths = [dram_path("fast", 400e6, 400e6), dram_path("mid", 200e6, 200e6), dram_path("slow", 100e6, 100e6)]
    with TierStore([Tier("v", paths)], cache_budget=0) as store:
        store["x"] = torch.zeros(7 << 20, dtype=torch.uint8)
        extents = store.info("x").extents
        assert [e["path"] for e in extents] == ["fast", "mid", "slow"]
        assert [e["length"] for e in extents] == [4 << 20, 2 << 20, 1 << 20]
        for path, extent in zip(paths, extents, strict=True):
            names = path.backend.list()
            assert len(names) == 1 and path.backend.size(names[0]) == extent["length"]


def test_place_sends_whole_objects_in_bandwidth_proportion() -> None:
    paths = [dram_path("nvme", 300e6, 300e6), dram_path("pfs", 150e6, 150e6)]
    with TierStore([Tier("v", paths, placement="place")], cache_budget=0) as store:
        for index in range(30):
            store[f"s{index}"] = torch.full((1000,), index)
        placed = [store.info(f"s{i}").extents[0]["path"] for i in range(30)]
        assert placed.count("nvme") == 20 and placed.count("pfs") == 10
        assert all(len(store.info(f"s{i}").extents) == 1 for i in range(30))
        assert all(torch.equal(store[f"s{i}"], torch.full((1000,), i)) for i in range(30))


def test_unmeasured_paths_split_equally_then_learn() -> None:
    paths = [TierPath(f"p{i}", DramBackend(DramOptions())) for i in range(2)]
    tier = Tier("v", paths)
    assert tier.weights() == [1.0, 1.0]
    with TierStore([tier], cache_budget=0) as store:
        for index in range(8):
            store[f"k{index}"] = torch.zeros(4 << 20, dtype=torch.uint8)
            store[f"k{index}"]
        assert all(path.bandwidth() is not None for path in paths)
        stats = store.stats()["tiers"]["v"]["paths"]
        assert stats["p0"]["write"]["bytes"] > 0 and stats["p0"]["read"]["gb_per_s"] > 0


class FailingDram(DramBackend):
    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        super()._write(name, offset, data[: data.nbytes // 2])
        raise BackendIOError(5, "path failed")


def test_a_failing_path_is_excluded_and_the_others_keep_serving() -> None:
    good = TierPath("good", DramBackend(DramOptions()))
    bad = TierPath("bad", FailingDram(DramOptions()))
    with TierStore([Tier("v", [good, bad])], cache_budget=0) as store:
        data = torch.arange(1 << 18, dtype=torch.int32)
        store["x"] = data  # the half-written extent on "bad" is deleted, the object rewritten on "good"
        assert [extent["path"] for extent in store.info("x").extents] == ["good"]
        assert bad.backend.list() == [] and store.tiers[0].failed_paths == {1}
        store["y"] = data  # new objects avoid the failed path from the start
        assert torch.equal(store["x"], data) and torch.equal(store["y"], data)


def test_when_every_path_fails_nothing_is_left_behind() -> None:
    bad = [TierPath(f"bad{i}", FailingDram(DramOptions())) for i in range(2)]
    with TierStore([Tier("v", bad)], cache_budget=0) as store:
        with pytest.raises(BackendIOError, match="path failed"):
            store["x"] = torch.zeros(1 << 20, dtype=torch.uint8)
        assert "x" not in store
        assert all(path.backend.list() == [] for path in bad)
        assert store.tiers[0].used_bytes == 0


def test_multi_path_tier_from_config(tmp_path: Path) -> None:
    config = {
        "cache": {"budget": "1MiB"},
        "tiers": [
            {
                "name": "virtual",
                "placement": "stripe",
                "paths": [
                    {
                        "name": "local",
                        "backend": f"nvme://{tmp_path / 'a'}",
                        "bandwidth": {"read": "2GB", "write": "1GB"},
                    },
                    {
                        "name": "remote",
                        "backend": f"zarr+file://{tmp_path / 'b'}?chunk_bytes=1MiB",
                        "bandwidth": {"read": "1GB", "write": "0.5GB"},
                        "max_reads": 1,
                        "max_writes": 1,
                        "node_limit": {"key": f"test-{tmp_path.name}", "directory": str(tmp_path / "locks")},
                    },
                ],
            }
        ],
    }
    with TierStore.from_config(config) as store:
        value = torch.randn(3 << 20)  # 12 MiB: bigger than the cache, striped 2:1
        store["w"] = value
        extents = store.info("w").extents
        assert [e["path"] for e in extents] == ["local", "remote"]
        assert extents[0]["length"] == 8 << 20
        assert torch.equal(store["w"], value)
        assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == [
            f"test-{tmp_path.name}.read.0.lock",
            f"test-{tmp_path.name}.write.0.lock",
        ]


def test_probe_results_are_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = {"tiers": [{"name": "t", "probe": True, "backend": f"nvme://{tmp_path / 'd'}"}]}
    with TierStore.from_config(config) as store:
        first = store.tiers[0].paths[0].configured
    assert first is not None and first.read > 0 and first.write > 0
    assert (tmp_path / "cache" / "tierstore" / "bandwidth.json").exists()
    with TierStore.from_config(config) as store:
        assert store.tiers[0].paths[0].configured == first  # from the cache, not re-measured


class HeldReadDram(DramBackend):
    """A DRAM backend that records each request as its path starts it, and can keep one read in
    flight until released (its future stays open: the read holds its slot on the path while the
    path's dispatcher goes on choosing what starts next)."""

    def __init__(self) -> None:
        super().__init__(DramOptions())
        self.started: list[str] = []
        self.read_held = threading.Event()
        self._hold_next_read = False
        self._held: Future[None] = Future()

    def hold_next_read(self) -> None:
        self._hold_next_read = True

    def release(self) -> None:
        """Let the held read finish (if it has not yet)."""
        if not self._held.done():
            self._held.set_result(None)

    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        self.started.append(f"write {name}")
        return super()._write(name, offset, data)

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        self.started.append(f"read {name}")
        done = super()._read_into(name, offset, out)
        if not self._hold_next_read:
            return done
        self._hold_next_read = False
        self.read_held.set()
        return self._held


def test_tier_priorities_reach_the_paths() -> None:
    """A tier's writes and reads reach the path's scheduler at the priority the tier was given:
    with the path's one read slot taken, a critical read queues and a background write submitted
    after it waits for it (write-back yields to anything more urgent). Were the write's priority
    lost (or the read's lowered to background), the write, on a free write slot, would start at
    once, ahead of the read."""
    backend = HeldReadDram()
    path = TierPath("p", backend, bandwidth=Bandwidth(1e9, 1e9), max_reads=1, adapt=False)
    tier = Tier("v", [path])
    try:
        placement = tier.write("obj", memoryview(bytes(4096)), Priority.CRITICAL).result()
        backend.hold_next_read()
        held = tier.read_into(placement, memoryview(bytearray(4096)), Priority.CRITICAL)
        assert backend.read_held.wait(timeout=30)
        queued = tier.read_into(placement, memoryview(bytearray(4096)), Priority.CRITICAL)
        written = tier.write("later", memoryview(bytes(4096)), Priority.BACKGROUND)
        time.sleep(0.2)  # time for the dispatcher to start the write, were it allowed to
        assert not written.done() and backend.started == ["write obj", "read obj"]
        backend.release()
        for request in (held, queued, written):
            request.result(timeout=30)
        assert backend.started == ["write obj", "read obj", "read obj", "write later"]
    finally:
        backend.release()  # else closing would wait for the held read forever
        tier.close()


def test_open_backend_errors_close_earlier_paths(tmp_path: Path) -> None:
    from tierstore import UnwritablePathError

    (tmp_path / "file").write_text("x")
    config = {
        "tiers": [
            {
                "name": "v",
                "paths": [
                    {"backend": f"nvme://{tmp_path / 'ok'}"},
                    {"backend": f"nvme://{tmp_path / 'file' / 'x'}"},
                ],
            }
        ]
    }
    with pytest.raises(UnwritablePathError):
        TierStore.from_config(config)
    assert open_backend(f"nvme://{tmp_path / 'ok'}").list() == []


def test_telemetry_as_dict_and_log(caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    paths = [dram_path("a", 1e9, 1e9), dram_path("b", 1e9, 1e9)]
    with TierStore([Tier("v", paths)], cache_budget=1 << 20) as store:
        store["x"] = torch.zeros(1 << 18)
        store.flush()
        store["x"]
        with caplog.at_level(logging.INFO, logger="tierstore"):
            stats = store.log_stats()
    assert stats["hits"] == 1 and stats["writebacks"] == 1
    path = stats["tiers"]["v"]["paths"]["a"]
    assert path["write"]["bytes"] == 512 << 10 and path["write"]["seconds"] > 0
    assert path["requests"] == 1 and path["queue_wait_seconds"] >= 0
    logged = caplog.records[-1].getMessage()
    assert logged.startswith("tierstore stats ") and json.loads(logged.split(" ", 2)[2]) == stats


def test_timeline_accounts_for_every_byte() -> None:
    from tierstore.app.bench import Timeline, measure_path

    path = TierPath("p", open_backend({"type": "throttle", "inner": "dram://", "write_bytes_per_s": "200MB"}))
    with Timeline([path], interval=0.01) as timeline:
        measure_path(path, 2 << 20, 3)
    points = timeline.rates()["p"]
    moved = sum(gbps * 1e9 * 0.01 for _, gbps in points)
    assert moved == pytest.approx(2 * 3 * (2 << 20), rel=0.01)  # written and read back
    path.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"capacity": True}, r"capacity: must be None or a number of bytes >= 0, not True"),
        ({"capacity": -1}, r"capacity: must be a number of bytes >= 0 \(.*\), not -1"),
        ({"placement": "spread"}, r"placement: must be 'stripe' or 'place', not 'spread'"),
        ({"stripe_by": "latency"}, r"stripe_by: must be 'round-trip', 'write' or 'read', not 'latency'"),
        ({"checksums": 1}, r"checksums: must be a boolean, not 1"),
        ({"paths": ["dram://"]}, r"paths\.0: must be a TierPath or a Backend, not str"),
        ({"paths": "dram://"}, r"paths\.0: must be a TierPath or a Backend, not str"),
    ],
)
def test_bad_tier_arguments_are_config_errors(options: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"paths": [DramBackend(DramOptions())], **options}
    with pytest.raises(ConfigError, match=rf"^tier 't': {message}"):
        Tier("t", **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_reads": 0}, r"max_reads: must be an integer from 1 to 1024, not 0"),
        ({"max_reads": "4"}, r"max_reads: must be an integer from 1 to 1024, not '4'"),
        ({"max_writes": 2000}, r"max_writes: must be an integer from 1 to 1024, not 2000"),
        ({"max_writes": True}, r"max_writes: must be an integer from 1 to 1024, not True"),
        ({"adapt": "no"}, r"adapt: must be a boolean, not 'no'"),
        ({"backend": "dram://"}, r"backend: must be a Backend, not str"),
        ({"bandwidth": (1e9, 1e9)}, r"bandwidth: must be None or a Bandwidth, not \(1000000000\.0, "),
    ],
)
def test_bad_path_arguments_are_config_errors(options: dict[str, object], message: str) -> None:
    """As a document's path with the same option is refused, naming the argument."""
    arguments: dict[str, object] = {"backend": DramBackend(DramOptions()), **options}
    with pytest.raises(ConfigError, match=rf"^path 'p': {message}"):
        TierPath("p", **arguments)  # type: ignore[arg-type]


def test_a_scheduler_s_bad_limit_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^path 'p': max_reads: must be an integer from 1 to 1024, not 0$"):
        PathScheduler("p", max_reads=0)
    with pytest.raises(ConfigError, match=r"^slots: must be an integer >= 1, not 0$"):
        NodeLimiter("shared", 0, tmp_path)


@pytest.mark.parametrize(
    ("function", "options", "definitions"),
    [
        (Tier, TierOptions.model_fields.keys(), (TierConfig, TierOptions)),
        (TierPath, PathOptions.model_fields.keys(), (PathConfig, TierConfig)),
        (PathScheduler, {"max_reads", "max_writes"}, (PathConfig,)),
    ],
)
def test_tier_and_path_options_default_as_their_definitions(
    function: Callable[..., object], options: Iterable[str], definitions: tuple[type[ConfigModel], ...]
) -> None:
    """Each option a tier or a path takes from Python has the default of its one definition, the
    configuration document's field (or, for what no document takes, its options model's)."""
    parameters = inspect.signature(function).parameters
    for name in options:
        definition = next(model.model_fields[name] for model in definitions if name in model.model_fields)
        assert parameters[name].default == definition.default, name


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("shared", [True, False])
def test_meters_of_one_path_credit_concurrent_reads_and_writes_with_the_shared_device(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """A read and a write of 1 GB each, together for 1 s: the device moved 2 GB/s. Sharing one
    in-flight count, each meter says 2 GB/s, and read time plus write time is the 1 s it took;
    counted apart, each says 1 GB/s and a model would predict 2 s."""
    clock = _Clock()
    monkeypatch.setattr("tierstore.bandwidth.time.monotonic", clock)
    in_flight = InFlight() if shared else None
    read = ThroughputMeter(in_flight=in_flight)
    write = ThroughputMeter(in_flight=in_flight)
    stamps = read.started(), write.started()
    clock.now = 1.0
    read.finished(stamps[0], 10**9)
    write.finished(stamps[1], 10**9)
    expected = 2e9 if shared else 1e9
    assert read.estimate == pytest.approx(expected) and write.estimate == pytest.approx(expected)
    assert read.busy_seconds == write.busy_seconds == pytest.approx(1.0)
    assert read.estimate is not None and write.estimate is not None
    predicted = transfer_seconds([PathSpeed("p", read.estimate, write.estimate)], [1.0], 1e9, 1e9)
    assert predicted == pytest.approx(1.0 if shared else 2.0)


def test_a_tier_path_shares_one_in_flight_count_between_its_directions() -> None:
    path = TierPath("p", open_backend({"type": "dram"}))
    assert path.meters["read"].in_flight is path.meters["write"].in_flight


def test_a_path_is_busy_while_any_request_of_either_direction_is_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read from 0 to 2 s and a write from 1 to 3 s, then nothing until 5 s: each direction was
    busy 2 s, the path 3 s (the overlap counted once, the idle tail not at all)."""
    clock = _Clock()
    monkeypatch.setattr("tierstore.bandwidth.time.monotonic", clock)
    path = TierPath("p", open_backend({"type": "dram"}))
    read, write = path.meters["read"], path.meters["write"]
    reading = read.started()
    clock.now = 1.0
    writing = write.started()
    clock.now = 2.0
    read.finished(reading, 1)
    clock.now = 3.0
    write.finished(writing, 1)
    clock.now = 5.0
    assert read.busy_seconds == pytest.approx(2.0) and write.busy_seconds == pytest.approx(2.0)
    assert path.busy_seconds == pytest.approx(3.0)
    assert path.stats()["busy_seconds"] == pytest.approx(3.0)
    path.close()


# -- copying an object tier to tier -------------------------------------------------------------------
def nvme_tier(root: Path, name: str, paths: int, capacity: int | None = None) -> Tier:
    return Tier(name, [open_backend(f"nvme://{root / f'{name}{i}'}") for i in range(paths)], capacity)


def files(root: Path, tier: str) -> list[Path]:
    return sorted(path for path in root.glob(f"{tier}*/*") if path.is_file())


def test_copy_from_links_each_extent_to_the_path_of_its_index(tmp_path: Path) -> None:
    """A striped object copied onto a tier with as many paths: one object, every extent hard-linked
    onto the path of the same index with its checksum, read back verified."""
    data = torch.arange(3 << 18, dtype=torch.int32)
    source, target = nvme_tier(tmp_path, "source", 2), nvme_tier(tmp_path, "target", 2)
    try:
        original = source.write("original", data.numpy().data.cast("B"), Priority.CRITICAL).result()
        assert len(original.extents) == 2
        copied = target.copy_from(original, lambda: "copy", split=False)
        assert copied is not None
        [(offset, placement)] = copied
        assert offset == 0 and placement.name == "copy" and placement.tier is target
        assert (placement.extents, placement.checksums) == (original.extents, original.checksums)
        assert target.used_bytes == data.nbytes
        assert [path.stat().st_nlink for path in files(tmp_path, "target")] == [2, 2]
        out = torch.empty_like(data)
        target.read_into(placement, out.numpy().data.cast("B"), Priority.CRITICAL).result()
        assert torch.equal(out, data)
    finally:
        source.close()
        target.close()


def test_copy_from_a_tier_with_more_paths_splits_only_when_allowed(tmp_path: Path) -> None:
    """Two extents meeting on one path: without ``split``, None and nothing copied; with it, one
    object per extent at its offset, each holding its bytes and checksum."""
    data = torch.arange(3 << 18, dtype=torch.int32)
    source, target = nvme_tier(tmp_path, "source", 2), nvme_tier(tmp_path, "target", 1)
    names = iter(["first", "second"])
    try:
        original = source.write("original", data.numpy().data.cast("B"), Priority.CRITICAL).result()
        assert target.copy_from(original, lambda: next(names), split=False) is None
        assert files(tmp_path, "target") == [] and target.used_bytes == 0
        copied = target.copy_from(original, lambda: next(names), split=True)
        assert copied is not None
        assert [(offset, placement.name) for offset, placement in copied] == [
            (extent.offset, name) for extent, name in zip(original.extents, ["first", "second"], strict=True)
        ]
        assert [placement.checksums for _, placement in copied] == [(c,) for c in original.checksums]
        assert target.used_bytes == data.nbytes
        whole = data.numpy().data.cast("B")
        for offset, placement in copied:
            out = bytearray(placement.nbytes)
            target.read_into(placement, memoryview(out), Priority.CRITICAL).result()
            assert out == whole[offset : offset + placement.nbytes]
    finally:
        source.close()
        target.close()


def test_copy_from_leaves_nothing_where_a_path_cannot_copy_or_the_tier_is_full(tmp_path: Path) -> None:
    """The first extent is linked, the second lies in memory (no copy without this process): None,
    the link deleted, no capacity held. A tier too small refuses before copying anything."""
    data = torch.arange(3 << 18, dtype=torch.int32)
    mixed = Tier("mixed", [open_backend(f"nvme://{tmp_path / 'mixed0'}"), DramBackend(DramOptions())])
    target = nvme_tier(tmp_path, "target", 2)
    small = nvme_tier(tmp_path, "small", 2, capacity=data.nbytes - 1)
    try:
        original = mixed.write("original", data.numpy().data.cast("B"), Priority.CRITICAL).result()
        assert [extent.path for extent in original.extents] == [0, 1]
        assert target.copy_from(original, lambda: "copy", split=True) is None
        assert files(tmp_path, "target") == [] and target.used_bytes == 0
        with pytest.raises(CapacityError, match="small"):
            small.copy_from(original, lambda: "copy", split=True)
        assert files(tmp_path, "small") == [] and small.used_bytes == 0
    finally:
        for tier in (mixed, target, small):
            tier.close()
