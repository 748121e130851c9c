from pathlib import Path

import numpy as np
from tierstore.backends import Backend, open_backend
from tierstore.backends.dram import DramBackend

from tierstore.testing import BackendTests


class TestDramBackend(BackendTests):
    def open(self, root: Path) -> Backend:
        return open_backend("dram://")

    def raw_get(self, backend: Backend, name: str) -> bytes:
        assert isinstance(backend, DramBackend)
        return backend.view(name).tobytes()

    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        assert isinstance(backend, DramBackend)
        backend._buffers[name] = np.frombuffer(data, np.uint8).copy()
        backend._sizes[name] = len(data)
