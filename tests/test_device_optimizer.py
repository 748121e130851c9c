"""The offloaded optimizers' device path (tierstore.optimizer.device) on a simulated device whose
copies and kernels run only when the device is made to: the same arithmetic as the CPU path in
any interleaving of the streams that the events allow, the pipeline's order (what each copy and
kernel waits for, what the host waits for and when), what is held until when, and the budgets
bounding what is allocated; the refusals (parameters on two devices, a gpu_budget for parameters
in host memory). The same on a real GPU, against torch's own AdamW: tests/test_gpu_optimizer.py."""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tierstore.optimizer import OffloadedAdamW, OffloadedAPOLLO, StagedOptimizer
from tierstore.optimizer.device import DEVICE_SLOTS, DeviceStager, device_bytes
from tierstore.optimizer.subgroup_stager import SubGroupStager

from tierstore import BufferMismatchError, ConfigError, TierStore
from tierstore.app.demo import GPT
from tierstore.testing.device import SimulatedDevice, SimulatedEvent, SimulatedStream

from .helpers import make_store

SHAPES = [(37, 13), (1000,), (7,), (300, 3), (4097,)]  # 6485 elements: 7 sub-groups of <= 1024
SUB_GROUP = 1024
MOMENTS = 2 * 4 * SUB_GROUP
"""Bytes of a full sub-group's state for fp32 parameters (their own masters): its two moments."""


class ShuffledDevice(SimulatedDevice):
    """A simulated device that runs one operation at a time from a stream drawn at random among
    those that can run, and for a host that waits for an event, only until that event completes:
    every interleaving of its streams that the events allow comes up, work the host does not wait
    for lags behind, and a copy or kernel that misses a wait reads or writes at the wrong time."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.random = random.Random(seed)

    def run_all(self) -> int:
        total = 0
        with self._lock:
            while self._run_one():
                total += 1
        return total

    def synchronize(self, event: object) -> None:
        assert isinstance(event, SimulatedEvent)
        with self._lock:
            while not event.done:
                if not self._run_one():
                    raise RuntimeError(f"simulated device: {event.name} can never complete")

    def _run_one(self) -> bool:
        ready = [stream for stream in self.streams if _can_run(stream)]
        return bool(ready) and self.run(self.random.choice(ready), 1) == 1


def _can_run(stream: SimulatedStream) -> bool:
    if not stream.queue:
        return False
    head = stream.queue[0]
    return head.kind != "wait" or (head.event is not None and head.event.done)


class TracingDevice(SimulatedDevice):
    """A simulated device that also lists what the host asked of it, in order: kernels launched,
    copies (``up``: into device memory, ``down``: out of it), events recorded, waits queued, host
    waits; and what device memory the runtime allocated (live bytes and their peak)."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[tuple[str, ...]] = []
        self.live_bytes = 0
        self.peak_bytes = 0

    def launch(self, stream: object, work: Callable[[], object], name: str) -> None:
        super().launch(stream, work, name)
        assert isinstance(stream, SimulatedStream)
        self.trace.append(("kernel", stream.name, name))

    def copy(self, stream: object, destination: torch.Tensor, source: torch.Tensor) -> None:
        super().copy(stream, destination, source)
        assert isinstance(stream, SimulatedStream)
        direction = "up" if self.device_of(destination) is not None else "down"
        self.trace.append(("copy", stream.name, direction))

    def record(self, stream: object) -> object:
        event = super().record(stream)
        assert isinstance(stream, SimulatedStream) and isinstance(event, SimulatedEvent)
        self.trace.append(("record", stream.name, event.name))
        return event

    def wait(self, stream: object, event: object) -> None:
        super().wait(stream, event)
        assert isinstance(stream, SimulatedStream) and isinstance(event, SimulatedEvent)
        self.trace.append(("wait", stream.name, event.name))

    def synchronize(self, event: object) -> None:
        assert isinstance(event, SimulatedEvent)
        if not event.done:
            self.trace.append(("host waits", event.name))
        super().synchronize(event)

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: object
    ) -> torch.Tensor:
        memory = super().empty(shape, dtype, device, stream)
        nbytes = device_bytes(memory.nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(memory.untyped_storage(), self._freed, nbytes)
        return memory

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Callable[..., TierStore]]:
    """Stores on a DRAM tier; with ``device=``, the store's copies run on that simulated device."""
    opened: list[TierStore] = []

    def factory(device: SimulatedDevice | None = None) -> TierStore:
        store = make_store(tmp_path, "dram")
        if device is not None:
            store._operations.device.runtime = device
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


