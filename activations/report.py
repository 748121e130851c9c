"""What one step of activation offload moved and what it cost: the per-step report.

For each link a step used (a device to host memory and back over the bus, host memory to storage and
back), the bytes it moved, the bandwidth they needed to hide behind the compute they overlap
(outbound behind forward, inbound behind backward) against the bandwidth the link gave (the bus: its
copies timed on the device's clock; storage: the store's measured estimate), and how long the step
waited: on a device, the time the caller's stream stalled for copies back (timed events around each
wait); in host memory, the time forward and backward waited for writes and reads. A step whose waits
exceed `HIDDEN_FRACTION` of its compute, or that needed more of a link than it gave, is not hidden.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..device_runtime import DeviceRuntime
from ..errors import BandwidthUnknownError
from ..pass_plan import placement_speeds
from ..store import TierStore
from .entries import Step

HIDDEN_FRACTION = 0.05
"""The share of a step's compute its waits may take for the offload to count as hidden."""


@dataclass(frozen=True)
class Link:
    """One link's traffic in a step."""

    name: str
    """``device -> host``, ``host -> storage``, ``storage -> host`` or ``host -> device``."""
    bytes: int
    needed_bytes_per_s: float
    """What hiding the bytes behind the compute they overlap takes."""
    gave_bytes_per_s: float | None
    """What the link gave (None: not measured yet)."""

    @property
    def hidden(self) -> bool:
        return self.gave_bytes_per_s is None or self.needed_bytes_per_s <= self.gave_bytes_per_s


@dataclass(frozen=True)
class StepReport:
    """One step of an [`ActivationOffload`][] (see the module docstring)."""

    step: int
    clock: str
    """``device`` or ``host``: whose clock timed the step."""
    forward_s: float
    """Compute seconds of forward, waits excluded."""
    backward_s: float
    """Compute seconds of backward up to its last use of a saved tensor, waits excluded."""
    links: tuple[Link, ...]
    waited_s: float
    """Seconds the step waited for the offload (see the module docstring)."""

    @property
    def hidden(self) -> bool:
        compute = self.forward_s + self.backward_s
        return self.waited_s <= HIDDEN_FRACTION * compute and all(link.hidden for link in self.links)

    def line(self) -> str:
        """The report in one line of text."""
        moved = "; ".join(
            f"{link.name} {link.bytes / 1e9:.3f} GB needing {link.needed_bytes_per_s / 1e9:.2f} GB/s"
            + (
                f", gave {link.gave_bytes_per_s / 1e9:.2f}"
                if link.gave_bytes_per_s is not None
                else ", not measured"
            )
            for link in self.links
        )
        verdict = "hidden" if self.hidden else "NOT hidden"
        return (
            f"step {self.step} ({self.clock} clock): compute {self.forward_s + self.backward_s:.3f} s, "
            f"waited {self.waited_s:.3f} s, {verdict}; {moved or 'nothing moved'}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-ready)."""
        figures = asdict(self)
        figures["links"] = [{**asdict(link), "hidden": link.hidden} for link in self.links]
        figures["hidden"] = self.hidden
        return figures


def report_of(step: Step, store: TierStore, runtime: DeviceRuntime, *, wait: bool) -> StepReport | None:
    """The report of a step whose backward is over; for a device's step, None while its events
    have not all completed, unless ``wait`` (then they are waited for)."""
    traffic = step.traffic
    if step.device is not None and step.times is not None and step.times.forward_end is not None:
        times = step.times
        ends = [e.used_event for e in step.entries if e.used_event is not None]
        events = [times.forward_end, *ends, *(after for _, after in times.stalls)]
        if not wait and not all(runtime.query(event) for event in events):
            return None
        for event in events:
            runtime.synchronize(event)
        waited = sum(runtime.elapsed(before, after) for before, after in times.stalls)
        forward = runtime.elapsed(times.origin, times.forward_end)
        last = max((runtime.elapsed(times.origin, event) for event in ends), default=forward)
        clock, backward = "device", max(0.0, last - forward - waited)
    else:
        clock, waited = "host", step.stalls
        forward, backward = step.forward_seconds, max(0.0, step.last_use - step.forward_seconds)
    try:
        paths = placement_speeds(store).paths
        write: float | None = sum(path.write for path in paths)
        read: float | None = sum(path.read for path in paths)
    except BandwidthUnknownError:
        write = read = None
    links = []
    for name, nbytes, span, gave in (
        (
            "device -> host",
            traffic.to_host_bytes,
            forward,
            _rate(traffic.to_host_bytes, traffic.to_host_seconds),
        ),
        ("host -> storage", traffic.written_bytes, forward, write),
        ("storage -> host", traffic.read_bytes, backward, read),
        (
            "host -> device",
            traffic.to_device_bytes,
            backward,
            _rate(traffic.to_device_bytes, traffic.to_device_seconds),
        ),
    ):
        if nbytes:
            links.append(Link(name, nbytes, nbytes / span if span > 0 else float("inf"), gave))
    return StepReport(step.number, clock, forward, backward, tuple(links), waited)


def _rate(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds if seconds > 0 else None
