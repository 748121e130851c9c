import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierstore import ConfigError
from tierstore.model import (
    PathSpeed,
    SavedTensor,
    SpillPlan,
    plan_pass,
    plan_spill,
    replay_spill,
    stripe_weights,
    transfer_seconds,
)
from tierstore.spill_policy import ReadAhead, Residence, Room, SpillPolicy

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


# -- activation spill plans ------------------------------------------------------------------------
DISK = [PathSpeed("disk", read=1e9, write=1e9)]


def layers(count: int, nbytes: int, forward: float, backward: float) -> list[SavedTensor]:
    """One tensor per layer, saved evenly through forward and used in reverse through backward."""
    return [
        SavedTensor(nbytes, forward * i / count, forward + backward * (count - i) / count)
        for i in range(count)
    ]


def test_spill_plan_keeps_everything_that_fits() -> None:
    plan = plan_spill(DISK, 1 << 30, layers(8, 32 << 20, 1.0, 2.0), 3.0)
    assert plan.keep == list(range(8)) and not plan.spill
    assert plan.predicted_seconds == pytest.approx(3.0)


def test_spill_plan_keeps_the_last_layers_within_the_budget() -> None:
    tensors = layers(8, 32 << 20, 1.0, 2.0)
    plan = plan_spill(DISK, 96 << 20, tensors, 3.0)
    assert plan.keep and set(plan.keep) == set(range(8 - len(plan.keep), 8))
    assert plan.peak_resident_bytes <= 96 << 20
    assert plan.use_order == sorted(plan.spill, key=lambda i: tensors[i].used_at)


def test_spill_plan_predicts_stalls_when_the_disk_is_slow() -> None:
    slow = [PathSpeed("slow", read=50e6, write=50e6)]
    tensors = layers(8, 32 << 20, 0.2, 0.4)
    everything = replay_spill(slow, 64 << 20, tensors, set(range(8)), 0.6)
    assert everything.write_stall > 0 and everything.read_stall > 0
    plan = plan_spill(slow, 64 << 20, tensors, 0.6)
    assert plan.predicted_seconds <= everything.seconds
    assert plan.spill_all_seconds == pytest.approx(everything.seconds)


@given(
    sizes=st.lists(st.integers(1, 64 << 20), min_size=1, max_size=12),
    budget_factor=st.floats(1.0, 4.0),
    bandwidth=st.floats(1e7, 1e10),
)
def test_spill_plan_is_never_worse_than_spilling_everything(
    sizes: list[int], budget_factor: float, bandwidth: float
) -> None:
    count = len(sizes)
    tensors = [SavedTensor(n, 0.1 * i, 0.1 * count + 0.2 * (count - i)) for i, n in enumerate(sizes)]
    budget = int(max(sizes) * budget_factor)
    paths = [PathSpeed("p", bandwidth, bandwidth)]
    compute = 0.3 * count
    plan = plan_spill(paths, budget, tensors, compute)
    assert plan.predicted_seconds <= plan.spill_all_seconds + 1e-9
    assert plan.peak_resident_bytes <= budget
    assert sorted([*plan.keep, *plan.spill]) == list(range(count))


class FakeStep:
    """Spilled tensors as the policy sees them, with room for ``room`` reads (one unit each)."""

    def __init__(self, residences: dict[int, Residence], room: int) -> None:
        self.residences, self.room = residences, room
        self.actions: list[str] = []

    def residence(self, tensor: int) -> Residence:
        return self.residences[tensor]

    def hand_back(self, tensor: int) -> None:
        self.actions.append(f"hand back {tensor}")

    def try_read_ahead(self, tensor: int) -> bool:
        if self.room == 0:
            return False
        self.room -= 1
        self.residences[tensor] = Residence.DONE  # being read
        self.actions.append(f"read {tensor}")
        return True

    def drop(self, tensor: int) -> None:
        self.room += 1
        self.residences[tensor] = Residence.STORED
        self.actions.append(f"drop {tensor}")


def test_spill_policy_reads_in_order_as_room_allows_and_drops_the_last_needed() -> None:
    policy = SpillPolicy()  # no plan: reverse save order
    step = FakeStep({0: Residence.STORED, 1: Residence.STORED, 2: Residence.WRITING}, room=1)
    reads = ReadAhead(policy.read_order([0, 1, 2]))
    reads.advance(step)
    assert step.actions == ["hand back 2", "read 1"] and reads.cursor == 2  # no room for 0
    step.residences[1] = step.residences[2] = Residence.AHEAD  # read back, written
    room = policy.room_to_read(step, reads, 0, writing=False, reading=False)
    assert room is Room.DROPPED and step.actions[-1] == "drop 1" and reads.cursor == 1
    room = policy.room_to_read(step, reads, 0, writing=False, reading=False)
    assert room is Room.DROPPED and step.actions[-1] == "drop 2" and reads.cursor == 0
    assert policy.room_to_read(step, reads, 0, writing=False, reading=True) is Room.WAIT
    assert policy.room_to_read(step, reads, 0, writing=False, reading=False) is Room.NONE
    assert policy.room_to_save(writing=True) is Room.WAIT and policy.room_to_save(writing=False) is Room.NONE


def test_replay_follows_the_policy_within_the_budget() -> None:
    """A kept tensor fills the budget with no write in flight: the replay sends the next save to
    ordinary memory, as the runtime does, instead of going over the budget."""
    tensors = [SavedTensor(100, 0.0, 2.0), SavedTensor(100, 0.1, 1.0)]
    replay = replay_spill(DISK, 150, tensors, set(), 2.0)
    assert replay.peak_resident == 100 and replay.overflow_bytes == 100
    plan = SpillPlan([], frozenset({1, 0}), [1, 0], 2.0, 2.0, 0.0, 0.0, 0, 2.0)
    assert plan.policy() == SpillPolicy(frozenset({0, 1}), (1, 0))
