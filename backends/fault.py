"""``fault``: TESTING, another backend with injectable failures.

Faults that cannot be produced on demand on a real machine (EIO from a disk, EACCES as root, a
torn write) are injected in front of a real backend, so the layers above are tested against the
errors real media raise::

    backend = open_backend({"type": "fault", "inner": "nvme:///tmp/x"})
    backend.inject("write", errno.ENOSPC, count=1)     # the next write fails with ENOSPC
    backend.inject("write", errno.EIO, torn=True)       # every write: half the bytes, then EIO
    backend.clear()

A failing operation raises [`BackendIOError`][] with the injected errno, through its future (as the
real backends do).
"""

from __future__ import annotations

import errno as errnos
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from ..errors import BackendIOError, ConfigError
from .base import BackendOptions
from .wrapper import WrapperBackend

Operation = Literal["write", "read", "delete"]


@dataclass
class _Fault:
    code: int
    remaining: int | None
    torn: bool


class FaultBackend(WrapperBackend):
    """Another backend whose operations fail on demand (testing; see the module docstring).

    Args:
        options: a `WrapperOptions` (``inner`` is the backend whose operations fail).
    """

    scheme = "fault"

    def __init__(self, options: BackendOptions) -> None:
        super().__init__(options)
        self._faults: dict[str, _Fault] = {}
        self._lock = threading.Lock()

    def inject(
        self, operation: Operation, code: int, *, count: int | None = None, torn: bool = False
    ) -> None:
        """Make ``operation`` fail with an errno, replacing the fault injected for it before.

        Args:
            operation: ``"write"``, ``"read"`` or ``"delete"``.
            code: the errno the failures carry (``errno.ENOSPC``...).
            count: how many of the next calls fail; None: every call until `clear`.
            torn: a failing write stores the first half of its bytes (rounded down to the
                alignment) before it fails, as a write cut short does.

        Raises:
            ConfigError: an unknown operation, a ``code`` that is not an errno, or a ``count``
                below 1.
        """
        if operation not in ("write", "read", "delete"):
            raise ConfigError(f"fault: operation must be 'write', 'read' or 'delete', not {operation!r}")
        if (
            isinstance(code, bool)  # True == 1 would pass for EPERM
            or code not in errnos.errorcode
            or (count is not None and (isinstance(count, bool) or count < 1))
        ):
            raise ConfigError(f"fault: {code!r} is not an errno, or count {count!r} is below 1")
        with self._lock:
            self._faults[operation] = _Fault(code, count, torn)

    def clear(self) -> None:
        """Remove every injected fault: all operations pass through again."""
        with self._lock:
            self._faults.clear()

    def _take(self, operation: Operation) -> _Fault | None:
        with self._lock:
            fault = self._faults.get(operation)
            if fault is None:
                return None
            if fault.remaining is not None:
                fault.remaining -= 1
                if fault.remaining <= 0:
                    del self._faults[operation]
            return fault

    def _error(self, fault: _Fault, what: str) -> BackendIOError:
        return BackendIOError(
            fault.code,
            f"fault: injected {errnos.errorcode.get(fault.code, fault.code)} "
            f"({os.strerror(fault.code)}) on {what}",
        )

    def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
        """Implements `Backend._write`: an injected fault fails the future (torn: half written)."""
        fault = self._take("write")
        if fault is None:
            return self.inner.write(name, offset, data)
        if fault.torn and data.nbytes:
            half = data.nbytes // 2 // self.capabilities.alignment * self.capabilities.alignment
            self.inner.write(name, offset, data[:half]).result()
        failed: Future[None] = Future()
        failed.set_exception(self._error(fault, f"writing {name}"))
        return failed

    def _read_into(self, name: str, offset: int, out: memoryview) -> Future[None]:
        """Implements `Backend._read_into`: an injected fault fails the future."""
        fault = self._take("read")
        if fault is None:
            return self.inner.read_into(name, offset, out)
        failed: Future[None] = Future()
        failed.set_exception(self._error(fault, f"reading {name}"))
        return failed

    def _delete(self, name: str) -> None:
        """Implements `Backend._delete`: an injected fault raises its error."""
        fault = self._take("delete")
        if fault is not None:
            raise self._error(fault, f"deleting {name}")
        super()._delete(name)
