"""The device layer's ordering and lifetimes (tierstore.device), on a simulated device whose copies
complete only when the test says so; the same on the store's device paths; page-locking (typed
failure, unlocked exactly once, kept out of forked children); and a store that never pins never
touches CUDA. The same paths on a real GPU: tests/test_gpu.py."""

from __future__ import annotations

import functools
import gc
import re
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tierstore import BufferPool, CapacityError, ConfigError, PinnedMemoryError, StagingArea, TierStore
from tierstore.buffers import AlignedBuffer
from tierstore.device import PIECE_BYTES, DeviceCopies
from tierstore.device_runtime import cudart_path
from tierstore.memory import MemoryLedger
from tierstore.testing.device import Operation, SimulatedDevice, SimulatedStream

from .conftest import StoreFactory


@pytest.fixture
def sim() -> SimulatedDevice:
    return SimulatedDevice()


def staged_copies(sim: SimulatedDevice, ledger: MemoryLedger | None = None) -> DeviceCopies:
    """A device layer over ``sim`` with pinned pieces reserved from ``ledger``, as a store's."""
    ledger = ledger or MemoryLedger(None)

    def staging(nbytes: int, runtime: object) -> StagingArea:
        return StagingArea(ledger, "device copies", nbytes, pin=True, runtime=sim)

    return DeviceCopies(sim, staging=staging)


def host(tensor: torch.Tensor) -> torch.Tensor:
    """A simulated device tensor's values as a plain tensor."""
    return tensor.as_subclass(torch.Tensor).clone()


# -- one copy: ordered after the caller's work, its memory held until it ends -------------------------
def test_a_copy_waits_for_the_callers_work_and_holds_its_memory_until_it_ends(sim: SimulatedDevice) -> None:
    copies = DeviceCopies(sim)
    source = sim.tensor(torch.zeros(1000))
    sim.kernel(lambda: source.fill_(7), "produce")  # queued before the call, not run yet
    destination = torch.zeros(1000)
    staged = torch.ones(3)  # some other memory the copy must keep alive
    staged_ref = weakref.ref(staged)
    ended: list[str] = []
    transfer = copies.copy(
        destination, source, copies.caller(sim.device), hold=(staged,), on_end=lambda: ended.append("x")
    )
    del staged
    (copy_stream,) = sim.copy_streams()
    assert sim.run(copy_stream) == 0  # it waits for the caller's event first
    assert copy_stream.pending()[0].startswith("wait") and not destination.any()
    sim.run(sim.compute)  # the kernel, then the caller's event
    sim.run(copy_stream, 2)  # the wait and the copy; not yet the end event
    assert torch.equal(destination, torch.full((1000,), 7.0))
    copies.reap()
    assert staged_ref() is not None and not ended  # ended only once its event has completed
    sim.run(copy_stream)
    copies.reap()
    assert staged_ref() is None and ended == ["x"]
    copies.reap()
    copies.wait(transfer)
    assert ended == ["x"]  # once
    assert sim.completed == [
        "compute: kernel produce",
        "compute: record event0",
        "copy1: wait event0",
        "copy1: copy 4000 bytes",
        "copy1: record event1",
    ]


def test_a_copy_to_a_device_is_waited_for_by_the_callers_later_work(sim: SimulatedDevice) -> None:
    copies = DeviceCopies(sim)
    destination = sim.tensor(torch.zeros(4))
    read_before, read_after = [], []
    sim.kernel(lambda: read_before.append(host(destination)), "reads it before")
    caller = copies.caller(sim.device)
    transfer = copies.to_device(destination, torch.arange(4.0), caller)
    sim.kernel(lambda: read_after.append(host(destination)), "reads it after")
    assert sim.compute.pending() == [
        "kernel reads it before",
        "record event0",
        f"wait {transfer.end.name}",  # type: ignore[attr-defined]
        "kernel reads it after",
    ]
    sim.run_all()
    assert torch.equal(read_before[0], torch.zeros(4)) and torch.equal(read_after[0], torch.arange(4.0))


