"""Test support shipped with tierstore: the backend conformance suite (it needs pytest, the
``test`` extra).

Every backend's test module subclasses [`BackendTests`][]; third-party backends can do the same to
prove they honour the contract in `tierstore.backends.base`.
"""

from __future__ import annotations

from .backend import BackendTests

__all__ = ["BackendTests"]
