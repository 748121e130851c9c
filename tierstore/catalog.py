"""The commit protocol: which version of each key is current, and, in a persistent store, the
manifest journal that makes it durable.

Metadata commits only after the data it points to is complete: a new version is written under a
fresh backend name first, journaled (fsynced) after, and only then is the version it replaces
deleted, so a crash leaves each key at its old or its new version. A version still only in the
write-back cache keeps the journaled one alive (``Record.journaled``) until it is written back.

The catalog knows nothing of the cache: a version whose bytes are only in DRAM is a record without a
placement, and the cache, once it has written such a version to a tier, commits the placement
through `Catalog.written`, which applies it only if that record is still the key's current one. Its
own lock guards the records alone.

Over a read-only manifest the catalog only reads: it collects no garbage at the open (a writer
may have the manifest open, and its objects not yet journaled are not garbage) and neither
compacts the manifest nor deletes anything at the close.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .chain import TierChain
from .dtypes import dtype_from_name, dtype_name
from .errors import CapacityError, ConfigError, KeyNotFoundError
from .manifest import Manifest, token_of
from .tier import Placement


@dataclass
class Record:
    """The current version of one key."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    persisted: Placement | None = None
    """The copy on a tier (None while the version is only in the cache)."""
    journaled: Placement | None = None
    """Persistent stores: the version the manifest names while a newer one is only cached."""
    scratch: bool = False
    """Never journaled (see [`TierStore.put`][])."""
    damaged: str | None = None
    """Why the manifest entry this record was loaded from does not fit its object (its reads are
    refused; it can still be deleted or overwritten), or None."""


