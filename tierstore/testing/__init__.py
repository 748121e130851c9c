"""Test support shipped with tierstore: the backend conformance suite.

Every backend's test module subclasses :class:`BackendTests`; third-party backends can do the same
to prove they honour the contract in :mod:`tierstore.backends.base`.
"""

from .backend import BackendTests

__all__ = ["BackendTests"]
