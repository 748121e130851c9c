"""The activation spill simulator: a profiled step replayed under the spill policy, and the plans
judged by it."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tierstore.activations.replay import SavedTensor, SpillPlan, plan_spill, replay_spill
from tierstore.activations.spill_policy import ReadAhead, Residence, Room, SpillPolicy

from tierstore.bandwidth import PathSpeed, stripe_weight
from tierstore.config import StripeBy
from tierstore.pass_plan import transfer_seconds

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


@pytest.mark.parametrize("stripe_by", ["round-trip", "write", "read"])
def test_replay_times_io_as_the_tier_stripes(stripe_by: StripeBy) -> None:
    """Room for one tensor: the second save waits for the first one's write, which takes the time
    of a write striped as the tier stripes (placement's own weights)."""
    paths = [PathSpeed("nvme", read=3e9, write=1e9), PathSpeed("pfs", read=1e9, write=2e9)]
    nbytes = 1 << 30
    tensors = [SavedTensor(nbytes, 0.0, 2.0), SavedTensor(nbytes, 0.0, 1.0)]
    replay = replay_spill(paths, nbytes, tensors, {0, 1}, 2.0, stripe_by=stripe_by)
    weights = [stripe_weight(path.read, path.write, stripe_by) for path in paths]
    write = transfer_seconds(paths, weights, 0, nbytes)
    assert replay.write_stall == pytest.approx(write)
    plan = plan_spill(paths, nbytes, tensors, 2.0, stripe_by=stripe_by)
    assert f"striped by {stripe_by}" in plan.explain()
