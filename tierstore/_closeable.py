"""The ``with`` protocol of everything tierstore opens: leaving the block closes the object."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


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