def test_a_buffer_goes_back_to_its_pool_only_once_its_copy_has_ended(sim: SimulatedDevice) -> None:
    pool = BufferPool(1 << 20, pin=True, runtime=sim)
    buffer = pool.try_acquire(4096)
    assert buffer is not None
    copies = DeviceCopies(sim)
    source = sim.tensor(torch.arange(4096, dtype=torch.uint8))
    copies.copy(buffer.view(4096), source, copies.caller(sim.device), on_end=lambda: pool.release(buffer))
    copies.reap()
    assert pool.in_use_bytes == 4096
    sim.run_all()
    assert pool.in_use_bytes == 4096  # the event has completed, but nobody has looked yet
    copies.reap()
    assert pool.in_use_bytes == 0


def test_close_waits_for_every_copy_in_flight(sim: SimulatedDevice) -> None:
    copies = DeviceCopies(sim)
    destinations = [torch.zeros(10) for _ in range(3)]
    for destination in destinations:
        copies.copy(destination, sim.tensor(torch.ones(10)), copies.caller(sim.device))
    copies.close()
    assert all(bool(destination.all()) for destination in destinations)
    assert not sim.compute.queue and not sim.copy_streams()[0].queue


# -- whole tensors through the pinned pieces --------------------------------------------------------
class CountingDevice(SimulatedDevice):
    """A simulated device that counts the copies between host and device memory queued on a copy
    stream and not run yet, at most."""

    def __init__(self) -> None:
        super().__init__()
        self.most_queued = 0
        self._host_copies: list[Operation] = []

    def copy(self, stream: object, destination: torch.Tensor, source: torch.Tensor) -> None:
        super().copy(stream, destination, source)
        assert isinstance(stream, SimulatedStream)
        if self.device_of(destination) is None or self.device_of(source) is None:
            self._host_copies.append(stream.queue[-1])
        queued = sum(operation in stream.queue for operation in self._host_copies)
        self.most_queued = max(self.most_queued, queued)


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.t(),
    "conjugate": lambda t: torch.complex(t, t).conj(),
    "negative": lambda t: torch.complex(t, t).conj().imag,  # a view with the negative bit
}


@pytest.mark.parametrize("view", VIEWS)
def test_download_and_upload_move_a_tensor_of_any_strides_through_two_pieces(view: str) -> None:
    sim = CountingDevice()
    ledger = MemoryLedger(None)
    copies = staged_copies(sim, ledger)
    base = torch.randn(1500, 1500)  # several pieces of 4 MiB
    values = VIEWS[view](base)
    device_values = VIEWS[view](sim.tensor(base))
    assert device_values.is_conj() == (view == "conjugate") and device_values.is_neg() == (view == "negative")
    nbytes = values.numel() * values.element_size()
    assert nbytes > 2 * PIECE_BYTES
    downloaded = bytearray(nbytes)
    copies.download(device_values, memoryview(downloaded), copies.caller(sim.device))
    expected = values.resolve_conj().resolve_neg().contiguous()
    assert np.array_equal(np.frombuffer(downloaded, np.uint8), expected.view(torch.uint8).reshape(-1).numpy())
    destination = VIEWS[view](sim.tensor(torch.zeros_like(base)))
    copies.upload(memoryview(downloaded), destination, copies.caller(sim.device))
    assert torch.equal(host(destination), expected)
    assert sim.most_queued == 2  # two pieces; one is refilled only once its copy has ended
    assert ledger.held() == {"device copies": 2 * PIECE_BYTES}  # made once, at the first copy
    copies.close()
    assert ledger.held() == {} and sim.locked == {} and sim.unlock_calls == 1


# -- page-locked memory ---------------------------------------------------------------------------------
def release_then_close(pool: BufferPool, buffer: AlignedBuffer) -> None:
    pool.release(buffer)
    pool.close()


