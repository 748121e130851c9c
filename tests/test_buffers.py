import resource
import sys
from typing import Any

import numpy as np
import pytest
import torch

from tierstore import AlignedBuffer, BufferPool, CapacityError
from tierstore.buffers import ALIGNMENT, HUGE_MAP_BYTES, HUGE_PAGE, buffer_address, round_up

from .helpers import map_count


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 << 20])
def test_buffers_are_page_aligned_and_rounded(nbytes: int) -> None:
    buffer = AlignedBuffer(nbytes)
    assert buffer.capacity == round_up(nbytes) and buffer.capacity % ALIGNMENT == 0
    assert buffer.tensor.data_ptr() % ALIGNMENT == 0
    assert buffer_address(buffer.memoryview(nbytes)) == buffer.tensor.data_ptr()
    buffer.view(nbytes).fill_(7)
    assert bytes(buffer.memoryview(1)) == b"\x07" and int(buffer.view(nbytes).sum()) == 7 * nbytes


def test_tensor_view_outlives_the_buffer_object() -> None:
    view = AlignedBuffer(8192).view(8192)  # the buffer object is gone; the mapping must not be
    view.fill_(1)
    assert int(view.sum()) == 8192


def test_pool_reuses_buffers_of_the_same_size() -> None:
    pool = BufferPool(1 << 20)
    first = pool.try_acquire(10_000)
    assert first is not None
    pool.release(first)
    assert pool.try_acquire(9_000) is first  # same page-rounded size class
    assert pool.allocated_bytes == round_up(10_000)


def test_pool_never_exceeds_capacity() -> None:
    pool = BufferPool(5 * 4096)
    held = [pool.try_acquire(4096) for _ in range(5)]
    assert all(held) and pool.allocated_bytes == 5 * 4096
    assert pool.try_acquire(1) is None
    pool.release(held[0])  # type: ignore[arg-type]
    pool.release(held[1])  # type: ignore[arg-type]
    bigger = pool.try_acquire(2 * 4096)  # idle small buffers are freed to make room
    assert bigger is not None and pool.allocated_bytes == 5 * 4096
    assert pool.in_use_bytes == 5 * 4096


def test_pool_rejects_what_can_never_fit() -> None:
    with pytest.raises(CapacityError, match="exceeds the pool's capacity"):
        BufferPool(4096).try_acquire(4097)
    with pytest.raises(CapacityError):
        BufferPool(-1)


