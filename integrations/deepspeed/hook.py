"""``TIERSTORE_DEEPSPEED=1``: tierstore's DeepSpeed switch without a code change.

tierstore installs ``tierstore-deepspeed.pth`` into site-packages; Python runs its one line at
start-up, which imports this module only when the variable is set (``1``, ``true``, ``yes`` or
``on``). :func:`install` then calls :func:`~tierstore.integrations.deepspeed.enable` as soon as
``deepspeed`` has been imported (at once if it already is), so Hugging Face ``Trainer`` and
Accelerate scripts reach tierstore for every config with a ``tierstore`` section. DeepSpeed is
not imported early: a process that never uses it pays only for importing tierstore.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

VARIABLE = "TIERSTORE_DEEPSPEED"  # its test is repeated in tierstore-deepspeed.pth, next to this file


def requested() -> bool:
    return os.environ.get(VARIABLE, "").lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Enable tierstore's DeepSpeed routing now if DeepSpeed is imported, else right after it is."""
    if "deepspeed" in sys.modules:
        _enable()
    elif not any(isinstance(finder, _EnableAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _EnableAfterImport())


def _enable() -> None:
    from tierstore.integrations.deepspeed import enable

    enable()


class _EnableAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; gives ``deepspeed``'s own spec a loader that enables after it runs.
    It stays in place until that happens (``find_spec`` alone, as transformers' availability
    check does, imports nothing)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed":
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, finder: _EnableAfterImport) -> None:
        self.inner = inner
        self.finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.inner  # DeepSpeed's own loader for its resources, as without us
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        _enable()