def close_then_release(pool: BufferPool, buffer: AlignedBuffer) -> None:
    pool.close()
    pool.release(buffer)


def release_then_clear(pool: BufferPool, buffer: AlignedBuffer) -> None:
    pool.release(buffer)
    pool.clear()


def nothing(pool: BufferPool, buffer: AlignedBuffer) -> None:
    """Let go of both: they are garbage."""


RELEASES: dict[str, Callable[[BufferPool, AlignedBuffer], None]] = {
    "release, then close": release_then_close,
    "close, then release": close_then_release,
    "release, then clear": release_then_clear,
    "nothing: garbage": nothing,
}


@pytest.mark.parametrize("resident", [False, True], ids=["pool", "resident pool"])
@pytest.mark.parametrize("release", RELEASES)
def test_pinned_memory_is_unlocked_exactly_once_whatever_the_order_of_release(
    sim: SimulatedDevice, release: str, resident: bool
) -> None:
    pool = BufferPool(1 << 20, pin=True, resident=resident, runtime=sim)
    buffer = pool.try_acquire(100_000)
    assert buffer is not None
    view = buffer.view(100_000)
    assert sim.lock_calls == 1 and len(sim.locked) == 1
    RELEASES[release](pool, buffer)
    assert sim.unlock_calls == (0 if release == "nothing: garbage" else 1)
    del pool, buffer, view
    gc.collect()
    pool = BufferPool(1 << 20, pin=True, resident=resident, runtime=sim)
    assert pool.try_acquire(100_000) is not None  # a new map, perhaps at the same address
    pool.close()
    del pool
    gc.collect()
    assert sim.errors == [] and sim.locked == {}
    assert sim.lock_calls == sim.unlock_calls == 2


def test_a_buffer_of_its_own_map_is_unlocked_exactly_once(sim: SimulatedDevice) -> None:
    buffer = AlignedBuffer(1 << 16, pin=True, runtime=sim)
    view = buffer.view(10)
    buffer.free()
    buffer.free()
    del buffer, view
    gc.collect()
    lone = AlignedBuffer(1 << 16, pin=True, runtime=sim)
    del lone
    gc.collect()
    assert sim.errors == [] and sim.locked == {} and sim.lock_calls == sim.unlock_calls == 2


def test_a_pool_closed_while_a_copy_is_in_flight_keeps_its_memory_until_the_copy_ends(
    sim: SimulatedDevice,
) -> None:
    staging = StagingArea(MemoryLedger(None), "device copies", 1 << 20, pin=True, runtime=sim)
    buffer = staging.try_acquire(1 << 20)
    assert buffer is not None
    copies = DeviceCopies(sim)
    source = sim.tensor(torch.full((1 << 20,), 3, dtype=torch.uint8))
    copies.copy(
        buffer.view(1 << 20),
        source,
        copies.caller(sim.device),
        on_end=functools.partial(staging.release, buffer),
    )
    address = buffer.tensor.data_ptr()
    del buffer
    staging.close()
    gc.collect()
    assert address in sim.locked and sim.unlock_calls == 0  # the copy still writes there
    sim.run_all()
    copies.reap()
    gc.collect()
    assert sim.locked == {} and sim.unlock_calls == 1 and sim.errors == []


def test_a_failed_page_lock_is_a_typed_error_naming_the_size_and_the_limits(sim: SimulatedDevice) -> None:
    pool = BufferPool(1 << 20, pin=True, runtime=sim)
    sim.fail_lock = "cudaHostRegister: out of memory (cudaError 2)"
    with pytest.raises(PinnedMemoryError) as raised:
        pool.try_acquire(4096)
    message = str(raised.value)
    assert isinstance(raised.value, CapacityError)
    assert "1048576 bytes" in message and "out of memory" in message
    assert re.search(r"ulimit -l\) (unlimited|\d+ bytes)", message) and "vm.max_map_count" in message
    assert sim.last_error is None  # reset: torch's next kernel launch would report it
    assert pool.allocated_bytes == 0 and pool.in_use_bytes == 0
    assert pool.try_acquire(4096) is not None and sim.locked  # the next try pins
    pool.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_pinning_without_cuda_is_a_typed_error() -> None:
    with pytest.raises(PinnedMemoryError, match=r"no CUDA device is available.*ulimit -l"):
        BufferPool(1 << 20, pin=True).try_acquire(1)


