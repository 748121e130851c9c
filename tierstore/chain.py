"""The store's persistent tiers in order: where each new object version goes, verified reads,
deletes and garbage collection.

A new version goes to the first tier with room; a tier whose write fails with an I/O error (ENOSPC,
a dead path) hands it on to the next one, the same failover a tier does across its paths
(`with_failover`). Capacity is each tier's own business: a tier claims it when it accepts a write
and gives it back on failure or [`Tier.discard`][].

Backend object names are ``{token}-{n:x}`` (`token_of`): the token is the store session's (journaled
first in a persistent store), so objects of concurrent stores never clash and an interrupted write's
object is recognised as garbage at the next open.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from ._futures import with_failover
from .bandwidth import PathSpeed
from .errors import (
    BackendIOError,
    CapacityError,
    ChecksumError,
    ConfigError,
    MissingDataError,
    OutOfRangeError,
)
from .limits import Priority
from .manifest import token_of
from .tier import Placement, Tier, check_distinct_locations, digest

SAMPLE_EVERY = 16
"""``verify="sampled"`` checks one read in this many."""


class TierChain:
    """Persistent tiers tried in order; the only way the store touches tiers.

    Args:
        tiers: the tiers, fastest (tried first) to last; no two paths may share a medium.
        token: this store session's token (`Manifest.token`, or a fresh one for a scratch store),
            which prefixes every backend object name the chain makes.
        verify: when reads check checksums: ``"always"``, ``"sampled"`` (one read in `SAMPLE_EVERY`)
            or ``"off"`` (and then nothing is checksummed at all).

    Raises:
        ConfigError: two paths share a medium.
    """

    def __init__(self, tiers: Sequence[Tier], *, token: str, verify: str) -> None:
        check_distinct_locations(tiers)
        self.tiers = list(tiers)
        self.token = token
        self.verify = verify
        for tier in self.tiers:
            tier.checksums = verify != "off"
        # itertools.count is safe to advance from several threads at once; a generator is not.
        self._serials = itertools.count()
        self._reads = itertools.count()

    # -- writes -----------------------------------------------------------------------------------
    def new_name(self) -> str:
        """A backend object name no version of this store has used."""
        return f"{self.token}-{next(self._serials):x}"

    def write(self, data: memoryview, priority: Priority) -> Future[Placement]:
        """Write a new object version to the first tier with room, failing over on I/O errors."""
        name = self.new_name()
        untried = 0
        io_error: BaseException | None = None

        def attempt() -> Future[Placement]:
            nonlocal untried
            while untried < len(self.tiers):
                tier = self.tiers[untried]
                untried += 1
                with contextlib.suppress(CapacityError):
                    return tier.write(name, data, priority)
            raise io_error or CapacityError(f"no tier has room for an object of {data.nbytes} bytes")

        def again(error: BaseException) -> bool:
            nonlocal io_error
            if isinstance(error, OSError) and untried < len(self.tiers):
                io_error = error
                return True
            return False

        return with_failover(attempt, again)

    def write_pack(
        self, data: memoryview, spans: Sequence[tuple[int, int]], priority: Priority
    ) -> Future[list[Placement]]:
        """Write small objects concatenated in ``data`` as one pack object; resolves to one
        placement per ``(offset, nbytes)`` span, each with its own checksum."""
        checksums = [
            digest(data[offset : offset + nbytes]) if self.verify != "off" else None
            for offset, nbytes in spans
        ]
        members = [
            (offset, nbytes, checksum) for (offset, nbytes), checksum in zip(spans, checksums, strict=True)
        ]
        result: Future[list[Placement]] = Future()

        def unpack(done: Future[Placement]) -> None:
            error = done.exception()
            if error is not None:
                result.set_exception(error)
                return
            pack = done.result()
            result.set_result(pack.tier.unpack(pack, members))

        self.write(data, priority).add_done_callback(unpack)
        return result

    # -- reads ------------------------------------------------------------------------------------
    def read(self, key: str, placement: Placement, out: memoryview, priority: Priority) -> None:
        """Read one version into ``out``, checking its checksums as ``verify`` says; errors name
        ``key`` as well as the path and backend object."""
        verify = self.verify == "always" or (
            self.verify == "sampled" and next(self._reads) % SAMPLE_EVERY == 0
        )
        try:
            placement.tier.read_into(placement, out, priority, verify=verify).result()
        except ChecksumError as error:
            raise ChecksumError(f"key {key!r}: {error}") from None
        except MissingDataError as error:
            raise MissingDataError(errno.ENOENT, f"key {key!r}: {error.strerror}") from None
        except OutOfRangeError as error:  # the file is shorter than the object it should hold
            raise BackendIOError(errno.EIO, f"key {key!r}: stored object is truncated ({error})") from None

    def copy_in(self, source: Placement) -> Placement | None:
        """``source`` (another store's version) as a new object on this chain's first tier, copied
        path by path without passing through this process ([`Tier.copy_from`][]: each extent to the
        path of the same index where the tier has it, keeping its checksum); None, leaving nothing
        behind, where that is not possible (a packed object, a tier with too few paths to keep it
        one object, backends that cannot)."""
        copied = self.tiers[0].copy_from(source, self.new_name, split=False)
        return None if copied is None else copied[0][1]

    # -- garbage ----------------------------------------------------------------------------------
    def discard(self, placements: Iterable[Placement | None]) -> None:
        """Delete object versions nothing refers to any more."""
        for placement in placements:
            if placement is not None:
                placement.tier.discard(placement)

    def adopt(self, tier_name: str, entry: dict[str, Any]) -> Placement:
        """The placement a manifest entry describes, its capacity claimed on its tier."""
        tier = next((tier for tier in self.tiers if tier.name == tier_name), None)
        if tier is None:
            raise ConfigError(f"no tier {tier_name!r} (tiers: {', '.join(t.name for t in self.tiers)})")
        return tier.placement_from(entry["name"], int(entry["nbytes"]), entry["extents"], entry.get("pack"))

    def collect(self, tokens: Collection[str], referenced: Collection[str]) -> None:
        """Delete every backend object written under one of ``tokens`` (this store's sessions)
        that no committed version references: what interrupted writes left behind."""
        for tier in self.tiers:
            for path in tier.paths:
                for name in path.backend.list():
                    if token_of(name) in tokens and name not in referenced:
                        path.backend.delete(name)

    # -- the rest ---------------------------------------------------------------------------------
    def claim_scratch(self) -> None:
        """For a scratch store: a crash must not leave its objects behind."""
        for tier in self.tiers:
            tier.claim_scratch()

    def bandwidths(self) -> dict[str, list[PathSpeed]]:
        """Each tier's paths with their current bandwidth estimates; unmeasured paths left out."""
        speeds: dict[str, list[PathSpeed]] = {}
        for tier in self.tiers:
            speeds[tier.name] = []
            for path in tier.paths:
                estimate = path.bandwidth()
                if estimate is not None:
                    speeds[tier.name].append(PathSpeed(path.name, estimate.read, estimate.write))
        return speeds

    def stats(self) -> dict[str, Any]:
        """Each tier's [`Tier.stats`][], by tier name."""
        return {tier.name: tier.stats() for tier in self.tiers}

    def close(self) -> None:
        """Close every tier (their schedulers and backends)."""
        for tier in self.tiers:
            tier.close()
