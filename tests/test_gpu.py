"""The store's device paths on a real GPU: every test here is marked ``gpu`` and skips without CUDA
(the same ordering and lifetimes are tested on a simulated device in tests/test_device.py; the
copies' overlap with compute is measured by benchmarks/bench_gpu_store.py).

Run them with ``pytest -m gpu`` on a GPU node, or through the GPU check (``tools/gpu_check.py``).
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from tierstore.backends import open_backend

from tierstore import BufferPool, PinnedMemoryError, StagingArea, Tier, TierStore
from tierstore.device import CUDA, DeviceCopies, lock_pages
from tierstore.memory import MemoryLedger

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
TIERS = ["nvme", "nvme, two paths", "dram"]
CACHES = {"cached": 64 << 20, "uncached": 0}


def tier_of(kind: str, directory: Path) -> Tier:
    if kind == "dram":
        return Tier("ram", open_backend("dram://"))
    if kind == "nvme":
        return Tier("nvme", open_backend(f"nvme://{directory / 'nvme'}"))
    paths = [open_backend(f"nvme://{directory / f'path{index}'}?chunk_bytes=64KiB") for index in range(2)]
    return Tier("nvme2", paths)


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., TierStore]]:
    stores: list[TierStore] = []

    def factory(kind: str = "nvme", **options: object) -> TierStore:
        store = TierStore([tier_of(kind, tmp_path / str(len(stores)))], **options)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


def random_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values of every bit pattern the dtype's use makes likely, on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator, device="cuda") > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        wide = torch.complex64 if dtype.is_complex else torch.float32
        return (torch.randn(shape, generator=generator, device="cuda", dtype=wide) * 100).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, shape, generator=generator, device="cuda", dtype=torch.int64).to(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes on the CPU (compares NaNs and fp8 exactly)."""
    return tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def long_chain(size: int = 4096, steps: int = 24) -> torch.Tensor:
    """Queue tens of milliseconds of matmuls on the current stream; their result."""
    weight = torch.randn(size, size, device="cuda") / size**0.5
    x = weight
    for _ in range(steps):
        x = torch.tanh(x @ weight)
    return x


# -- every dtype through every tier, bit-identical ----------------------------------------------------
@pytest.mark.parametrize("cache_budget", CACHES.values(), ids=CACHES.keys())
@pytest.mark.parametrize("kind", TIERS)
def test_every_dtype_round_trips_bit_identical(
    open_store: Callable[..., TierStore], kind: str, cache_budget: int
) -> None:
    store = open_store(kind, cache_budget=cache_budget)
    for index, dtype in enumerate(DTYPES):
        values = random_values((257, 4099), dtype, seed=index)  # a few pinned pieces each
        strided = random_values((4099, 257), dtype, seed=100 + index).t()
        store.put(f"x{index}", values).result()
        store.put(f"t{index}", strided).result()
        for key, expected in ((f"x{index}", values), (f"t{index}", strided)):
            on_device = store.get(key, device="cuda").result()
            assert on_device.device == values.device and on_device.dtype == dtype
            assert torch.equal(bits(on_device), bits(expected)), (dtype, key)
            out = torch.empty(expected.shape[::-1], dtype=dtype, device="cuda").t()  # strided destination
            store.get(key, out=out).result()
            assert torch.equal(bits(out), bits(expected)), (dtype, key)
            assert torch.equal(bits(store.get(key).result()), bits(expected)), (dtype, key)  # CPU by default
    assert not store.get("x0").result().is_cuda


@pytest.mark.parametrize("cache_budget", CACHES.values(), ids=CACHES.keys())
def test_conjugate_and_negative_views_on_the_device_round_trip(
    open_store: Callable[..., TierStore], cache_budget: int
) -> None:
    store = open_store(cache_budget=cache_budget)
    values = random_values((1000, 1000), torch.complex64)
    store.put("conj", values.conj()).result()
    store.put("neg", values.conj().imag).result()
    assert torch.equal(store.get("conj", device="cuda").result(), values.conj())
    assert torch.equal(store.get("neg", device="cuda").result(), values.conj().imag)