def test_hundreds_of_thousands_of_small_buffers_share_a_few_maps() -> None:
    """One map per buffer hit vm.max_map_count (~65k) with a quarter of a 1 GiB budget in use."""
    pool = BufferPool(1 << 30, pin=False)
    before = map_count()
    held = [pool.try_acquire(64 if index % 4 else 4096) for index in range(300_000)]
    assert all(buffer is not None for buffer in held)
    assert map_count() - before < 64
    # 225k slots of 64 bytes fill 3,516 pages; 75k buffers of a page each: exactly what is held
    assert pool.allocated_bytes == (-(-225_000 // 64) + 75_000) * 4096 <= pool.capacity
    assert pool.in_use_bytes == 225_000 * 64 + 75_000 * 4096


def test_carved_buffers_are_aligned_and_never_overlap() -> None:
    pool = BufferPool(4 << 20, pin=False)
    sizes = [1, 64, 65, 2048, 2049, 4096, 4097, 12_288, 100_000, 1 << 20]
    held = [pool.try_acquire(size) for size in sizes * 2]
    for index, (size, buffer) in enumerate(zip(sizes * 2, held, strict=True)):
        assert buffer is not None and buffer.capacity >= size
        address = buffer.tensor.data_ptr()
        assert address % (4096 if size > 2048 else 64) == 0
        assert buffer_address(buffer.memoryview(1)) == address
        buffer.view(size).fill_(index)
    for index, (size, buffer) in enumerate(zip(sizes * 2, held, strict=True)):
        assert buffer is not None and bool((buffer.view(size) == index).all()), size


def test_freed_memory_merges_back_for_larger_buffers() -> None:
    """Idle slots and pages are given back (whole slabs, merged buddies) when another size needs
    the room; the pool then serves one buffer as large as the whole budget."""
    pool = BufferPool(1 << 20, pin=False)
    small = [pool.try_acquire(100) for _ in range(3000)] + [pool.try_acquire(5000) for _ in range(30)]
    assert all(buffer is not None for buffer in small) and pool.try_acquire(1 << 20) is None
    for buffer in small:
        pool.release(buffer)  # type: ignore[arg-type]
    whole = pool.try_acquire(1 << 20)
    assert whole is not None and pool.allocated_bytes == 1 << 20
    pool.release(whole)
    pool.clear()
    assert pool.allocated_bytes == 0 and pool.in_use_bytes == 0


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps header and fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
                if inside:
                    fields["header"] = line
            elif inside:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_large_buffers_are_private_memory_aligned_to_huge_pages() -> None:
    """O_DIRECT requests from 4 KiB pages are split into small pieces (one segment per page run);
    large buffers sit on huge pages, which need private (not shared, shmem) anonymous maps."""
    own = AlignedBuffer(HUGE_MAP_BYTES)
    pool = BufferPool(4 * HUGE_MAP_BYTES)
    carved = pool.try_acquire(HUGE_PAGE + 1)
    assert carved is not None
    for buffer in (own, carved):
        address = buffer_address(buffer.memoryview(1))
        assert address % HUGE_PAGE == 0
        mapping = _mapping_of(address)
        assert "/dev/zero" not in mapping["header"] and " rw-p " in mapping["header"], mapping["header"]
    small = AlignedBuffer(HUGE_PAGE)
    assert " rw-p " in _mapping_of(buffer_address(small.memoryview(1)))["header"]


def test_a_lease_comes_back_when_the_last_tensor_over_it_is_gone() -> None:
    returned: list[bool] = []
    pool = BufferPool(1 << 20, pin=False)
    lease = pool.try_lease(10_000, lambda: returned.append(True))
    assert lease is not None and lease.tensor.numel() == 10_000
    lease.io.fill_(3)  # the same bytes
    assert int(lease.tensor[9_999]) == 3
    view = torch.empty(0, dtype=torch.float32).set_(lease.tensor.untyped_storage(), 10, (100,), (1,))
    io = lease.io
    del lease
    assert pool.in_use_bytes == round_up(10_000) and not returned  # a view still holds it
    del view
    assert pool.in_use_bytes == 0 and returned == [True]  # the io tensor does not hold it
    assert int(io[0]) == 3


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` the kernel has in memory (/proc/self/pagemap)."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // ALIGNMENT * 8)
        entries = np.frombuffer(pagemap.read(nbytes // ALIGNMENT * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * ALIGNMENT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
@pytest.mark.parametrize("capacity", [24 << 20, 96 << 20], ids=["small-pages", "huge-pages"])
def test_a_resident_pool_reuses_its_pages_for_every_size_and_holds_no_more_than_its_capacity(
    capacity: int,
) -> None:
    """Buffers of changing sizes, as saved activations come, the same sequence every step: after
    the first step every buffer lands on pages touched before (no page faults), and the pool's map
    never has more in memory than the capacity (as the kernel reports it, not by the pool's own
    count)."""
    pool = BufferPool(capacity, pin=False, resident=True)
    first = pool.try_lease(1)
    assert first is not None
    base = buffer_address(first.io.numpy().data)  # the first buffer starts the map
    del first
    generator = torch.Generator().manual_seed(0)
    choices = [capacity // 3, capacity // 8, capacity // 5, 1 << 20, capacity // 4, 300_000]
    sizes = [choices[index] for index in torch.randint(0, len(choices), (30,), generator=generator)]

    def one_round() -> None:
        held: list[Any] = []
        for size in sizes:
            lease = pool.try_lease(size)
            while lease is None:  # full: let the oldest go, as writes finishing would
                held.pop(0)
                lease = pool.try_lease(size)
            lease.tensor.fill_(1)  # touch every page
            held.append(lease.tensor)
            assert _resident_bytes(base, pool.arena_bytes) <= pool.capacity

    one_round()
    faults = _minor_faults()
    one_round()
    one_round()
    assert _minor_faults() - faults < 200  # a few for Python's own objects, none per page
    assert pool.allocated_bytes <= pool.capacity <= capacity
