"""The Zarr backend's conformance suite on a real network file system standing in for the PFS.

``../shared/tools/remote-tier.sh start`` mounts sshfs over TCP (in a private network namespace,
tmpfs behind it). Set TIERSTORE_REMOTE_MOUNT to use another mount point instead.
"""

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tierstore.backends import Backend, open_backend

from . import test_backend_zarr as local  # not the class itself: pytest would collect it twice

SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "remote-tier.sh"


@pytest.fixture(scope="session")
def remote_mount() -> Iterator[Path]:
    given = os.environ.get("TIERSTORE_REMOTE_MOUNT")
    if given:
        yield Path(given)
        return
    if not SCRIPT.exists():
        pytest.skip(f"no remote-tier script at {SCRIPT} (set TIERSTORE_REMOTE_MOUNT to a mount)")
    if os.geteuid() != 0:
        pytest.skip("mounting the remote tier needs root")
    was_up = (
        subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, check=False).returncode == 0
    )
    started = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, check=False)
    if started.returncode != 0:
        pytest.skip(f"remote tier could not be mounted: {started.stderr.strip()[-300:]}")
    mounted = re.search(r"up: (\S+)", started.stdout)  # "up: MNT (...)" or "already up: MNT"
    if mounted is None:
        pytest.skip(f"remote tier script said: {started.stdout.strip()[-300:]}")
    yield Path(mounted.group(1))
    if not was_up:
        subprocess.run([str(SCRIPT), "stop"], capture_output=True, check=False)


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
