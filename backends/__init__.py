"""Pluggable storage backends: named byte objects on one medium each.

See `tierstore.backends.base` for the contract and `tierstore.backends.registry` for how backends
are found. Backend modules are imported lazily, on first use.
"""

from .base import Backend, BackendOptions, Capabilities, Location
from .registry import available_backends, backend_class, open_backend, register_backend

__all__ = [
    "Backend",
    "BackendOptions",
    "Capabilities",
    "Location",
    "available_backends",
    "backend_class",
    "open_backend",
    "register_backend",
]
