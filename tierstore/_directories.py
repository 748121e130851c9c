"""Directories a run creates for itself, removed at its end where it left them empty.

A store opened on a path that does not exist yet creates it (and its missing parents); a scratch
store deletes its objects at close, but not those directories. Whoever chose the path for the user
(``tierstore train``'s default directory, the DeepSpeed integration's
``<nvme_path>/tierstore/rank<N>``) notes what creating it makes, with `missing_directories`, before
the store opens, and removes them afterwards with `remove_empty`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def missing_directories(path: str | Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet (absolute, deepest first): what
    creating ``path`` with its parents makes."""
    absolute = Path(path).absolute()
    return [directory for directory in (absolute, *absolute.parents) if not directory.exists()]


def remove_empty(directories: Sequence[Path]) -> None:
    """Remove ``directories`` (from `missing_directories`, deepest first) as far as each is empty:
    the first that is not (files of the run's or of someone else's) or is gone already stays, with
    every directory above it."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return
