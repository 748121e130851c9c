import pytest

from tierstore import AlignedBuffer, BufferPool, CapacityError
from tierstore.buffers import ALIGNMENT, buffer_address, round_up


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
