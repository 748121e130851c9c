"""The DRAM cache: which objects have a copy in pool buffers, in LRU order.

This module holds the bookkeeping only; the store decides when to write back and evict, because
that needs the tiers. An entry's buffer goes back to the pool only when nothing uses it any more:
no reader has it pinned, no write-back is reading from it, and it is no longer the object's
current copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .buffers import AlignedBuffer


@dataclass(eq=False)
class CacheEntry:
    key: str
    buffer: AlignedBuffer
    nbytes: int
    dirty: bool
    pins: int = 0
    """Readers copying out of the buffer right now."""
    writing: bool = False
    """A write-back is reading from the buffer."""
    attached: bool = True
    """Still the object's current cached copy (False once replaced, deleted or evicted)."""
    writeback_error: BaseException | None = field(default=None, repr=False)

    def typed(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The cached bytes viewed as the object's tensor (shares the buffer)."""
        return self.buffer.view(self.nbytes).view(dtype).view(shape)

    @property
    def releasable(self) -> bool:
        return not (self.attached or self.pins or self.writing)


class LruIndex:
    """Attached cache entries by key, least recently used first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[CacheEntry]:
        return iter(list(self._entries.values()))

    def get(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def insert(self, entry: CacheEntry) -> None:
        self._entries[entry.key] = entry

    def touch(self, entry: CacheEntry) -> None:
        self._entries.move_to_end(entry.key)

    def detach(self, entry: CacheEntry) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        entry.attached = False

    def victim(self) -> CacheEntry | None:
        """Least recently used entry that may be written back or evicted now."""
        for entry in self._entries.values():
            if not entry.pins and not entry.writing and entry.writeback_error is None:
                return entry
        return None