# -- ordering with the caller's stream ------------------------------------------------------------------
@pytest.mark.parametrize("cache_budget", CACHES.values(), ids=CACHES.keys())
def test_a_tensor_made_on_a_side_stream_and_put_at_once_is_stored_as_made(
    open_store: Callable[..., TierStore], cache_budget: int
) -> None:
    store = open_store(cache_budget=cache_budget)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        made = long_chain()  # still running when put returns
        stored = store.put("x", made)
        stored.result()
    torch.cuda.synchronize()
    assert torch.equal(bits(store.get("x").result()), bits(made))


@pytest.mark.parametrize("on_side_stream", [False, True], ids=["current stream", "side stream"])
@pytest.mark.parametrize("cache_budget", CACHES.values(), ids=CACHES.keys())
def test_a_get_into_memory_a_queued_kernel_still_reads_waits_for_it(
    open_store: Callable[..., TierStore], cache_budget: int, on_side_stream: bool
) -> None:
    store = open_store(cache_budget=cache_budget)
    new = random_values((4 << 20,), torch.float32)
    store.put("x", new).result()
    stream = torch.cuda.Stream() if on_side_stream else torch.cuda.current_stream()  # type: ignore[no-untyped-call]
    out = torch.ones(4 << 20, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain = long_chain()
        read_before = out.sum()  # reads out once the chain has run
        store.get("x", out=out).result()
        read_after = out.sum()  # queued once the future resolved: sees the new values
    torch.cuda.synchronize()
    assert read_before.item() == out.numel()  # the copy did not overwrite it first
    assert torch.equal(read_after, new.sum()) and torch.equal(out, new)
    del chain


def test_a_checkpoint_of_tensors_made_on_a_side_stream_loads_bit_identical_onto_the_gpu(
    tmp_path: Path,
) -> None:
    from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    settings = {
        "cache": {"budget": "16MiB", "pack_below": "4KiB"},
        "tiers": [{"name": "fast", "backend": f"nvme://{tmp_path / 'fast'}"}],
    }
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), TieredStorageWriter(settings) as writer:
        saved = {
            "made": long_chain(),  # still running when the save starts
            "strided": random_values((3000, 1000), torch.bfloat16).t(),
            "large": random_values((5 << 20,), torch.float32),  # cut into several keys
        }
        save(saved, checkpoint_id="gpu", storage_writer=writer)
        saving = async_save(saved, checkpoint_id="gpu-async", storage_writer=writer, no_dist=True)
        assert isinstance(saving, Future)
        saving.result()
    torch.cuda.synchronize()
    for name in ("gpu", "gpu-async"):
        loaded = {key: torch.zeros_like(tensor) for key, tensor in saved.items()}  # on the GPU
        with TieredStorageReader(settings) as reader:
            load(loaded, checkpoint_id=name, storage_reader=reader)
        torch.cuda.synchronize()
        for key, tensor in saved.items():
            assert loaded[key].is_cuda and torch.equal(bits(loaded[key]), bits(tensor)), (name, key)


# -- memory ---------------------------------------------------------------------------------------------
def test_staging_buffers_are_pinned_only_when_asked(open_store: Callable[..., TierStore]) -> None:
    store = open_store()
    pinned = store.staging("pinned", 1 << 20, pin=True)
    plain = store.staging("plain", 1 << 20)
    for area, expected in ((pinned, True), (plain, False)):
        buffer = area.try_acquire(4096)
        assert buffer is not None and buffer.tensor.is_pinned() == expected and area.pinned == expected
        area.release(buffer)
        area.close()
    store.put("x", torch.ones(10, device="cuda")).result()  # makes the store's pinned pieces
    pieces = store._operations.device._pieces  # the pieces every device copy of the store is staged through
    assert pieces is not None
    with pieces.lend(1) as lent:
        assert all(piece.tensor.is_pinned() for piece in lent)


