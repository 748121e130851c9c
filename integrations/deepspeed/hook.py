"""``TIERSTORE_DEEPSPEED=1``: tierstore's DeepSpeed switch without a code change.

tierstore installs ``tierstore-deepspeed.pth`` into site-packages; Python runs its one line at
start-up, which imports this module only when the variable is set (``1``, ``true``, ``yes`` or
``on``). `install` then calls [`enable`][] as soon as ``deepspeed`` has been imported (at once if it
already is), so Hugging Face ``Trainer`` and Accelerate scripts reach tierstore for every config
with a ``tierstore`` section. DeepSpeed is not imported early: a process that never uses it pays
only for importing tierstore.
"""

from __future__ import annotations

import os

from .._after_import import after_import

VARIABLE = "TIERSTORE_DEEPSPEED"  # its test is repeated in tierstore-deepspeed.pth, next to this file


def requested() -> bool:
    return os.environ.get(VARIABLE, "").lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Enable tierstore's DeepSpeed routing now if DeepSpeed is imported, else right after it is."""
    after_import("deepspeed", _enable)


def _enable() -> None:
    from tierstore.integrations.deepspeed import enable

    enable()
