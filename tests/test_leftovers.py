"""A test run leaves nothing behind: no process of a child it started (``helpers.child_session``),
no torch extension build lock that would make every later build of that op wait for ever, no
temporary directory of a test that passed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from .helpers import child_session, interrupts_deferred, run_child, session_processes

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

BUILDING = """
import importlib.util, os, runpy, subprocess, sys

# torch's own build lock (torch.utils.cpp_extension.load takes it), without importing torch
torch_package = importlib.util.find_spec("torch").submodule_search_locations[0]
FileBaton = runpy.run_path(os.path.join(torch_package, "utils", "file_baton.py"))["FileBaton"]
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
compiler = subprocess.Popen(["sleep", "600"], process_group=0)  # as ninja runs each compiler
print(compiler.pid, flush=True)
compiler.wait()
baton.release()
"""
"""A build as torch runs one: it holds the op's lock while its compiler runs, and prints the
compiler's process id once both are under way."""


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_build(lock: Path) -> AbstractContextManager[subprocess.Popen[str]]:
    """:data:`BUILDING` holding ``lock`` (``<extensions>/<op>/lock``), by :func:`child_session`."""
    return child_session(
        [sys.executable, "-c", BUILDING, str(lock)],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(lock.parent.parent)},
        stdout=subprocess.PIPE,
    )


def test_a_build_killed_half_way_leaves_no_lock_and_no_process(tmp_path: Path) -> None:
    """As when a test fails or times out while its child builds DeepSpeed's ops."""
    lock = tmp_path / "extensions" / "async_io" / "lock"
    lock.parent.mkdir(parents=True)
    with pytest.raises(TimeoutError), start_build(lock) as build:
        assert build.stdout is not None
        compiler = int(build.stdout.readline())
        assert lock.exists() and sorted(session_processes(build.pid)) == sorted([build.pid, compiler])
        raise TimeoutError("the test's time is up")
    assert not lock.exists()
    assert session_processes(build.pid) == [] and not running(compiler)


def test_a_lock_a_running_build_holds_is_kept(tmp_path: Path) -> None:
    """Another child ending (and another test run starting) removes only abandoned locks."""
    lock = tmp_path / "extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    with start_build(lock) as build:
        assert build.stdout is not None
        build.stdout.readline()
        done = run_child(
            [sys.executable, "-c", "pass"],
            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(lock.parent.parent)},
            timeout=60,
        )
        assert done.returncode == 0 and lock.exists()
    assert not lock.exists()


def test_a_child_past_its_time_limit_is_killed_with_everything_it_started() -> None:
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_child(["sh", "-c", "sleep 600 & echo $$; wait"], timeout=2)
    shell = int(expired.value.output)
    assert session_processes(shell) == []


def test_a_ctrl_c_while_children_are_killed_waits_until_they_are() -> None:
    """``timeout -s INT`` sends two: the second must not cut the clean-up the first started."""
    finished = []
    with pytest.raises(KeyboardInterrupt), interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # Python runs signal handlers between bytecodes: by now it has
        finished.append(True)
    assert finished == [True]


def test_a_passing_tests_temporary_directory_is_removed_when_it_ends(pytester: pytest.Pytester) -> None:
    """Under the project's pytest settings; a failing test's stays, to be looked at."""
    pytester.makepyprojecttoml(PYPROJECT.read_text())
    record = pytester.path / "directories"
    test_file = pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.parametrize("outcome", ["passes", "fails"])
        def test_writes(tmp_path, outcome):
            (tmp_path / "data").write_bytes(bytes(1 << 20))
            with open({str(record)!r}, "a") as directories:
                print(outcome, tmp_path, file=directories)
            assert outcome == "passes"
        """
    )
    pytester.runpytest(test_file).assert_outcomes(passed=1, failed=1)
    directories = dict(line.split(" ", 1) for line in record.read_text().splitlines())
    assert not Path(directories["passes"]).exists()
    assert (Path(directories["fails"]) / "data").exists()
