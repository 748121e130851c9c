"""Find backend classes by name or URL scheme, and open backends from URLs or dicts.

Built-in backends are named here as import paths and imported on first use, so an optional
dependency (zarr, adios2...) is only needed by whoever uses that backend. Third-party packages add
backends through the ``tierstore.backends`` entry-point group (``name = "package.module:Class"``),
or at run time with [`register_backend`][].
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import ConfigError
from .base import Backend

ENTRY_POINT_GROUP = "tierstore.backends"

BUILTIN_BACKENDS: dict[str, str] = {
    "dram": "tierstore.backends.dram:DramBackend",
    "nvme": "tierstore.backends.nvme:NvmeBackend",
    "zarr": "tierstore.backends.zarr:ZarrBackend",
    "adios2": "tierstore.backends.adios2:Adios2Backend",
    "throttle": "tierstore.backends.throttle:ThrottleBackend",
    "fault": "tierstore.backends.fault:FaultBackend",
}
"""Registry name -> ``module:Class`` of the backends shipped with tierstore."""

_registered: dict[str, type[Backend]] = {}
_lock = threading.Lock()


def register_backend(cls: type[Backend], name: str | None = None, *, clobber: bool = False) -> None:
    """Make a backend class available to URLs and config tables.

    Args:
        cls: the [`Backend`][] subclass.
        name: the URL scheme and ``type`` it is found by; default ``cls.scheme``.
        clobber: replace a different class registered under ``name`` (otherwise an error).

    Raises:
        ConfigError: another class is registered under ``name`` and ``clobber`` is False.
    """
    key = name or cls.scheme
    with _lock:
        if not clobber and key in _registered and _registered[key] is not cls:
            raise ConfigError(f"a backend named {key!r} is already registered")
        _registered[key] = cls


def available_backends() -> list[str]:
    """Names usable in a URL scheme or a ``type`` field."""
    names = set(BUILTIN_BACKENDS) | set(_registered)
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def backend_class(name: str) -> type[Backend]:
    """The backend class registered as ``name``, importing it on first use.

    Args:
        name: a registry name ([`available_backends`][]), e.g. ``"nvme"``.

    Raises:
        ConfigError: no backend of that name, or its module needs a package that is not
            installed (the message says what to install).
    """
    with _lock:
        if name in _registered:
            return _registered[name]
    target = BUILTIN_BACKENDS.get(name)
    if target is None:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise ConfigError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
        target = found[0].value
    cls = _import(name, target, builtin=name in BUILTIN_BACKENDS)
    register_backend(cls, name, clobber=True)
    return cls


def _import(name: str, target: str, *, builtin: bool) -> type[Backend]:
    module_name, _, attribute = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attribute)
    except ImportError as error:
        remedy = f"pip install 'tierstore[{name}]'" if builtin else f"install {error.name!r}"
        raise ConfigError(
            f"backend {name!r} needs the package {error.name!r}, which is not installed: {remedy}"
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigError(f"backend {name!r} ({target}) is not a tierstore Backend subclass")
    return cls


def open_backend(spec: str | Mapping[str, Any], *, where: str = "backend") -> Backend:
    """Open a backend from a URL or a config table.

    Args:
        spec: a URL, ``scheme://location?option=value&...`` (``nvme:///data?queue_depth=8``,
            ``zarr+s3://bucket/prefix``), or a mapping with the registry name in ``type`` and
            the options beside it (``{"type": "nvme", "path": "/data"}``).
        where: the spec's place in a larger config document (``"tiers.0.backend"``), which
            error messages name.

    Returns:
        The open backend.

    Raises:
        ConfigError: an unknown backend, or options it does not accept (each named).
        UnwritablePathError: the backend cannot write its medium.
    """
    if isinstance(spec, str):
        parts = urlsplit(spec)
        if not parts.scheme or "://" not in spec:
            raise ConfigError(f"{where}: {spec!r} is not a backend URL such as 'nvme:///path'")
        cls = backend_class(parts.scheme.partition("+")[0])  # zarr+s3:// -> the "zarr" backend
        query = dict(parse_qsl(parts.query))
        options = cls.options_from_url(parts.scheme, parts.netloc + parts.path, query)
        return cls.from_options(options, where=where)
    if isinstance(spec, Mapping):
        options = dict(spec)
        kind = options.pop("type", None)
        if not isinstance(kind, str):
            raise ConfigError(f"{where}.type: missing; name a backend ({', '.join(available_backends())})")
        return backend_class(kind).from_options(options, where=where)
    raise ConfigError(f"{where}: expected a URL string or a mapping, got {type(spec).__name__}")