def test_a_store_that_copies_nothing_to_a_device_does_not_initialise_cuda(tmp_path: Path) -> None:
    child = f"""
import torch
from tierstore import Tier, TierStore
from tierstore.backends import open_backend
with TierStore([Tier("nvme", open_backend("nvme://{tmp_path / "tier"}"))], cache_budget=1 << 20) as store:
    store.put("small", torch.ones(10)).result()
    store.put("large", torch.ones(1 << 20)).result()
    assert torch.equal(store.get("small").result(), torch.ones(10))
    store.get("large", out=torch.zeros(1 << 20)).result()
    area = store.staging("workload", 1 << 20)
    area.release(area.try_acquire(4096))
    area.close()
print(torch.cuda.is_initialized())
"""
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_a_failed_page_lock_leaves_no_cuda_error_behind() -> None:
    buffer = torch.empty(1 << 20, dtype=torch.uint8)
    address = buffer.data_ptr() - buffer.data_ptr() % 4096 + 4096  # page-aligned, inside it
    lock_pages(CUDA, address, 1 << 16)
    try:
        with pytest.raises(PinnedMemoryError, match=r"65536 bytes.*ulimit -l.*vm\.max_map_count"):
            lock_pages(CUDA, address, 1 << 16)  # already registered
        # torch checks CUDA's last error at every kernel launch: a left-over one would raise here
        assert torch.ones(1000, device="cuda").sum().item() == 1000
    finally:
        CUDA.unregister(address)
    torch.cuda.synchronize()


def test_a_fork_after_pinning_leaves_the_child_working_and_the_parents_data_intact() -> None:
    pool = BufferPool(64 << 20, pin=True)
    buffer = pool.try_acquire(64 << 20)
    assert buffer is not None
    host = buffer.view(64 << 20)
    host.copy_(torch.arange(64 << 20, dtype=torch.int64).to(torch.uint8))
    child = os.fork()
    if child == 0:  # the child: CPU work of its own, as a DataLoader worker does
        code = 1
        try:
            torch.set_num_threads(1)
            code = 0 if int(torch.arange(1 << 20).sum()) == (1 << 20) * ((1 << 20) - 1) // 2 else 1
        finally:
            os._exit(code)
    host[::4096] = 7  # the parent writes after the fork: its pages stay the pinned ones
    on_device = host.to("cuda", non_blocking=True)
    back = torch.empty_like(host).pin_memory()
    back.copy_(on_device, non_blocking=True)
    torch.cuda.synchronize()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(back, host) and bool((on_device[::4096] == 7).all())
    del host, on_device
    pool.release(buffer)
    pool.close()


def test_a_pool_closed_while_a_copy_is_in_flight_keeps_its_memory_until_the_copy_ends() -> None:
    ledger = MemoryLedger(None)
    staging = StagingArea(ledger, "copies", 64 << 20, pin=True)
    buffer = staging.try_acquire(64 << 20)
    assert buffer is not None
    copies = DeviceCopies()
    source = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
    chain = long_chain(steps=200)  # about half a second, queued first: the copy waits for it
    transfer = copies.copy(
        buffer.view(64 << 20),
        source,
        copies.caller(source.device),
        on_end=functools.partial(staging.release, buffer),
    )
    check = buffer.view(64 << 20)  # the test's own view, to read the bytes afterwards
    del buffer
    staging.close()
    gc.collect()
    assert not CUDA.query(transfer.end)  # the copy is still queued behind the chain
    copies.wait(transfer)
    assert staging.in_use_bytes == 0 and ledger.held() == {}
    assert torch.equal(check, source.cpu())
    del check, chain
    gc.collect()
    assert torch.ones(1000, device="cuda").sum().item() == 1000  # no CUDA error left behind
