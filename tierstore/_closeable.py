"""The ``with`` protocol of everything tierstore opens (leaving the block closes the object), and
the block that closes an object's parts when building it fails."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, Self


class Closeable(ABC):
    """Base of the classes a ``with`` block closes on exit, whether the block raised or not (stores,
    backends, checkpoint tier sets). Subclasses implement `close`."""

    @abstractmethod
    def close(self) -> None:
        """Release what the object holds. Idempotent: a second call does nothing."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class SupportsClose(Protocol):
    """Anything with a ``close()``: a tier, a path, a backend."""

    def close(self) -> None: ...


class ClosedOnError:
    """A ``with`` block that builds an object from parts it opens (a store from its tiers, a tier
    from its paths): if the block raises, the parts opened so far are closed and the error goes on.

    Args:
        parts: the list the block appends each part to as it opens it.
    """

    def __init__(self, parts: Sequence[SupportsClose]) -> None:
        self._parts = parts

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            for part in self._parts:
                part.close()
