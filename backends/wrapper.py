"""A backend in front of another one: the base of the test and emulation wrappers.

Its own module because it opens its inner backend through the registry, which imports
:mod:`.base`; here the import runs one way (wrapper -> registry -> base).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, ClassVar

from .base import Backend, BackendOptions, Capabilities, Location
from .registry import open_backend


class WrapperOptions(BackendOptions):
    inner: str | dict[str, Any]
    """The wrapped backend (URL or table)."""


class WrapperBackend(Backend):
    """A backend in front of another (``inner``): same capabilities, and the metadata operations
    pass straight through. The test and emulation wrappers (``throttle``, ``fault``) build on it
    and override only the data path."""

    Options: ClassVar[type[BackendOptions]] = WrapperOptions

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        assert isinstance(options, WrapperOptions)
        self.inner = open_backend(options.inner, where=f"{self.scheme}.inner")

    @classmethod
    def options_from_url(cls, scheme: str, location: str, query: Mapping[str, str]) -> dict[str, Any]:
        return dict(query)  # e.g. fault://?inner=dram://

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def _delete(self, name: str) -> None:
        self.inner.delete(name)

    def _exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def _size(self, name: str) -> int:
        return self.inner.size(name)

    def _list(self) -> builtins.list[str]:
        return self.inner.list()

    def spare_bytes(self) -> int:
        return self.inner.spare_bytes()

    def release_spares(self, nbytes: int | None = None) -> int:
        return self.inner.release_spares(nbytes)

    def location(self) -> Location | None:
        return self.inner.location()

    def claim_scratch(self) -> None:
        self.inner.claim_scratch()

    def _close(self) -> None:
        self.inner.close()