def _map_flags(address: int) -> list[str]:
    """The kernel's flags (``VmFlags``) of the map holding ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no map holds {address:#x}")


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "unpinned"])
def test_pinned_maps_are_not_inherited_by_a_forked_child(sim: SimulatedDevice, pin: bool) -> None:
    pool = BufferPool(1 << 20, pin=pin, runtime=sim)
    buffer = pool.try_acquire(4096)
    assert buffer is not None
    assert ("dc" in _map_flags(buffer.tensor.data_ptr())) == pin  # dc: do not copy on fork
    pool.release(buffer)
    pool.close()


def test_the_cuda_runtime_library_is_found_in_the_process_maps() -> None:
    lib = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    maps = (
        "7f0000000000-7f0000001000 r--p 00000000 08:01 123 /usr/lib/libc.so.6\n"
        "7f0000001000-7f0000002000 rw-p 00000000 00:00 0 \n"
        f"7f0000002000-7f0000003000 r-xp 00000000 08:01 456 {lib}\n"
    )
    assert cudart_path(maps) == lib
    assert cudart_path(maps.replace("libcudart", "libcublas")) is None


# -- a store that copies to a device -------------------------------------------------------------------
@pytest.fixture
def sim_store(open_store: StoreFactory, sim: SimulatedDevice) -> Iterator[Callable[..., TierStore]]:
    """Stores whose device copies run on ``sim`` (set before the store's first device copy)."""

    def factory(**options: object) -> TierStore:
        store = open_store(**options)
        store._operations.device.runtime = sim
        return store

    yield factory


CACHES = {"cached": 64 << 20, "uncached": 0}


@pytest.mark.parametrize("cache_budget", CACHES.values(), ids=CACHES.keys())
def test_a_put_reads_the_tensor_after_the_work_queued_before_it(
    sim_store: Callable[..., TierStore], sim: SimulatedDevice, cache_budget: int
) -> None:
    store = sim_store(cache_budget=cache_budget)
    final = torch.randn(3, 1_000_003)  # three pieces and a bit
    produced = sim.tensor(torch.zeros_like(final))
    sim.kernel(lambda: produced.copy_(final), "a long kernel producing it")
    store.put("x", produced).result()
    assert torch.equal(store.get("x").result(), final)
    assert store.stats()["memory"]["reserved_bytes"]["device copies"] == 2 * PIECE_BYTES


@pytest.mark.parametrize("cache_budget", CACHES.values(), ids=CACHES.keys())
def test_a_get_into_device_memory_is_ordered_between_the_callers_kernels(
    sim_store: Callable[..., TierStore], sim: SimulatedDevice, cache_budget: int
) -> None:
    store = sim_store(cache_budget=cache_budget)
    values = torch.randn(2_000_001)
    store.put("x", values).result()
    out = sim.tensor(torch.zeros(2_000_001))
    read: list[torch.Tensor] = []
    sim.kernel(lambda: read.append(host(out)), "still reads out")
    assert store.get("x", out=out).result() is out
    sim.kernel(lambda: read.append(host(out)), "reads what get wrote")
    sim.run_all()
    waits = [entry for entry in sim.completed if entry.startswith("compute: wait")]
    assert len(waits) == 1  # the caller's stream waited for the copies' end
    assert torch.equal(read[0], torch.zeros(2_000_001)) and torch.equal(read[1], values)


@pytest.mark.parametrize("cache_budget", CACHES.values(), ids=CACHES.keys())
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int8, torch.bool, torch.complex64])
def test_device_tensors_round_trip_bit_identical(
    sim_store: Callable[..., TierStore], sim: SimulatedDevice, cache_budget: int, dtype: torch.dtype
) -> None:
    store = sim_store(cache_budget=cache_budget)
    values = torch.randn(513, 4099).mul(100).to(dtype)
    store.put("x", sim.tensor(values)).result()
    on_device = store.get("x", device="cuda").result()
    assert sim.device_of(on_device) == sim.device and torch.equal(host(on_device), values)
    strided = sim.tensor(torch.zeros(4099, 513, dtype=dtype)).t()
    store.get("x", out=strided).result()
    assert torch.equal(host(strided), values)
    assert torch.equal(store.get("x").result(), values)  # a new CPU tensor by default
    assert torch.equal(store.get("x", device="cpu").result(), values)


