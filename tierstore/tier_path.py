"""One path of a tier: a backend with its request scheduler, its throughput meters and its counters
(`TierPath`), and the opening of a configured path (`open_path`: its backend, its bandwidth as
configured or probed, its node-wide limits).

A path runs every request through a `PathScheduler` (limits, priorities, node-wide slots) and meters
its throughput where the bytes move; its tier (`tierstore.tier`) plans which bytes of an object each
path holds from those estimates.
"""

from __future__ import annotations

import errno
import json
import logging
from concurrent.futures import Future
from typing import Any

from ._checks import check_arguments, default_of
from .backends import Backend, open_backend
from .bandwidth import Bandwidth, InFlight, ProbeCache, ThroughputMeter, probe
from .config import PathConfig, PathOptions, TierConfig
from .errors import BackendIOError, ConfigError, KeyNotFoundError, MissingDataError
from .limits import Direction, NodeLimiter, PathScheduler, Priority

_log = logging.getLogger("tierstore")


class TierPath:
    """One backend of a tier: its scheduler, its throughput meters and its counters.

    Args:
        name: the path's name in the tier, unique in the store (manifest entries name it).
        backend: the open backend it owns (closed with the path).
        bandwidth: its known read and write bandwidth; None: unknown until measured from its
            traffic (with ``adapt``).
        max_reads: read requests in flight on it at once (each one object's extent).
        max_writes: write requests in flight on it at once.
        node_limits: per direction, slots shared with every process on the node that uses the
            same medium (a parallel file system's client); none by default.
        adapt: re-estimate the bandwidth from observed throughput, so stripes follow a path
            that slows down; False keeps ``bandwidth`` fixed.

    ``max_reads``, ``max_writes`` and ``adapt`` are defined once, by the configuration document's
    path and tier (`PathOptions`): the same defaults and the same checks.

    Raises:
        ConfigError: an invalid argument, named as in ``"path 'p': max_reads: must be ..., not
            ..."``.
    """

    def __init__(
        self,
        name: str,
        backend: Backend,
        *,
        bandwidth: Bandwidth | None = None,
        max_reads: int = default_of(PathOptions, "max_reads"),
        max_writes: int = default_of(PathOptions, "max_writes"),
        node_limits: dict[Direction, NodeLimiter] | None = None,
        adapt: bool = default_of(PathOptions, "adapt"),
    ) -> None:
        where = f"path {name!r}: "
        options = check_arguments(
            PathOptions, {"max_reads": max_reads, "max_writes": max_writes, "adapt": adapt}, where=where
        )
        if not isinstance(backend, Backend):
            raise ConfigError(
                f"{where}backend: must be a Backend, not {type(backend).__name__} (open_backend opens one "
                "from a URL)"
            )
        if bandwidth is not None and not isinstance(bandwidth, Bandwidth):
            raise ConfigError(f"{where}bandwidth: must be None or a Bandwidth, not {bandwidth!r}")
        self.name = name
        self.backend = backend
        self.adapt = options.adapt
        self.configured = bandwidth
        in_flight = InFlight()  # both directions share the device, so both share the count
        self.meters: dict[Direction, ThroughputMeter] = {
            "read": ThroughputMeter(bandwidth.read if bandwidth else None, in_flight=in_flight),
            "write": ThroughputMeter(bandwidth.write if bandwidth else None, in_flight=in_flight),
        }
        self.scheduler = PathScheduler(
            name,
            max_reads=options.max_reads,
            max_writes=options.max_writes,
            node_limits=node_limits,
            meters=self.meters,
        )

    def bandwidth(self) -> Bandwidth | None:
        """Current estimate: measured online if ``adapt``, else as configured or probed."""
        if not self.adapt:
            return self.configured
        read, write = self.meters["read"].estimate, self.meters["write"].estimate
        if read is None or write is None:
            return self.configured
        return Bandwidth(read=read, write=write)

    @property
    def busy_seconds(self) -> float:
        """Seconds with any request in flight on this path, reads and writes alike."""
        return self.meters["read"].in_flight.busy_seconds

    def write(self, name: str, data: memoryview, priority: Priority) -> Future[None]:
        """Write ``data`` as the whole object ``name``, through the scheduler at ``priority``."""
        return self.scheduler.submit(
            "write", priority, data.nbytes, lambda: self.backend.write(name, 0, data)
        )

    def read_into(self, name: str, out: memoryview, priority: Priority) -> Future[None]:
        """Read object ``name`` from its start into ``out`` (see `read_at`)."""
        return self.read_at(name, 0, out, priority)

    def read_at(self, name: str, offset: int, out: memoryview, priority: Priority) -> Future[None]:
        """Read bytes of an object this path holds. The tier only reads objects it wrote, so an
        absent one is lost data: [`MissingDataError`][], never the backend's ``KeyError``."""
        read = self.scheduler.submit(
            "read", priority, out.nbytes, lambda: self.backend.read_into(name, offset, out)
        )
        result: Future[None] = Future()

        def settle(done: Future[None]) -> None:
            error = done.exception()
            if isinstance(error, KeyNotFoundError):
                result.set_exception(
                    MissingDataError(
                        errno.ENOENT,
                        f"object {name} on path {self.name} ({self.backend!r}) is missing from its "
                        f"medium ({error})",
                    )
                )
            elif error is not None:
                result.set_exception(error)
            else:
                result.set_result(None)

        read.add_done_callback(settle)
        return result

    def stats(self) -> dict[str, Any]:
        """Requests, queue waits, busy time, bytes and throughput per direction, and the
        current bandwidth estimate (JSON-ready)."""
        estimate = self.bandwidth()
        telemetry = self.scheduler.telemetry
        stats: dict[str, Any] = {
            "requests": telemetry.requests,
            "queue_wait_seconds": round(telemetry.queue_wait_seconds, 6),
            "max_in_flight": dict(telemetry.max_in_flight),
            "busy_seconds": round(self.busy_seconds, 6),
            "estimate": estimate.as_gbps() if estimate else None,
        }
        for direction, meter in self.meters.items():
            busy = meter.busy_seconds
            stats[direction] = {
                "bytes": telemetry.bytes[direction],
                "seconds": round(busy, 6),
                "gb_per_s": round(meter.total_bytes / busy / 1e9, 3) if busy else None,
            }
        return stats

    def close(self) -> None:
        """Stop the scheduler and close the backend."""
        self.scheduler.close()
        self.backend.close()