class Catalog:
    """Records by key, committed through the manifest when there is one."""

    def __init__(self, chain: TierChain, manifest: Manifest | None) -> None:
        """``chain``: where the versions' bytes live (superseded ones are discarded through it);
        ``manifest``: the journal of a persistent store, or None for a scratch store."""
        self.chain = chain
        self.manifest = manifest
        self._lock = threading.Lock()
        """Guards ``_records``: held only for lookups and swaps, never across I/O."""
        self._records: dict[str, Record] = {}
        self._ordered = threading.Lock()
        """Held across each change's journal line and record swap, so the journal's order is the
        records' order: a write-back that looked its key up before a newer put or a delete must
        not journal after it (a reopen would bring the old version back)."""
        if manifest is not None:
            self._load(manifest)

    # -- lookups ----------------------------------------------------------------------------------
    def get(self, key: str) -> Record | None:
        return self._records.get(key)

    def record(self, key: str) -> Record:
        record = self._records.get(key)
        if record is None:
            raise self.missing(key)
        return record

    def missing(self, key: str) -> KeyNotFoundError:
        """The error for a key the store does not hold. A scratch store's says why: a key put by
        an earlier store on the same directories is gone with it (a newcomer reopening a config
        without a manifest expects to find it)."""
        if self.manifest is not None:
            return KeyNotFoundError(f"no object with key {key!r}")
        return KeyNotFoundError(
            f"no object with key {key!r} in this scratch store: a store without a manifest holds "
            "only what was put since it opened, and deletes it when it closes; give it a manifest "
            "directory (the config's 'manifest', TierStore(manifest=...)) to keep its objects "
            "across opens"
        )

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def __iter__(self) -> Iterator[Record]:
        return iter(list(self._records.values()))

    # -- changes ----------------------------------------------------------------------------------
    def commit(self, key: str, record: Record) -> None:
        """Make ``record`` the current version of ``key``. The previous version is deleted,
        except that a persistent store keeps the journaled one until a newer one is journaled."""
        with self._ordered:
            if record.persisted is not None:
                try:
                    self._journal({key: (record, record.persisted)})
                except BaseException:
                    self.chain.discard([record.persisted])  # never named: the key keeps its version
                    raise
            if record.scratch and self.manifest is not None and key in self.manifest.entries:
                self.manifest.remove(key)  # the journaled version it replaces is about to go
            with self._lock:
                previous = self._records.get(key)
                self._records[key] = record
                if previous is None:
                    return
                keep = previous.journaled or previous.persisted
                if self.manifest is not None and record.persisted is None and keep is not None:
                    record.journaled = keep
                garbage = {previous.persisted, previous.journaled} - {None, record.journaled}
        self.chain.discard(garbage)

    def written(self, versions: Sequence[tuple[str, Record]], placements: Sequence[Placement]) -> list[bool]:
        """Commit versions the write-back cache has written to a tier: ``versions`` are (key,
        record) pairs as the cache held them, ``placements`` where each now lies. Those whose record
        is still the key's current one are journaled together (one sync for a pack); versions
        replaced or deleted meanwhile, and the ones the committed versions supersede, are garbage.
        Returns which versions were committed; on a journal failure discards every placement and
        raises."""
        with self._ordered:
            with self._lock:
                current = [self._records.get(key) is record for key, record in versions]
            committed = {
                key: (record, placement)
                for (key, record), placement, now in zip(versions, placements, current, strict=True)
                if now
            }
            garbage = [placement for placement, now in zip(placements, current, strict=True) if not now]
            try:
                self._journal(committed)
            except BaseException:
                self.chain.discard(garbage + [placement for _, placement in committed.values()])
                raise
            with self._lock:
                for record, placement in committed.values():
                    garbage.extend(p for p in (record.persisted, record.journaled) if p is not None)
                    record.persisted, record.journaled = placement, None
        self.chain.discard(garbage)
        return current

    def remove(self, key: str) -> Record:
        """Forget ``key`` and delete its versions; returns its last record."""
        with self._ordered:
            with self._lock:
                record = self.record(key)
                del self._records[key]
            if self.manifest is not None and key in self.manifest.entries:
                self.manifest.remove(key)
        self.chain.discard({record.persisted, record.journaled})
        return record

    def close(self) -> None:
        """A scratch store deletes every version; a persistent one compacts its manifest; a
        read-only one only forgets its records."""
        with self._lock:
            placements = [record.persisted for record in self._records.values() if record.persisted]
            self._records.clear()
        if self.manifest is not None and self.manifest.read_only:
            self.manifest.close()
            return
        if self.manifest is None:
            self.chain.discard(placements)
            return
        self.manifest.compact({token_of(placement.name) for placement in placements})
        self.manifest.close()

    # -- internals --------------------------------------------------------------------------------
    def _journal(self, versions: dict[str, tuple[Record, Placement]]) -> None:
        journaled = {key: version for key, version in versions.items() if not version[0].scratch}
        if self.manifest is not None and journaled:
            self.manifest.commit_many({key: _manifest_entry(*version) for key, version in journaled.items()})

    def _load(self, manifest: Manifest) -> None:
        """Load the manifest's records; unless it is read-only, delete tier objects an interrupted
        write of an earlier session left behind (a new store has had none, and lists nothing)."""
        tiers = [tier.name for tier in self.chain.tiers]
        for key, entry in manifest.entries.items():
            if entry["tier"] not in tiers:
                raise ConfigError(
                    f"manifest {manifest.directory}: key {key!r} lives on tier {entry['tier']!r}, which the "
                    f"config does not have (tiers: {', '.join(tiers)})"
                )
            dtype = dtype_from_name(
                entry["dtype"], f"manifest {manifest.directory}: key {key!r}", ConfigError
            )
            try:
                placement = self.chain.adopt(entry["tier"], entry)
            except CapacityError:
                hint = " (a read-only open claims their capacity too: give it tiers of capacity None)"
                raise CapacityError(
                    f"tier {entry['tier']!r} is too small for the objects its manifest lists"
                    + (hint if manifest.read_only else "")
                ) from None
            self._records[key] = Record(
                tuple(entry["shape"]),
                dtype,
                int(entry["nbytes"]),
                persisted=placement,
                damaged=_mismatch(entry, dtype),
            )
        earlier = manifest.tokens - {manifest.token}
        if earlier and not manifest.read_only:
            self.chain.collect(earlier, {entry["name"] for entry in manifest.entries.values()})


def _mismatch(entry: dict[str, Any], dtype: torch.dtype) -> str | None:
    """Why a manifest entry cannot describe its object (its shape needs other bytes than it
    records, or its extents hold other bytes), or None if it can."""
    needed = math.prod(entry["shape"]) * dtype.itemsize
    nbytes, pack = entry["nbytes"], entry.get("pack")
    if needed != nbytes:
        return (
            f"shape {entry['shape']} of {dtype_name(dtype)} needs {needed} bytes, the entry records {nbytes}"
        )
    held = sum(extent["length"] for extent in entry["extents"])
    end = nbytes + (0 if pack is None else pack["offset"])
    if end > held or (pack is None and end != held):
        return f"the entry records {nbytes} bytes, its object {entry['name']} holds {held}"
    return None


def _manifest_entry(record: Record, placement: Placement) -> dict[str, Any]:
    """A key's manifest entry; a packed object adds ``pack`` (its offset and checksum in the pack
    object ``name``, whose extents are ``extents``); an unpacked object's entry has no ``pack``."""
    entry = {
        "shape": list(record.shape),
        "dtype": dtype_name(record.dtype),
        "nbytes": record.nbytes,
        "tier": placement.tier.name,
        "name": placement.name,
        "extents": placement.describe(),
    }
    pack_member = placement.pack_member()
    if pack_member is not None:
        entry["pack"] = pack_member
    return entry
