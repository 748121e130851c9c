"""The ADIOS2 worker process behind ``tierstore.backends.adios2``.

ADIOS2's Python bindings hold the GIL for a whole put or get, so calling them in the store's
process would freeze every other thread (a thread spinning beside a 256 MiB put makes no progress
until the put ends). This script runs ADIOS2 in a process of its own. It imports only the standard
library, numpy and adios2's bindings (never tierstore or torch), so it starts in a fraction of a
second.

Protocol: one JSON object per line on the request pipe, one reply per request on the reply pipe
(``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``). Bulk data never crosses the pipes:
it moves through ``slots`` shared-memory slots of ``slot_bytes`` in the memory file open as
``MEMORY_FD``. When the store's process is gone (the request pipe ends, or a reply finds nobody
to read it) the worker exits quietly: a traceback would land in the terminal of a process that
no longer exists to explain it.
Usage: ``python _adios2_worker.py REQUEST_FD REPLY_FD MEMORY_FD SLOT_BYTES SLOTS``.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import re
import sys
from typing import Any

import numpy as np

# adios2's package __init__ probes for torch and cupy, which takes seconds; the worker needs neither.
sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
sys.modules.setdefault("cupy", None)  # type: ignore[arg-type]
from adios2 import bindings  # noqa: E402

VARIABLE = "data"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
OPERATIONS = frozenset({"write_begin", "put", "write_end", "read_begin", "get", "read_end", "abort"})


class Server:
    """Executes one write or read session at a time on one ADIOS2 engine."""

    def __init__(self, slots: list[np.ndarray]) -> None:
        self.adios = bindings.ADIOS()
        self.slots = slots
        self.io_names = (f"io{n}" for n in itertools.count())
        self.io: Any = None
        self.io_name = ""
        self.engine: Any = None
        self.variable: Any = None
        self.path = ""

    def write_begin(self, path: str, size: int, engine: str, parameters: dict[str, str]) -> dict[str, Any]:
        self._open(path, engine, parameters, bindings.Mode.Write)
        self.engine.BeginStep()
        if size:
            self.variable = self.io.DefineVariable(VARIABLE, self.slots[0][:1], [size], [0], [size], False)
        return {}

    def put(self, slot: int, offset: int, length: int) -> dict[str, Any]:
        self.variable.SetSelection([[offset], [length]])
        # Deferred + PerformDataWrite writes straight from the slot (2-3x as fast as a
        # Sync put, which copies into ADIOS2's buffer first) and is done with the slot on return,
        # so the parent may refill it; memory stays bounded whatever the object's size.
        self.engine.Put(self.variable, self.slots[slot][:length], bindings.Mode.Deferred)
        self.engine.PerformDataWrite()
        return {}

    def write_end(self) -> dict[str, Any]:
        self.engine.EndStep()
        self._close()
        profile = os.path.join(self.path, "profiling.json")  # written even with Profile=Off
        if os.path.exists(profile):
            os.unlink(profile)
        return {}

    def read_begin(self, path: str, engine: str, parameters: dict[str, str]) -> dict[str, Any]:
        self._open(path, engine, parameters, bindings.Mode.ReadRandomAccess)
        if VARIABLE not in self.io.AvailableVariables():  # an empty object has no variable
            return {"size": 0}
        self.variable = self.io.InquireVariable(VARIABLE)
        return {"size": int(self.variable.Shape()[0])}

    def get(self, slot: int, offset: int, length: int) -> dict[str, Any]:
        self.variable.SetSelection([[offset], [length]])
        self.engine.Get(self.variable, self.slots[slot][:length], bindings.Mode.Sync)
        return {}

    def read_end(self) -> dict[str, Any]:
        self._close()
        return {}

    def abort(self) -> dict[str, Any]:
        """Drop whatever session is open (after a failure on either side)."""
        try:
            if self.engine is not None:
                self.engine.Close()
        except Exception:
            pass
        self.engine = None
        self._close()
        return {}

    def _open(self, path: str, engine: str, parameters: dict[str, str], mode: Any) -> None:
        if self.engine is not None:
            raise RuntimeError("a session is already open")
        self.io_name = next(self.io_names)
        self.io = self.adios.DeclareIO(self.io_name)
        self.io.SetEngine(engine)
        self.io.SetParameters(parameters)
        self.path = path
        self.engine = self.io.Open(path, mode)

    def _close(self) -> None:
        if self.engine is not None:
            self.engine.Close()
        if self.io is not None:
            self.adios.RemoveIO(self.io_name)
        self.engine = self.io = self.variable = None


def main(argv: list[str]) -> int:
    request_fd, reply_fd, memory_fd, slot_bytes, slot_count = (int(arg) for arg in argv[1:])
    memory = mmap.mmap(memory_fd, slot_bytes * slot_count)
    os.close(memory_fd)
    slots = [np.frombuffer(memory, np.uint8, slot_bytes, i * slot_bytes) for i in range(slot_count)]
    server = Server(slots)
    try:
        _reply(reply_fd, {"ok": True, "ready": True})
        with os.fdopen(request_fd, "r") as requests:
            for line in requests:  # ends when the store's process closes the pipe or dies
                message = json.loads(line)
                operation = message.pop("op")
                if operation == "quit":
                    break
                try:
                    if operation not in OPERATIONS:
                        raise ValueError(f"unknown operation {operation!r}")
                    reply = getattr(server, operation)(**message)
                    reply["ok"] = True
                except Exception as error:
                    text = ANSI_ESCAPE.sub("", str(error))  # ADIOS2 colours its messages
                    reply = {"ok": False, "error": f"{type(error).__name__}: {text}"}
                _reply(reply_fd, reply)
    except BrokenPipeError:  # the store's process died: nobody is left to answer
        pass
    return 0


def _reply(reply_fd: int, reply: dict[str, Any]) -> None:
    """Unbuffered, so a dead reader fails this call once and nothing is left to flush at exit."""
    data = (json.dumps(reply) + "\n").encode()
    while data:
        data = data[os.write(reply_fd, data) :]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