def host(tensor: torch.Tensor) -> torch.Tensor:
    """A simulated device tensor's values as a plain tensor."""
    return tensor.detach().as_subclass(torch.Tensor).clone()


def twins(
    device: SimulatedDevice, dtype: torch.dtype = torch.float32, shapes: Sequence[tuple[int, ...]] = SHAPES
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same parameters on the simulated device and in host memory."""
    torch.manual_seed(0)
    values = [torch.randn(shape).to(dtype) for shape in shapes]
    return (
        [device.tensor(value).requires_grad_() for value in values],
        [value.clone().requires_grad_() for value in values],
    )


def train(
    device: SimulatedDevice,
    pairs: list[tuple[StagedOptimizer, list[torch.Tensor]]],
    steps: range,
    *,
    grad_scale: float = 1.0,
    overflow_at: int | None = None,
) -> None:
    """Step each optimizer over its parameters with the same gradients (seeded by the step), the
    device's work run to its end after each step."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for optimizer, params in pairs:
            generator.manual_seed(step)
            for param in params:
                grad = torch.randn(param.shape, generator=generator).mul_(grad_scale).to(param.dtype)
                if step == overflow_at and param is params[1]:
                    grad[3] = float("inf")
                param.grad = device.tensor(grad) if device.device_of(param) is not None else grad
            optimizer.step(grad_scale=grad_scale)
        device.run_all()


def assert_same_bits(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor]) -> None:
    for got, want in zip(ours, theirs, strict=True):
        assert torch.equal(host(got), host(want))


def assert_same_state(device_path: StagedOptimizer, cpu_path: StagedOptimizer) -> None:
    """The same weights, master weights and state dict, to the bit."""
    assert_same_bits(device_path.params, cpu_path.params)
    assert_same_bits(device_path.master_params(), cpu_path.master_params())
    ours, theirs = device_path.state_dict(), cpu_path.state_dict()
    assert ours["param_groups"] == theirs["param_groups"] and ours["step_count"] == theirs["step_count"]
    for number, entry in theirs["state"].items():
        assert ours["state"][number].keys() == entry.keys()
        for name, value in entry.items():
            mine = ours["state"][number][name]
            assert torch.equal(host(mine), host(value)) if isinstance(value, torch.Tensor) else mine == value


