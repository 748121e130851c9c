"""Run a callback right after a module is imported (at once if it already is), without importing
it early: how tierstore's environment switches (``TIERSTORE_DEEPSPEED``, ``TIERSTORE_ACTIVATIONS``)
reach a framework that a training script imports later, or never.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` once module ``name`` has been imported: now if it is, else right after
    its code has run (once, however often this is called for the same pair).

    Args:
        name: the module's full name (``"deepspeed"``, ``"transformers.trainer"``).
        callback: what to run then.
    """
    if name in sys.modules:
        callback()
    elif not any(
        isinstance(finder, _CallAfterImport) and (finder.name, finder.callback) == (name, callback)
        for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _CallAfterImport(name, callback))


class _CallAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; gives the module's own spec a loader that calls back after the module
    runs. It stays in place until that happens (``find_spec`` alone, as an availability check
    does, imports nothing)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, finder: _CallAfterImport) -> None:
        self.inner = inner
        self.finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner  # the module's own loader for its resources, as without us
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        self.finder.callback()