def open_path(tier: TierConfig, config: PathConfig, index: int, where: str, probes: ProbeCache) -> TierPath:
    backend = open_backend(config.backend, where=f"{where}.backend")
    try:
        bandwidth = None
        if config.bandwidth is not None:
            bandwidth = Bandwidth(read=float(config.bandwidth.read), write=float(config.bandwidth.write))
        elif tier.probe:
            bandwidth = _probed_bandwidth(
                backend, json.dumps(config.backend, sort_keys=True, default=str), probes
            )
        node_limits: dict[Direction, NodeLimiter] = {}
        if config.node_limit is not None:
            limit = config.node_limit
            node_limits = {
                "read": NodeLimiter(f"{limit.key}.read", limit.max_reads, limit.directory),
                "write": NodeLimiter(f"{limit.key}.write", limit.max_writes, limit.directory),
            }
        return TierPath(
            config.name or f"{tier.name}.{index}",
            backend,
            bandwidth=bandwidth,
            max_reads=config.max_reads,
            max_writes=config.max_writes,
            node_limits=node_limits,
            adapt=tier.adapt,
        )
    except BaseException:
        backend.close()
        raise


def _probed_bandwidth(backend: Backend, identity: str, probes: ProbeCache) -> Bandwidth | None:
    """The path's bandwidth from the probe cache, else probed now; None for a path too full to
    probe (it stays readable, and is measured online once it moves data)."""
    probed = probes.get(identity)
    if probed is None:
        try:
            probed = probe(backend)
        except BackendIOError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            _log.warning("%r is full: its bandwidth is not probed (%s)", backend, error)
            return None
        probes.put(identity, probed)
    return probed.bandwidth