# -- the arithmetic: the CPU path's, in any order the events allow --------------------------------------
BUDGETS = {
    "all streamed": {},
    "some kept on the device": {"gpu_budget": 2 * device_bytes(MOMENTS)},
    "all on the device": {"gpu_budget": "1MiB"},
    "some kept in host memory": {"dram_budget": (DEVICE_SLOTS + 2 + 3) * MOMENTS},
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budgets", list(BUDGETS.values()), ids=list(BUDGETS))
def test_the_device_path_is_the_cpu_paths_arithmetic_in_any_order_of_its_streams(
    stores: Callable[..., TierStore], seed: int, budgets: dict[str, Any]
) -> None:
    device = ShuffledDevice(seed)
    on_device, in_host = twins(device)
    ours = OffloadedAdamW(on_device, stores(device), lr=1e-2, sub_group_size=SUB_GROUP, **budgets)
    theirs = OffloadedAdamW(in_host, stores(), lr=1e-2, sub_group_size=SUB_GROUP)
    assert isinstance(ours.stager, DeviceStager) and not isinstance(theirs.stager, DeviceStager)
    train(device, [(ours, on_device), (theirs, in_host)], range(6))
    assert_same_state(ours, theirs)


def test_bf16_parameters_keep_fp32_masters_on_the_device_path(stores: Callable[..., TierStore]) -> None:
    device = ShuffledDevice(3)
    on_device, in_host = twins(device, torch.bfloat16)
    ours = OffloadedAdamW(on_device, stores(device), lr=1e-2, sub_group_size=SUB_GROUP, gpu_budget="16KiB")
    theirs = OffloadedAdamW(in_host, stores(), lr=1e-2, sub_group_size=SUB_GROUP)
    assert ours.state_numel(ours.subgroups[0]) == 3 * ours.subgroups[0].numel  # master | exp_avg | exp_avg_sq
    train(device, [(ours, on_device), (theirs, in_host)], range(5))
    assert_same_state(ours, theirs)


def test_clipping_loss_scaling_and_an_overflow_on_the_device(stores: Callable[..., TierStore]) -> None:
    """The norm is taken on the device (torch's per-tensor norms, as clip_grad_norm_ takes them):
    the clipping coefficient differs from the CPU path's in its last bits only. The overflowing
    step changes nothing and counts for no parameter."""
    device = ShuffledDevice(4)
    on_device, in_host = twins(device, torch.bfloat16)
    options: dict[str, Any] = {"lr": 1e-2, "sub_group_size": SUB_GROUP, "max_grad_norm": 1.0}
    ours = OffloadedAdamW(on_device, stores(device), **options)
    theirs = OffloadedAdamW(in_host, stores(), **options)
    train(device, [(ours, on_device), (theirs, in_host)], range(8), grad_scale=1024.0, overflow_at=4)
    assert ours.skipped_steps == theirs.skipped_steps == 1 and ours.step_count == 7
    assert ours.param_steps == theirs.param_steps == [7] * len(SHAPES)
    for got, want in zip(ours.master_params(), theirs.master_params(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_apollo_on_the_device_is_the_cpu_paths_arithmetic(stores: Callable[..., TierStore]) -> None:
    device = ShuffledDevice(5)
    shapes = [(37, 13), (13, 40), (64, 64), (50,)]
    on_device, in_host = twins(device, torch.bfloat16, shapes)

    def groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
        return [{"params": params[:3], "rank": 2, "update_proj_gap": 3}, {"params": params[3:]}]

    ours = OffloadedAPOLLO(
        groups(on_device), stores(device), lr=1e-2, sub_group_size=2000, gpu_budget="32KiB"
    )
    theirs = OffloadedAPOLLO(groups(in_host), stores(), lr=1e-2, sub_group_size=2000)
    train(device, [(ours, on_device), (theirs, in_host)], range(7))
    assert ours.stager.on_device  # type: ignore[attr-defined]
    assert_same_state(ours, theirs)


def on_the_device(model: torch.nn.Module, device: SimulatedDevice) -> torch.nn.Module:
    """``model`` with its parameters moved onto the simulated device (tied ones stay tied): its
    forward and backward run on the CPU, its parameters and gradients count as device memory."""
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in moved:
                    moved[id(param)] = torch.nn.Parameter(device.tensor(param.detach()))
                module._parameters[name] = moved[id(param)]
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_gpt_on_the_device_trains_as_torchs_fused_adamw_over_fp32_masters(
    stores: Callable[..., TierStore], dtype: torch.dtype
) -> None:
    """A GPT's own forward and backward, its state split across the device, pinned host memory
    and the store: its master weights equal torch's fused AdamW's over fp32 copies of its
    parameters, stepped on the same gradients, to the bit."""
    device = ShuffledDevice(9)
    torch.manual_seed(0)
    model = on_the_device(
        GPT(vocab=64, width=32, layers=2, heads=2, length=16, dropout=0.0).to(dtype), device
    )
    params = list(model.parameters())
    masters = [torch.nn.Parameter(host(param).float()) for param in params]
    numel = sum(param.numel() for param in params)
    state_bytes = (8 if dtype == torch.float32 else 12) * numel
    ours = OffloadedAdamW(
        params,
        stores(device),
        lr=1e-2,
        weight_decay=0.1,
        sub_group_size=numel // 8,
        gpu_budget=state_bytes // 5,
        dram_budget=state_bytes,
    )
    theirs = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(step))
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        ours.step()
        device.run_all()
        for master, param in zip(masters, params, strict=True):
            master.grad = host(param.grad).float()  # type: ignore[arg-type]
        theirs.step()
    stager = ours.stager
    assert isinstance(stager, DeviceStager) and stager.on_device and stager.resident
    assert_same_bits(ours.master_params(), masters)
    assert_same_bits(params, [master.to(dtype) for master in masters])


# -- the pipeline's order -----------------------------------------------------------------------------
def test_while_one_sub_group_is_updated_the_next_goes_up_and_the_last_comes_down(
    stores: Callable[..., TierStore],
) -> None:
    """A pass over 7 sub-groups, the first kept on the device: what each copy and kernel waits
    for, and when the host waits. Uploads wait only for the memory they fill (the allocation, or
    the download that emptied the slot), never for an update; each update waits for its upload;
    each download for its update. So the device may update ``k`` while ``k+1`` goes up and ``k-1``
    comes down. The host waits once for the norm, and then only for downloads, with the next two
    updates already queued."""
    device = TracingDevice()
    params = [device.tensor(torch.randn(shape)).requires_grad_() for shape in SHAPES]
    optimizer = OffloadedAdamW(
        params,
        stores(device),
        sub_group_size=SUB_GROUP,
        gpu_budget=device_bytes(MOMENTS),
        cache_policy="none",
    )
    assert len(optimizer.subgroups) == 7
    train(device, [(optimizer, params)], range(1))  # the first pass loads sub-group 0 onto the device
    assert list(optimizer.stager.on_device) == [0]  # type: ignore[attr-defined]
    device.trace.clear()
    train(device, [(optimizer, params)], range(1, 2))  # the second: reversed, sub-group 0 first
    trace = device.trace
    up = next(entry[1] for entry in trace if entry[0] == "copy" and entry[2] == "up")
    down = next(entry[1] for entry in trace if entry[0] == "copy" and entry[2] == "down")
    assert up != down  # two copy streams: both directions at once

    def position(entry: tuple[str, ...]) -> int:
        return trace.index(entry)

    kernels = [entry for entry in trace if entry[0] == "kernel" and entry[2].startswith("update")]
    assert [entry[2] for entry in kernels] == [f"update {index}" for index in (0, 6, 5, 4, 3, 2, 1)]
    end_of = {}  # the event recorded right after each copy and kernel, by its trace position
    for at, entry in enumerate(trace):
        if entry[0] in ("copy", "kernel"):
            end_of[at] = next(e[2] for e in trace[at + 1 :] if e[0] == "record" and e[1] == entry[1])
    ups = [at for at, entry in enumerate(trace) if entry[:3] == ("copy", up, "up")]
    downs = [at for at, entry in enumerate(trace) if entry[:3] == ("copy", down, "down")]
    assert len(ups) == len(downs) == 6  # the streamed sub-groups, 6 to 1

    def waited_before(at: int, stream: str) -> list[str]:
        """The events ``stream`` was made to wait for between its previous copy or kernel and
        the one at ``at``."""
        events: list[str] = []
        for entry in reversed(trace[:at]):
            if entry[1] == stream and entry[0] in ("copy", "kernel"):
                break
            if entry[1] == stream and entry[0] == "wait":
                events.append(entry[2])
        return events

    first_update = position(kernels[0])
    allocated = [e[2] for e in trace[:first_update] if e[0] == "record" and e[1] == "compute"][-1]
    for number, at in enumerate(ups):
        expected = allocated if number < DEVICE_SLOTS else end_of[downs[number - DEVICE_SLOTS]]
        assert waited_before(at, up) == [expected]  # the slot's memory free, nothing else
    assert waited_before(first_update, "compute") == []  # kept on the device: waits for no copy
    for number, kernel in enumerate(kernels[1:]):
        assert waited_before(position(kernel), "compute") == [end_of[ups[number]]]
    for number, at in enumerate(downs):
        after_update = next(
            e[2] for e in trace[position(kernels[number + 1]) :] if e[0] == "record" and e[1] == "compute"
        )
        assert waited_before(at, down) == [after_update]
    host_waits = [at for at, entry in enumerate(trace) if entry[0] == "host waits"]
    compute_events = {e[2] for e in trace if e[0] == "record" and e[1] == "compute"}
    download_ends = {end_of[at]: number for number, at in enumerate(downs)}
    assert trace[host_waits[0]][1] in compute_events and host_waits[0] < ups[0]  # the norm
    for at in host_waits[1:]:
        number = download_ends[trace[at][1]]  # the host waits for downloads only
        queued = [k for k in kernels[1:] if position(k) < at]
        assert len(queued) >= min(number + 3, len(downs))  # ... the next two updates queued


class DownloadsNoted(ShuffledDevice):
    """A shuffled device that notes, per host address a copy from the device fills, the event
    recorded after that copy: its end."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.filled: int | None = None
        self.download_end: dict[int, SimulatedEvent] = {}

    def copy(self, stream: object, destination: torch.Tensor, source: torch.Tensor) -> None:
        super().copy(stream, destination, source)
        self.filled = destination.data_ptr() if self.device_of(destination) is None else None

    def record(self, stream: object) -> object:
        event = super().record(stream)
        assert isinstance(event, SimulatedEvent)
        if self.filled is not None:
            self.download_end[self.filled] = event
            self.filled = None
        return event


def test_host_buffers_are_held_until_their_download_ends_and_bounded_by_the_ring(
    stores: Callable[..., TierStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sub-group's host buffer goes back to the stager (to be written to the store) only once
    its download into it has ended; the pass holds at most three (up, updated, down), and the ring
    has that many beyond the reads ahead."""
    device = DownloadsNoted(6)
    params = [device.tensor(torch.randn(shape)).requires_grad_() for shape in SHAPES]
    optimizer = OffloadedAdamW(params, stores(device), sub_group_size=SUB_GROUP, cache_policy="none")
    stager = optimizer.stager
    assert stager.ring_size == stager.prefetch_depth + DEVICE_SLOTS
    buffers: dict[Any, int] = {}
    ended_at_release: list[bool] = []
    most_held = 0
    acquire, release = SubGroupStager.acquire, SubGroupStager.release

    def noted_acquire(self: SubGroupStager, name: Any, elements: int | None = None) -> torch.Tensor:
        nonlocal most_held
        state = acquire(self, name, elements)
        buffers[name] = state.data_ptr()
        most_held = max(most_held, len(self.held))
        return state

    def noted_release(self: SubGroupStager, name: Any) -> None:
        ended_at_release.append(device.download_end.pop(buffers[name]).done)
        release(self, name)

    monkeypatch.setattr(SubGroupStager, "acquire", noted_acquire)
    monkeypatch.setattr(SubGroupStager, "release", noted_release)
    train(device, [(optimizer, params)], range(3))
    assert most_held == DEVICE_SLOTS
    assert ended_at_release == [True] * 3 * len(optimizer.subgroups)
    assert all(buffer.data_ptr() in device.locked for buffer in stager.buffers)  # the ring is pinned


def test_the_budgets_bound_what_is_allocated_and_what_moves(stores: Callable[..., TierStore]) -> None:
    """Device memory: the sub-groups kept there (within gpu_budget) and, beyond it, at most
    device_staging_bytes; host memory page-locked: within dram_budget; the sub-groups kept on the
    device cross neither the bus nor the store after the first step."""
    device = TracingDevice()
    params = [device.tensor(torch.randn(shape)).requires_grad_() for shape in SHAPES]
    gpu_budget = 3 * device_bytes(MOMENTS) + 100
    dram_budget = (2 + DEVICE_SLOTS) * MOMENTS + 2 * MOMENTS
    store = stores(device)
    optimizer = OffloadedAdamW(
        params, store, sub_group_size=SUB_GROUP, gpu_budget=gpu_budget, dram_budget=dram_budget
    )
    stager = optimizer.stager
    assert isinstance(stager, DeviceStager)
    assert sum(device.locked.values()) <= dram_budget  # the ring, pinned
    train(device, [(optimizer, params)], range(1))
    assert set(stager.on_device) == {0, 1, 2} and stager.device_kept_bytes <= gpu_budget
    assert device.peak_bytes <= gpu_budget + optimizer.device_staging_bytes
    assert optimizer.device_staging_bytes == (
        DEVICE_SLOTS * device_bytes(MOMENTS) + device_bytes(4 * SUB_GROUP) + 512 * len(SHAPES) + 3 * 512
    )
    tier = store.tiers[0]
    read, written = tier.bytes_read, tier.bytes_written
    start = len(device.trace)
    train(device, [(optimizer, params)], range(1, 3))
    streamed = sum(optimizer.state_numel(sg) * 4 for sg in optimizer.subgroups[3:])
    kept_in_host = sum(buffer.numel() * 4 for buffer in stager.resident.values())
    assert tier.bytes_read - read + tier.bytes_written - written <= 2 * 2 * streamed - kept_in_host
    moved = [entry for entry in device.trace[start:] if entry[0] == "copy"]
    assert len(moved) == 2 * 2 * (len(optimizer.subgroups) - 3)  # up and down, streamed ones only
    assert sum(device.locked.values()) <= dram_budget  # ring and pool, pinned
    assert device.live_bytes == stager.device_kept_bytes  # the slots let go of at the pass's end


# -- state dicts, snapshots and the device's copies -------------------------------------------------------
def test_state_dicts_move_between_the_cpu_path_and_the_device_path_bit_for_bit(
    stores: Callable[..., TierStore],
) -> None:
    device = ShuffledDevice(7)
    on_device, in_host = twins(device, torch.bfloat16)
    straight = OffloadedAdamW(in_host, stores(), lr=1e-2, sub_group_size=SUB_GROUP)
    train(device, [(straight, in_host)], range(6))

    first_params = twins(device, torch.bfloat16)[1]
    first = OffloadedAdamW(first_params, stores(), lr=1e-2, sub_group_size=SUB_GROUP, namespace="first")
    train(device, [(first, first_params)], range(2))
    for param, weights in zip(on_device, first_params, strict=True):
        param.data.copy_(weights.detach())
    moved = OffloadedAdamW(on_device, stores(device), lr=1e-2, sub_group_size=SUB_GROUP, gpu_budget="16KiB")
    moved.load_state_dict(first.state_dict())  # CPU -> device
    train(device, [(moved, on_device)], range(2, 4))
    back_params = twins(device, torch.bfloat16)[1]
    for param, weights in zip(back_params, on_device, strict=True):
        param.data.copy_(host(weights))
    back = OffloadedAdamW(back_params, stores(), lr=1e-2, sub_group_size=SUB_GROUP, namespace="back")
    back.load_state_dict(moved.state_dict())  # device -> CPU, with the state kept on the device
    train(device, [(back, back_params)], range(4, 6))
    assert_same_state(back, straight)


def test_a_snapshot_and_a_load_see_and_replace_the_state_kept_on_the_device(
    stores: Callable[..., TierStore], tmp_path: Path
) -> None:
    device = ShuffledDevice(8)
    on_device, in_host = twins(device)
    ours = OffloadedAdamW(on_device, stores(device), lr=1e-2, sub_group_size=SUB_GROUP, gpu_budget="1MiB")
    theirs = OffloadedAdamW(in_host, stores(), lr=1e-2, sub_group_size=SUB_GROUP)
    train(device, [(ours, on_device), (theirs, in_host)], range(3))
    stager = ours.stager
    assert isinstance(stager, DeviceStager) and len(stager.on_device) == len(ours.subgroups)
    ours.save_snapshot(tmp_path / "state.h5")
    saved = [host(param) for param in on_device]
    train(device, [(ours, on_device)], range(3, 5))
    for param, weights in zip(on_device, saved, strict=True):
        param.data.copy_(weights)
    ours.load_snapshot(tmp_path / "state.h5")  # rewrites the store: the device's copies are stale
    assert not stager.on_device
    train(device, [(ours, on_device), (theirs, in_host)], range(3, 6))
    assert_same_state(ours, theirs)


# -- refused ---------------------------------------------------------------------------------------------
def test_parameters_on_two_devices_are_refused_naming_the_parameter(stores: Callable[..., TierStore]) -> None:
    device = SimulatedDevice()
    store = stores(device)
    on_device = device.tensor(torch.zeros(10)).requires_grad_()
    in_host = torch.zeros(10, requires_grad=True)
    with pytest.raises(
        BufferMismatchError, match=r"param_groups\.0\.params\.1: .* in host memory, .* on cuda:0"
    ):
        OffloadedAdamW([on_device, in_host], store)
    with pytest.raises(
        BufferMismatchError, match=r"param_groups\.1\.params\.0: .* on cuda:0, .* in host memory"
    ):
        OffloadedAPOLLO([{"params": [in_host]}, {"params": [on_device]}], store)
    optimizer = OffloadedAdamW([on_device], store)
    with pytest.raises(BufferMismatchError, match=r"param_groups\.1\.params\.0: .* in host memory"):
        optimizer.add_param_group({"params": [in_host]})
    assert len(optimizer.param_groups) == 1
    on_device.grad = device.tensor(torch.ones(10))
    optimizer.step()  # still usable
    device.run_all()
    assert optimizer.step_count == 1


@pytest.mark.parametrize("gpu_budget", [1, "1MiB"])
def test_a_gpu_budget_for_parameters_in_host_memory_is_refused(
    stores: Callable[..., TierStore], gpu_budget: object
) -> None:
    store = stores()
    with pytest.raises(ConfigError, match=r"gpu_budget: .* parameters in host memory"):
        OffloadedAdamW([torch.zeros(10, requires_grad=True)], store, gpu_budget=gpu_budget)  # type: ignore[arg-type]
    for accepted in (None, 0, "0B"):
        OffloadedAdamW([torch.zeros(10, requires_grad=True)], store, gpu_budget=accepted).close()


@pytest.mark.parametrize("gpu_budget", [-1, True, 1.5, "lots", [1]])
def test_a_gpu_budget_that_is_no_size_is_refused(
    stores: Callable[..., TierStore], gpu_budget: object
) -> None:
    device = SimulatedDevice()
    with pytest.raises(ConfigError, match=r"^gpu_budget: must be (None or )?a number of bytes >= 0"):
        OffloadedAdamW([device.tensor(torch.zeros(10))], stores(device), gpu_budget=gpu_budget)  # type: ignore[arg-type]
