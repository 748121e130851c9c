"""Test support shipped with tierstore: the backend conformance suite, and the small GPT-style
model (:mod:`.gpt`) that ``tierstore train``, the activation tests and the benchmarks train.

Every backend's test module subclasses :class:`BackendTests`; third-party backends can do the same
to prove they honour the contract in :mod:`tierstore.backends.base`. The suite needs pytest (the
``test`` extra), the model only the runtime dependencies: ``tierstore train`` imports
:mod:`.gpt`, which imports this package first, so the suite is imported on first use of the name
only (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import BackendTests

__all__ = ["BackendTests"]


def __getattr__(name: str) -> Any:
    if name == "BackendTests":
        from .backend import BackendTests

        return BackendTests
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
