from pathlib import Path

from tierstore.backends import Backend, open_backend
from tierstore.backends.dram import DramBackend
from tierstore.testing import BackendTests


class TestDramBackend(BackendTests):
    def open(self, root: Path) -> Backend:
        return open_backend("dram://")

    def raw_get(self, backend: Backend, name: str) -> bytes:
        assert isinstance(backend, DramBackend)
        return bytes(backend._objects[name])

    def raw_set(self, backend: Backend, name: str, data: bytes) -> None:
        assert isinstance(backend, DramBackend)
        backend._objects[name] = bytearray(data)
