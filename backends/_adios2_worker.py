"""The ADIOS2 worker process behind ``tierstore.backends.adios2``.

ADIOS2's Python bindings hold the GIL for a whole put or get, so calling them in the store's
process would freeze every other thread (measured here: a spinning thread made no progress during
a 256 MiB put). This script runs ADIOS2 in a process of its own. It imports only the standard
library, numpy and adios2's bindings (never tierstore or torch), so it starts in a fraction of a
second.

Protocol: one JSON object per line on the request pipe, one reply per request on the reply pipe
(``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``). Bulk data never crosses the pipes:
it moves through ``slots`` shared-memory slots of ``slot_bytes`` in the file ``shm_path``.
Usage: ``python _adios2_worker.py REQUEST_FD REPLY_FD SHM_PATH SLOT_BYTES SLOTS``.
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
        # Deferred + PerformDataWrite writes straight from the slot (measured 2-3x faster than a
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
    request_fd, reply_fd, shm_path, slot_bytes, slot_count = argv[1:]
    size = int(slot_bytes) * int(slot_count)
    with open(shm_path, "r+b") as file:
        memory = mmap.mmap(file.fileno(), size)
    slots = [
        np.frombuffer(memory, np.uint8, int(slot_bytes), i * int(slot_bytes)) for i in range(int(slot_count))
    ]
    server = Server(slots)
    with os.fdopen(int(request_fd), "r") as requests, os.fdopen(int(reply_fd), "w") as replies:
        replies.write(json.dumps({"ok": True, "ready": True}) + "\n")
        replies.flush()
        for line in requests:
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
            replies.write(json.dumps(reply) + "\n")
            replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
