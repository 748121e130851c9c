import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierstore.placement import PAGE, Extent, place, stripe


def covers(extents: list[Extent], nbytes: int) -> bool:
    position = 0
    for extent in extents:
        if extent.offset != position or extent.length <= 0:
            return False
        position += extent.length
    return position == nbytes


@given(
    nbytes=st.integers(0, 1 << 34),
    weights=st.lists(st.floats(0, 1e4), min_size=1, max_size=6).filter(lambda w: sum(w) > 0),
)
def test_stripes_tile_the_object_on_page_edges(nbytes: int, weights: list[float]) -> None:
    extents = stripe(nbytes, weights)
    assert covers(extents, nbytes)
    assert len({e.path for e in extents}) == len(extents)  # at most one extent per path
    assert all(weights[e.path] > 0 for e in extents)
    assert all(e.offset % PAGE == 0 for e in extents)
    assert all(e.length % PAGE == 0 for e in extents[:-1])


@pytest.mark.parametrize(
    ("nbytes", "weights", "expected"),
    [
        (0, [1, 1], []),
        (1, [1, 1], [Extent(0, 0, 1)]),
        (PAGE + 1, [1, 1], [Extent(0, 0, PAGE), Extent(1, PAGE, 1)]),
        (2 * PAGE, [1, 1, 1], [Extent(0, 0, PAGE), Extent(1, PAGE, PAGE)]),  # more paths than pages
        (
            7 * PAGE,
            [4, 2, 1],
            [Extent(0, 0, 4 * PAGE), Extent(1, 4 * PAGE, 2 * PAGE), Extent(2, 6 * PAGE, PAGE)],
        ),
        (10 * PAGE, [0, 1], [Extent(1, 0, 10 * PAGE)]),
    ],
)
def test_stripe_examples(nbytes: int, weights: list[float], expected: list[Extent]) -> None:
    assert stripe(nbytes, weights) == expected


def test_shares_follow_the_weights() -> None:
    extents = stripe(1 << 30, [400, 200, 100])
    shares = [e.length / (1 << 30) for e in extents]
    assert shares == pytest.approx([4 / 7, 2 / 7, 1 / 7], abs=1e-4)


def test_granules_round_shares_to_chunks() -> None:
    chunk = 16 << 20
    extents = stripe(100 << 20, [1, 1], granules=[PAGE, chunk])
    assert extents[1].length % chunk == 0 or extents[1].offset + extents[1].length == 100 << 20
    assert covers(extents, 100 << 20)
    small = stripe(8 << 20, [1, 1], granules=[PAGE, chunk])  # share below one chunk: pages
    assert [e.length for e in small] == [4 << 20, 4 << 20]


@pytest.mark.parametrize("weights", [[], [0, 0], [-1, 2], [float("nan")], [float("inf")]])
def test_bad_weights(weights: list[float]) -> None:
    with pytest.raises(ValueError):
        stripe(100, weights)


def test_place_follows_the_weights_over_many_objects() -> None:
    weights, assigned = [2.0, 1.0], [0.0, 0.0]
    choices = []
    for _ in range(30):
        path = place(100, weights, assigned)
        assigned[path] += 100
        choices.append(path)
    assert choices.count(0) == 20 and choices.count(1) == 10
    assert choices[:6] == [0, 0, 1, 0, 0, 1]  # interleaved, not all of path 0 first


def test_place_with_random_sizes_balances_finish_times() -> None:
    rng = random.Random(0)
    weights, assigned = [400.0, 200.0, 100.0], [0.0, 0.0, 0.0]
    for _ in range(500):
        size = rng.randint(1, 1000)
        assigned[place(size, weights, assigned)] += size
    finish = [a / w for a, w in zip(assigned, weights, strict=True)]
    assert max(finish) - min(finish) <= 1000 / 100  # within one object on the slowest path
