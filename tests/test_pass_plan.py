"""The I/O model of a pass: stripe weights, transfer times, the objects kept cached."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tierstore.backends.dram import DramBackend, DramOptions

from tierstore import ConfigError, Tier, TierStore
from tierstore.bandwidth import Bandwidth, PathSpeed
from tierstore.config import StripeBy
from tierstore.pass_plan import placement_speeds, plan_pass, stripe_weights, transfer_seconds
from tierstore.tier import TierPath

NVME = PathSpeed("nvme", read=2e9, write=1e9)
PFS = PathSpeed("pfs", read=1e9, write=1e9)


def test_weights_equalise_a_round_trip() -> None:
    weights = stripe_weights([NVME, PFS])
    share = [w / sum(weights) for w in weights]
    times = [s * (1 / p.read + 1 / p.write) for s, p in zip(share, [NVME, PFS], strict=True)]
    assert times[0] == pytest.approx(times[1])


def test_transfer_time_of_two_paths_beats_either_alone() -> None:
    both = transfer_seconds([NVME, PFS], stripe_weights([NVME, PFS]), 8e9, 8e9)
    alone = transfer_seconds([NVME], [1.0], 8e9, 8e9)
    assert both < alone
    # every path needs share * (1/read + 1/write) per byte moved both ways, i.e. 1 / sum(weights)
    assert both == pytest.approx(8e9 / sum(stripe_weights([NVME, PFS])))


def test_plan_keeps_the_end_of_the_pass() -> None:
    sizes = [100] * 10
    plan = plan_pass([NVME], budget=500, sizes=sizes, working_bytes=200)
    assert plan.keep == [7, 8, 9]
    assert plan.read_bytes == plan.write_bytes == 700
    assert plan.predicted_seconds < plan.no_cache_seconds
    assert plan.predicted_seconds == plan.static_seconds  # equal sizes: the paper's choice
    assert "keep 3 objects" in plan.explain()


def test_plan_follows_the_given_order() -> None:
    plan = plan_pass([NVME], budget=300, sizes=[100] * 5, order=[4, 3, 2, 1, 0], working_bytes=100)
    assert plan.keep == [0, 1]


def test_plan_uses_room_the_static_choice_leaves() -> None:
    sizes = [10, 10, 10, 500, 40]  # the static choice stops at the big object
    plan = plan_pass([NVME], budget=200, sizes=sizes, working_bytes=100)
    assert plan.keep == [0, 1, 2, 4]
    assert plan.predicted_seconds < plan.static_seconds


@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30),
    budget=st.integers(0, 20_000),
    working=st.integers(0, 2000),
    reverse=st.booleans(),
)
def test_never_worse_than_static_and_never_over_budget(
    sizes: list[int], budget: int, working: int, reverse: bool
) -> None:
    order = list(range(len(sizes)))[:: -1 if reverse else 1]
    plan = plan_pass([NVME, PFS], budget, sizes, order, working_bytes=working)
    assert sum(sizes[i] for i in plan.keep) <= max(0, budget - working)
    assert plan.predicted_seconds <= plan.static_seconds <= plan.no_cache_seconds


def test_compute_bound_pass() -> None:
    plan = plan_pass([NVME], budget=0, sizes=[100], compute_seconds=5.0)
    assert plan.predicted_seconds == 5.0


@pytest.mark.parametrize("paths", [[], [PathSpeed("bad", 0, 1)]])
def test_bad_paths(paths: list[PathSpeed]) -> None:
    with pytest.raises(ValueError) as raised:
        stripe_weights(paths)
    assert isinstance(raised.value, ConfigError) and str(raised.value).startswith("paths: ")


def test_bad_order() -> None:
    with pytest.raises(ValueError, match="order") as raised:
        plan_pass([NVME], 100, [1, 2], order=[0, 0])
    assert isinstance(raised.value, ConfigError)


@pytest.mark.parametrize("stripe_by", ["round-trip", "write", "read"])
def test_the_model_stripes_as_the_tier_places(stripe_by: StripeBy) -> None:
    """The speeds a workload plans with carry the tier's striping, and the model's weights from
    them are the ones the tier places objects by."""
    paths = [
        TierPath(name, DramBackend(DramOptions()), bandwidth=Bandwidth(read, write), adapt=False)
        for name, read, write in [("nvme", 3e9, 1e9), ("pfs", 1e9, 2e9)]
    ]
    with TierStore([Tier("v", paths, stripe_by=stripe_by)], cache_budget=0) as store:
        speeds = placement_speeds(store)
        assert (speeds.tier, speeds.stripe_by) == ("v", stripe_by)
        assert stripe_weights(speeds.paths, speeds.stripe_by) == store.tiers[0].weights()
