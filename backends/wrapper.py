"""A backend in front of another one: the base of the test and emulation wrappers.

Its own module because it opens its inner backend through the registry, which imports `base`; here
the import runs one way (wrapper -> registry -> base).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, ClassVar

from .base import Backend, BackendOptions, Capabilities, Location
from .registry import open_backend


class WrapperOptions(BackendOptions):
    """Options of a backend in front of another one."""

    inner: str | dict[str, Any]
    """The wrapped backend (URL or table)."""


class WrapperBackend(Backend):
    """A backend in front of another (``inner``): same capabilities, and the metadata operations
    pass straight through. The test and emulation wrappers (``throttle``, ``fault``) build on it
    and override only the data path.

    Args:
        options: a `WrapperOptions` (or a subclass's); ``inner`` is opened at once and closed with
            this backend.

    Raises:
        ConfigError: ``inner`` is not a valid backend URL or table (named as ``<scheme>.inner``).
    """

    Options: ClassVar[type[BackendOptions]] = WrapperOptions

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert isinstance(options, WrapperOptions)
        self.inner = open_backend(options.inner, where=f"{self.scheme}.inner")

    @classmethod
    def options_from_url(cls, scheme: str, location: str, query: Mapping[str, str]) -> dict[str, Any]:
        """Implements [`Backend.options_from_url`][]: all in the query
        (``fault://?inner=dram://``)."""
        return dict(query)

    @property
    def capabilities(self) -> Capabilities:
        """Implements [`Backend.capabilities`][]: those of ``inner``."""
        return self.inner.capabilities

    def _delete(self, name: str) -> None:
        """Implements `Backend._delete` by ``inner``'s."""
        self.inner.delete(name)

    def _exists(self, name: str) -> bool:
        """Implements `Backend._exists` by ``inner``'s."""
        return self.inner.exists(name)

    def _size(self, name: str) -> int:
        """Implements `Backend._size` by ``inner``'s."""
        return self.inner.size(name)

    def _list(self) -> builtins.list[str]:
        """Implements `Backend._list` by ``inner``'s."""
        return self.inner.list()

    def spare_bytes(self) -> int:
        """Implements [`Backend.spare_bytes`][] by ``inner``'s."""
        return self.inner.spare_bytes()

    def release_spares(self, nbytes: int | None = None) -> int:
        """Implements [`Backend.release_spares`][] by ``inner``'s."""
        return self.inner.release_spares(nbytes)

    def location(self) -> Location | None:
        """Implements [`Backend.location`][]: ``inner``'s medium."""
        return self.inner.location()

    def claim_scratch(self) -> None:
        """Implements [`Backend.claim_scratch`][] by ``inner``'s."""
        self.inner.claim_scratch()

    def _close(self) -> None:
        """Implements `Backend._close`: ``inner`` is closed."""
        self.inner.close()
