import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tierstore.backends import open_backend

from tierstore import Tier, TierStore

from .helpers import remove_abandoned_build_locks, run_child

pytest_plugins = ["pytester"]

StoreFactory = Callable[..., TierStore]

SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "remote-tier.sh"
SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")  # where the script runs it from
NOT_UP = re.compile(r"not mounted/healthy: (\S+)")
"""``remote-tier.sh status`` exits 0 either way; this line is how it says the tier is not up."""


TORCH_EXTENSIONS = (
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "tierstore-tests"
    / (
        f"torch-extensions-py{sys.version_info.major}.{sys.version_info.minor}-torch{torch.__version__}-"
        + hashlib.sha256(str(Path(torch.__file__).parent).encode()).hexdigest()[:8]
    )
)
"""Where the tests' children build and find torch extensions (DeepSpeed's native ops): the tests'
own cache, kept between runs (the ops take minutes to build) and apart from the user's
``~/.cache/torch_extensions``. One per torch installation (Python, release and place), since a
build is only good for the torch it was built against and names its headers' place: two
environments sharing one would rebuild the ops whenever they take turns."""
DEEPSPEED_OPS = ("CPUAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")
"""The ops the DeepSpeed runs on CPU load: DeepSpeedCPUAdam's kernel, the swappers' pinned
buffers and asynchronous I/O, the shared-memory collectives of a DeepSpeed process group."""
BUILD_DEEPSPEED_OPS = f"""
from deepspeed.accelerator import get_accelerator
for name in {DEEPSPEED_OPS!r}:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible(verbose=False):
        builder.load(verbose=False)
"""


@pytest.fixture(scope="session", autouse=True)
def torch_extensions() -> Iterator[Path]:
    """``TORCH_EXTENSIONS_DIR`` for the whole run: :data:`TORCH_EXTENSIONS`, cleared first of the
    build locks a killed run left behind (which would make each build wait for ever).

    The environment's own ``bin`` goes first on ``PATH`` too, for this process and its children
    alike: torch's build runs the first ``ninja`` it finds, and two ninja releases (the
    environment's and the system's) read each other's build logs as changed command lines, so
    alternating between them rebuilds every op from scratch (minutes each time)."""
    TORCH_EXTENSIONS.mkdir(parents=True, exist_ok=True)
    remove_abandoned_build_locks(TORCH_EXTENSIONS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS))
        patch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        yield TORCH_EXTENSIONS


@pytest.fixture(scope="session")
def deepspeed_ops(torch_extensions: Path) -> None:
    """DeepSpeed's native ops (:data:`DEEPSPEED_OPS`), built into the tests' cache before any
    timed DeepSpeed run, so that no run's time limit falls on a build (about 4 minutes on 2 busy
    cores, seconds once cached). The build itself has no time limit; interrupting the tests kills
    it and removes its lock."""
    built = run_child([sys.executable, "-c", BUILD_DEEPSPEED_OPS], timeout=None)
    assert built.returncode == 0, f"building DeepSpeed's ops failed:\n{built.stderr[-4000:]}"


def _script(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), command], capture_output=True, text=True, check=False)


def _leftovers(mount: Path) -> list[str]:
    """What the script would set up that exists already while the tier is not up: its mount point
    or its export still mounted, its network namespace."""
    base = Path(os.environ.get("RFS_BASE", f"{os.environ.get('TMPDIR', '/tmp')}/tierstore-remote"))
    namespace = Path("/run/netns") / os.environ.get("RFS_NETNS", "rfs")
    found = [str(path) for path in (mount, base / "export") if _mounted(path)]
    return found + ([str(namespace)] if namespace.exists() else [])


def _mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point, a dead one included (sshfs whose server is gone: any
    look at it fails with ENOTCONN)."""
    try:
        return path.is_mount()
    except OSError:
        return True


@pytest.fixture(scope="session")
def remote_mount() -> Iterator[Path]:
    """A real network file system standing in for the remote PFS tier:
    ``../shared/tools/remote-tier.sh start`` mounts sshfs over TCP (in a private network namespace,
    tmpfs behind it); set TIERSTORE_REMOTE_MOUNT to use another mount point instead. Nothing is
    installed (``.ci/run`` installs sshfs as root: without it the tests skip and say so), and only
    what this fixture started is stopped: a remote tier that was up before stays up, and one that
    is half set up (a leftover the tests did not make) is left alone and the tests skip."""
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


@pytest.fixture(params=["dram", "nvme"])
def tier_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_store(tmp_path: Path, tier_kind: str) -> Iterator[StoreFactory]:
    """Build stores over one persistent tier of the parametrized kind; closes them afterwards."""
    stores: list[TierStore] = []

    def factory(**options: object) -> TierStore:
        url = (
            "dram://"
            if tier_kind == "dram"
            else f"nvme://{tmp_path / f'tier{len(stores)}'}?chunk_bytes=65536"
        )
        store = TierStore([Tier(tier_kind, open_backend(url))], **options)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


TmpfsFactory = Callable[[str], Path]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[TmpfsFactory]:
    """Mount a tmpfs of a given size (``"16m"``) under ``tmp_path``: a real file system that fills
    up. Mounting needs root; without it the test skips and says so. Every mount made is unmounted
    when the test ends, whatever happened."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs (a file system that fills up) needs root")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode:
            pytest.skip(f"mounting a tmpfs is not permitted here: {result.stderr.strip()}")
        mounted.append(point)
        return point

    try:
        yield mount
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", str(point)], check=True)
