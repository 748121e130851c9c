"""The Zarr backend's conformance suite on a real network file system standing in for the PFS
(the ``remote_mount`` fixture of ``conftest.py``: sshfs over TCP, started only if needed)."""

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierstore.backends import Backend, open_backend

from . import test_backend_zarr as local  # not the class itself: pytest would collect it twice


class TestZarrRemoteBackend(local.TestZarrLocalBackend):
    """Same tests, same raw helpers; only the medium is remote."""

    @pytest.fixture
    def root(self, remote_mount: Path) -> Iterator[Path]:
        root = remote_mount / f"tierstore-test-{uuid.uuid4().hex[:8]}"
        yield root
        shutil.rmtree(root, ignore_errors=True)

    def open(self, root: Path) -> Backend:
        assert root.parent.is_mount() or "TIERSTORE_REMOTE_MOUNT" in os.environ
        return open_backend(f"zarr+file://{root}?chunk_bytes=65536&queue_depth=4")
