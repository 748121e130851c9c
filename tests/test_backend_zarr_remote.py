"""The Zarr backend's conformance suite on a real network file system standing in for the PFS.

``../shared/tools/remote-tier.sh start`` mounts sshfs over TCP (in a private network namespace,
tmpfs behind it). Set TIERSTORE_REMOTE_MOUNT to use another mount point instead. The tests install
nothing (``.ci/run`` installs sshfs as root: without it they skip and say so), and stop exactly
what they started: a remote tier that was up before stays up, and one that is half set up (a
leftover the tests did not make) is left alone and the tests skip.
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
SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")  # where the script runs it from
NOT_UP = re.compile(r"not mounted/healthy: (\S+)")
"""``remote-tier.sh status`` exits 0 either way; this line is how it says the tier is not up."""


def _script(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), command], capture_output=True, text=True, check=False)


def _leftovers(mount: Path) -> list[str]:
    """What the script would set up that exists already while the tier is not up: its mount point
    or its export still mounted, its network namespace."""
    base = Path(os.environ.get("RFS_BASE", f"{os.environ.get('TMPDIR', '/tmp')}/tierstore-remote"))
    namespace = Path("/run/netns") / os.environ.get("RFS_NETNS", "rfs")
    found = [str(path) for path in (mount, base / "export") if path.is_mount()]
    return found + ([str(namespace)] if namespace.exists() else [])


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
    missing = [tool for tool in ("sshfs", "fusermount3", "ip", "nsenter") if shutil.which(tool) is None]
    missing += [] if SFTP_SERVER.exists() else [str(SFTP_SERVER)]
    if missing:
        pytest.skip(
            f"the remote tier needs {', '.join(missing)}, not installed (tests install nothing: "
            ".ci/run installs sshfs and openssh-sftp-server when run as root)"
        )
    status = _script("status").stdout
    down = NOT_UP.search(status)
    if down is None:  # up before the tests: theirs to use, not to stop
        target = re.search(r"^(/\S+)", status, re.MULTILINE)  # findmnt's line for the mount
        if target is None:
            pytest.skip(f"remote tier script status not understood: {status.strip()[-300:]}")
        yield Path(target.group(1))
        return
    leftovers = _leftovers(Path(down.group(1)))
    if leftovers:
        pytest.skip(
            f"the remote tier is half set up ({', '.join(leftovers)}), not by these tests: left as "
            f"found (`{SCRIPT} stop` clears it)"
        )
    started = _script("start")
    try:
        mounted = re.search(r"^up: (\S+)", started.stdout, re.MULTILINE)
        if started.returncode != 0 or mounted is None:
            pytest.skip(
                f"remote tier could not be mounted: {(started.stderr or started.stdout).strip()[-300:]}"
            )
        yield Path(mounted.group(1))
    finally:
        _script("stop")  # this fixture started it (or failed half-way): everything goes


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