def test_a_device_copy_past_the_cache_stays_within_the_memory_budget(
    sim_store: Callable[..., TierStore], sim: SimulatedDevice
) -> None:
    store = sim_store(cache_budget=0, memory_budget=16 << 20)
    store.put("small", sim.tensor(torch.ones(1 << 20))).result()  # 4 MiB: fits beside the pieces
    with pytest.raises(CapacityError, match="device copies"):
        store.put("large", sim.tensor(torch.ones(4 << 20))).result()  # 16 MiB of host memory
    assert "large" not in store and store.memory.held() == {"cache": 0, "device copies": 2 * PIECE_BYTES}


def test_closing_the_store_unlocks_its_pinned_memory_once(
    sim_store: Callable[..., TierStore], sim: SimulatedDevice
) -> None:
    store = sim_store()
    store.put("x", sim.tensor(torch.ones(10))).result()
    assert len(sim.locked) == 1
    area = store.staging("workload", 1 << 20, pin=True)  # pinned by the store's runtime too
    buffer = area.try_acquire(4096)
    assert buffer is not None and area.pinned and len(sim.locked) == 2
    area.release(buffer)
    area.close()
    store.close()
    gc.collect()
    assert sim.locked == {} and sim.lock_calls == sim.unlock_calls == 2 and sim.errors == []


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"device": "cuda", "out": torch.zeros(3)}, "pass out or device, not both"),
        ({"device": "meta"}, "'cpu' or a CUDA device"),
        ({"device": "not a device"}, "'cpu' or a CUDA device"),
        ({"device": 3.5}, "'cpu' or a CUDA device"),
    ],
)
def test_get_refuses_a_bad_device(
    sim_store: Callable[..., TierStore], arguments: dict[str, object], message: str
) -> None:
    store = sim_store()
    store.put("x", torch.zeros(3)).result()
    with pytest.raises(ConfigError, match=message):
        store.get("x", **arguments)  # type: ignore[arg-type]


# -- without a device copy, CUDA is never touched ------------------------------------------------------
def test_a_store_that_copies_no_tensor_to_a_device_never_touches_cuda(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def touched(*args: object, **kwargs: object) -> None:
        raise AssertionError("CUDA was touched")

    initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # by an earlier GPU test
    for name in ("is_available", "cudart", "init", "_lazy_init", "current_device", "device_count"):
        monkeypatch.setattr(torch.cuda, name, touched)
    store = open_store(cache_budget=1 << 20)
    store.put("small", torch.ones(10)).result()
    store.put("large", torch.ones(1 << 20)).result()  # past the cache
    assert torch.equal(store.get("small").result(), torch.ones(10))
    assert torch.equal(store.get("large", out=torch.zeros(1 << 20)).result(), torch.ones(1 << 20))
    staging = store.staging("workload", 1 << 20)
    buffer = staging.try_acquire(4096)
    assert buffer is not None and not staging.pinned
    staging.release(buffer)
    staging.close()
    assert BufferPool(1 << 20).try_acquire(1) is not None
    monkeypatch.undo()
    assert torch.cuda.is_initialized() == initialised  # type: ignore[no-untyped-call]
