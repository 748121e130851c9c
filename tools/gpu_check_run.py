#!/usr/bin/env python3
"""Run tierstore's GPU check from a bundle that ``tools/gpu_check.py`` made: one command on a GPU
node that has torch and CUDA but no package index.

``python3 BUNDLE/run.py`` (this file, copied into the bundle) installs the bundle's wheels into a
scratch folder, checks that the node's own packages meet tierstore's requirements, runs the
``gpu``-marked tests and then every GPU benchmark in :data:`GPU_BENCHMARKS`, prints one table and
writes one JSON. Each step runs under its own time limit and all of them under one deadline (8
minutes by default); the JSON says what a limit cut. The tests and benchmarks run from a copy in the
scratch folder, where no source tree can shadow the installed package.

Only the standard library: this runs before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GpuBenchmark:
    """A GPU benchmark the check runs: ``python -m MODULE *ARGS --output JSON`` in the bundle's copy.

    Attributes:
        name: Its row in the table and its key in the JSON.
        module: Its module in the repository's ``benchmarks`` package (and in the bundle's copy),
            e.g. ``benchmarks.bench_x``. It writes its document to ``--output``; the figures under
            the document's ``"summary"`` are the check's headline figures.
        args: Its arguments, sized so that it ends well within ``timeout_s`` on one H100 whose disk
            writes 1.3 GB/s.
        timeout_s: The longest it may run; the check's deadline can cut it shorter.
    """

    name: str
    module: str
    args: tuple[str, ...] = ()
    timeout_s: float = 180.0

    @property
    def path(self) -> str:
        """Its file, relative to the folder that holds the package: ``benchmarks/bench_x.py``."""
        return self.module.replace(".", "/") + ".py"


GPU_BENCHMARKS: tuple[GpuBenchmark, ...] = (
    GpuBenchmark("gpu_store", "benchmarks.bench_gpu_store", timeout_s=90.0),
    GpuBenchmark("optimizer_gpu", "benchmarks.bench_optimizer", ("--device", "cuda"), timeout_s=100.0),
    GpuBenchmark(
        "activations_gpu",
        "benchmarks.bench_activations",
        ("--device", "cuda", "--repeats", "1"),
        timeout_s=110.0,
    ),
)
"""Every GPU benchmark of the check, in the order it runs them: one entry per benchmark, kept here
only (``tools/gpu_check.py`` refuses to build a bundle that lacks one of their modules)."""

GPU_MARK = re.compile(r"\bmark\.gpu\b")
"""How a test file shows that it holds ``gpu``-marked tests (``@pytest.mark.gpu``, ``pytestmark =
pytest.mark.gpu``, ``marks=pytest.mark.gpu``). Only those files are collected: the others may import
what the node lacks (zarr, DeepSpeed), and one collection error would stop the whole run."""

DEADLINE_S = 480.0
"""The whole check's limit by default: 8 minutes."""

TESTS_TIMEOUT_S = 150.0
"""The ``gpu``-marked tests' own limit by default. With :data:`GPU_BENCHMARKS`' limits and
:data:`RESERVE_S` it stays within :data:`DEADLINE_S`, so that no step is cut only because those
before it ran to their limits."""

RESERVE_S = 15.0
"""Kept back from the deadline: the time a cut step gets to stop and the results to be written."""

SHORTEST_STEP_S = 10.0
"""A step that would get less than this before the deadline is cut rather than started."""

STOP_GRACE_S = 10.0
"""After a step's limit, how long it has between SIGTERM (benchmarks remove their data on it) and
SIGKILL."""

SETUP_TIMEOUT_S = {"install": 120.0, "requirements": 60.0, "probe": 90.0}
"""The limit of each set-up step (seconds)."""

TAIL_LINES = 40
"""How much of a step's output the JSON keeps, and the console shows, when the step did not pass."""

PROBE = """
import importlib.metadata, json, platform, sys
import torch, tierstore
found = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "tierstore": importlib.metadata.version("tierstore"),
    "tierstore_path": tierstore.__file__,
}
if found["cuda_available"]:
    device = torch.cuda.get_device_properties(0)
    found.update(
        device=device.name,
        device_count=torch.cuda.device_count(),
        capability=f"{device.major}.{device.minor}",
        device_memory_bytes=device.total_memory,
    )
print(json.dumps(found))
"""
"""Run with the installed packages from the work folder: what the node has, and where tierstore
was imported from."""

PROBE_SHOWN = "<probe: torch, CUDA and where tierstore is imported from>"
"""The probe as a planned step's command shows it."""


@dataclass
class Step:
    """One step of the check and, once run, its outcome.

    Attributes:
        name: ``install``, ``requirements``, ``probe``, ``tests`` or ``bench NAME``.
        command: What it runs.
        timeout_s: Its own limit (the deadline may cut it shorter).
        status: ``planned``, ``passed``, ``failed``, ``skipped``, ``timed out`` or ``cut``.
        seconds: How long it ran.
        detail: One line for the table: counts, figures or why it did not pass.
        output_tail: The end of its output when it did not pass.
    """

    name: str
    command: list[str]
    timeout_s: float
    status: str = "planned"
    seconds: float | None = None
    detail: str = ""
    output_tail: list[str] = field(default_factory=list)


class Deadline:
    """The check's limit of ``seconds`` in all, counted from its creation."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the check started."""
        return time.monotonic() - self.start

    def limit_for(self, step: Step) -> float | None:
        """The limit ``step`` runs under (its own, or less near the deadline), or None when too
        little time is left to start it."""
        left = self.seconds - self.elapsed() - RESERVE_S
        return None if left < SHORTEST_STEP_S else min(step.timeout_s, left)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The runner's command line."""
    default_json = (
        Path(os.environ["OUT"]) / "gpu_check.json"
        if os.environ.get("OUT")
        else Path("benchmarks/results/gpu/gpu_check.json")
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json",
        type=Path,
        default=default_json,
        help="where to write the results (default: $OUT/gpu_check.json when OUT is set, else "
        "benchmarks/results/gpu/gpu_check.json under the current folder)",
    )
    parser.add_argument(
        "--deadline", type=float, default=DEADLINE_S, help="the whole check's limit in seconds (default 480)"
    )
    parser.add_argument(
        "--tests-timeout",
        type=float,
        default=TESTS_TIMEOUT_S,
        help=f"the tests' own limit in seconds (default {TESTS_TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--pytest-args",
        default="",
        help="more pytest arguments, one shell-quoted string (e.g. '-x -n 4'; -n needs pytest-xdist)",
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        default=None,
        help="the folder to make the scratch folder in: wheels installed, tests and benchmarks "
        "copied and their data written there (default: the system's temporary folder)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder afterwards")
    parser.add_argument(
        "--allow-no-cuda",
        action="store_true",
        help="pass without a CUDA device (everything GPU-only skips); without it, no CUDA fails the check",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print and write the plan (every step's command) and run nothing",
    )
    return parser.parse_args(argv)


def gpu_test_files(tests: Path) -> list[str]:
    """The test files under ``tests`` that hold ``gpu``-marked tests, relative to its parent."""
    return sorted(
        path.relative_to(tests.parent).as_posix()
        for path in tests.rglob("test_*.py")
        if GPU_MARK.search(path.read_text(encoding="utf-8"))
    )


def plan(
    bundle: Path, site: Path, junit: Path, bench_output: Path, test_files: list[str], args: argparse.Namespace
) -> list[Step]:
    """Every step of the check with its command, to run from the work folder with PYTHONPATH=site.

    Args:
        bundle: The bundle's folder.
        site: Where the wheels are installed.
        junit: Where pytest writes its JUnit XML report.
        bench_output: The folder the benchmarks write their JSON documents to.
        test_files: The test files that hold ``gpu``-marked tests (relative to the work folder).
        args: The command line.
    """
    python = sys.executable
    wheels = sorted(str(path) for path in (bundle / "wheels").glob("*.whl"))
    steps = [
        Step(
            "install",
            [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), *wheels],
            SETUP_TIMEOUT_S["install"],
        ),
        Step("requirements", [python, "-m", "pip", "check"], SETUP_TIMEOUT_S["requirements"]),
        Step("probe", [python, "-c", PROBE], SETUP_TIMEOUT_S["probe"]),
        Step(
            "tests",
            [
                python,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-p",
                "no:cacheprovider",
                f"--junitxml={junit}",
                *shlex.split(args.pytest_args),
                *test_files,
            ],
            args.tests_timeout,
            detail="" if test_files else "no test file holds a gpu-marked test",
        ),
    ]
    for benchmark in GPU_BENCHMARKS:
        output = bench_output / f"{benchmark.name}.json"
        command = [python, "-m", benchmark.module, *benchmark.args, "--output", str(output)]
        steps.append(Step(f"bench {benchmark.name}", command, benchmark.timeout_s))
    return steps


def run_command(command: list[str], cwd: Path, env: dict[str, str], limit: float, log: Path) -> int | None:
    """Run ``command`` with its output in ``log``; its exit status, or None if it ran past ``limit``
    (then it and every process it started are stopped: SIGTERM, then SIGKILL)."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if process.poll() is None:  # past its limit, or the check itself interrupted
                _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop ``process``'s whole process group (pytest-xdist workers, a benchmark's helpers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def tail(log: Path) -> list[str]:
    """The last lines of a step's output."""
    return log.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL_LINES:]


def bundled_distributions(bundle: Path) -> set[str]:
    """The normalized names of the bundle's wheels (``pydantic_core-2.50.5-...whl`` -> ``pydantic-core``)."""
    return {_normalized(path.name.split("-")[0]) for path in (bundle / "wheels").glob("*.whl")}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def unmet_requirements(pip_check_output: str, ours: set[str]) -> list[str]:
    """The lines of ``pip check``'s report about the bundle's own distributions (the node's other
    packages may have problems of their own, none of the check's business)."""
    return [
        line
        for line in pip_check_output.splitlines()
        if line.split(" ")[0] and _normalized(line.split(" ")[0]) in ours
    ]


def read_junit(junit: Path) -> dict[str, Any]:
    """Counts and outcomes of the tests from pytest's JUnit XML report."""
    counts: Counter[str] = Counter()
    cases: list[dict[str, Any]] = []
    skip_reasons: Counter[str] = Counter()
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors"}.get(child.tag, "skipped")
                message = child.get("message", "")
        counts[outcome] += 1
        if outcome == "skipped":
            skip_reasons[message] += 1
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"test": test_id, "outcome": outcome, "seconds": float(case.get("time", 0.0))})
        if outcome in ("failed", "errors"):
            cases[-1]["message"] = message
    return {
        "counts": {outcome: counts[outcome] for outcome in ("passed", "failed", "errors", "skipped")},
        "skip_reasons": dict(skip_reasons),
        "cases": cases,
    }


def flatten(summary: Any, prefix: str = "") -> dict[str, Any]:
    """A benchmark's summary as ``{"a.b": figure}``, numbers, booleans and strings only."""
    if isinstance(summary, dict):
        flat: dict[str, Any] = {}
        for key, value in summary.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    if isinstance(summary, (int, float, str, bool)):
        return {prefix.rstrip("."): summary}
    return {}


class Check:
    """One run of the check: its steps, what they found, and the results document.

    ``bundle`` is the bundle's folder (where this file lies), ``args`` the command line, and
    ``scratch`` an empty folder for the installed wheels, the copies of the tests and benchmarks,
    their data and the logs.
    """

    def __init__(self, bundle: Path, args: argparse.Namespace, scratch: Path) -> None:
        self.bundle = bundle
        self.args = args
        self.site = scratch / "site"
        self.work = scratch / "work"
        self.logs = scratch / "logs"
        self.deadline = Deadline(args.deadline)
        self.junit = scratch / "tests.xml"
        self.bench_output = scratch / "benchmarks"
        self.test_files = gpu_test_files(bundle / "tests")
        self.steps = plan(bundle, self.site, self.junit, self.bench_output, self.test_files, args)
        self.manifest: dict[str, Any] = json.loads((bundle / "manifest.json").read_text())
        self.built_for: str = self.manifest["python_version"]
        self.environment: dict[str, Any] = {"driver": _driver_version()}
        self.tests: dict[str, Any] = {}
        self.benchmarks: dict[str, Any] = {}
        self.cut: list[dict[str, str]] = []
        self.problems: list[str] = []

    def run(self) -> None:
        """Run every step in order; a failed set-up step (install, requirements, probe) stops the
        ones after it."""
        self.logs.mkdir(parents=True)
        self.bench_output.mkdir()
        shutil.copytree(
            self.bundle / "tests", self.work / "tests", ignore=shutil.ignore_patterns("__pycache__")
        )
        shutil.copytree(self.bundle / "benchmarks", self.work / "benchmarks")
        shutil.copy2(self.bundle / "pyproject.toml", self.work / "pyproject.toml")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(self.site), os.environ.get("PYTHONPATH")])),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",  # no index to ask
            "PIP_NO_INPUT": "1",
        }
        blocked = ""
        for step in self.steps:
            if blocked:
                step.status, step.detail = "skipped", f"not run: {blocked} did not pass"
            elif step.name.startswith("bench ") and not self.environment.get("cuda_available"):
                step.status, step.detail = "skipped", "skipped: no CUDA"
            elif step.name == "tests" and not self.test_files:
                step.status = "failed"
            else:
                self._run_step(step, env)
                if step.name in SETUP_TIMEOUT_S and step.status != "passed":
                    blocked = step.name

    def _run_step(self, step: Step, env: dict[str, str]) -> None:
        limit = self.deadline.limit_for(step)
        if limit is None:
            step.status, step.detail = "cut", "cut: the deadline left no time to start it"
            self.cut.append({"step": step.name, "reason": step.detail})
            return
        log = self.logs / f"{step.name.replace(' ', '_')}.log"
        _progress(f"[{self.deadline.elapsed():5.0f} s] {step.name} (limit {limit:.0f} s)")
        started = time.monotonic()
        status = run_command(step.command, self.work, env, limit, log)
        step.seconds = round(time.monotonic() - started, 1)
        if status is None:
            cut_by = "the deadline" if limit < step.timeout_s else "its own limit"
            step.status, step.detail = "timed out", f"stopped after {limit:.0f} s ({cut_by})"
            self.cut.append({"step": step.name, "reason": step.detail})
        else:
            step.status = "passed" if status == 0 else "failed"
            self._read_outcome(step, status, log)
        if step.status != "passed":
            step.output_tail = tail(log)

    def _read_outcome(self, step: Step, status: int, log: Path) -> None:
        """What ``step`` (which ran to its end with ``status``) found, into the check's record."""
        output = log.read_text(encoding="utf-8", errors="replace")
        if step.name == "install" and status == 0:
            step.detail = f"{len(list((self.bundle / 'wheels').glob('*.whl')))} wheels into {self.site}"
        elif step.name == "install" and self.built_for != _python_version():
            step.detail = (
                f"the bundle's wheels are for Python {self.built_for}, this is {_python_version()}: "
                f"rebuild it with --python-version {_python_version()}"
            )
        elif step.name == "requirements" and status in (0, 1):
            unmet = unmet_requirements(output, bundled_distributions(self.bundle))
            step.status = "failed" if unmet else "passed"  # pip check exits 1 for any package of the node
            step.detail = "; ".join(unmet) or "the node's packages meet the bundle's requirements"
            if unmet:
                step.detail += " (rebuild the bundle with those left out of --node-provides)"
        elif step.name == "probe" and status == 0:
            self._read_probe(step, output)
        elif step.name == "tests":
            self._read_tests(step, status)
        elif step.name.startswith("bench ") and status == 0:
            self._read_benchmark(step)
        if step.status == "failed" and not step.detail:
            step.detail = f"exit status {status}"

    def _read_probe(self, step: Step, output: str) -> None:
        try:
            self.environment.update(json.loads(output.strip().splitlines()[-1]))
        except (IndexError, ValueError):
            step.status, step.detail = "failed", "its last line is not the JSON it prints"
            return
        found = Path(self.environment["tierstore_path"]).resolve()
        if self.site.resolve() not in found.parents:
            step.status = "failed"
            step.detail = f"tierstore was imported from {found}, not from the installed wheel in {self.site}"
        elif self.environment["cuda_available"]:
            step.detail = f"tierstore {self.environment['tierstore']}, {self.environment['device']}"
        else:
            step.detail = f"tierstore {self.environment['tierstore']}, no CUDA device"
            if not self.args.allow_no_cuda:
                self.problems.append("no CUDA device (--allow-no-cuda accepts that)")

    def _read_tests(self, step: Step, status: int) -> None:
        if not self.junit.exists():
            step.detail = f"pytest wrote no report (exit status {status})"
            return
        self.tests = {"files": self.test_files, **read_junit(self.junit)}
        counts = self.tests["counts"]
        step.detail = ", ".join(f"{count} {outcome}" for outcome, count in counts.items())
        if sum(counts.values()) == 0:
            step.status, step.detail = "failed", "no gpu-marked test was collected"

    def _read_benchmark(self, step: Step) -> None:
        name = step.name.removeprefix("bench ")
        output = self.bench_output / f"{name}.json"
        try:
            document = json.loads(output.read_text())
        except (OSError, ValueError) as error:
            step.status, step.detail = "failed", f"no JSON document in {output}: {error}"
            return
        headline = flatten(document.get("summary", {}))
        self.benchmarks[name] = {"headline": headline, "document": document}
        step.detail = f"{len(headline)} headline figures" if headline else "no summary in its JSON"

    def passed(self) -> bool:
        """Whether every step passed (or skipped for want of CUDA, where that is allowed), nothing
        was cut and nothing else went wrong."""
        no_cuda_skip = self.args.allow_no_cuda
        return not self.problems and all(
            step.status == "passed"
            or (step.status == "skipped" and no_cuda_skip and "no CUDA" in step.detail)
            for step in self.steps
        )

    def _table_details(self, step: Step) -> list[str]:
        """The lines under ``step``'s row: the command of a planned step, the tests that did not
        pass, a benchmark's headline figures."""
        if step.status == "planned":
            return [shlex.join(PROBE_SHOWN if part == PROBE else part for part in step.command)]
        if step.name == "tests" and self.tests:
            failed = [case for case in self.tests["cases"] if case["outcome"] in ("failed", "errors")]
            skipped = [f"skipped {count}: {reason}" for reason, count in self.tests["skip_reasons"].items()]
            return [f"{case['outcome']}: {case['test']}" for case in failed] + skipped
        if step.name.startswith("bench "):
            headline = self.benchmarks.get(step.name.removeprefix("bench "), {}).get("headline", {})
            return [f"{key}: {value}" for key, value in headline.items()]
        return []

    def document(self) -> dict[str, Any]:
        """The results as one JSON document."""
        return {
            "check": "gpu",
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv),
            "passed": None if self.args.dry_run else self.passed(),
            "problems": self.problems,
            "environment": {
                **self.environment,
                "host_python": platform.python_version(),
                "kernel": platform.release(),
                "cpus": os.cpu_count(),
            },
            "bundle": self.manifest,
            "deadline_s": self.args.deadline,
            "elapsed_s": round(self.deadline.elapsed(), 1),
            "cut": self.cut,
            "steps": [asdict(step) for step in self.steps],
            "tests": self.tests,
            "benchmarks": self.benchmarks,
        }

    def table(self) -> str:
        """The results as one table for the console."""
        env = self.environment
        device = env.get("device") or ("no CUDA device" if "cuda_available" in env else "device not probed")
        lines = [
            f"tierstore GPU check: {device}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
            f"driver {env.get('driver') or '?'}, Python {env.get('python', platform.python_version())}",
            f"{'step':<18} {'status':<10} {'seconds':>8}  detail",
        ]
        for step in self.steps:
            seconds = "" if step.seconds is None else f"{step.seconds:.1f}"
            lines.append(f"{step.name:<18} {step.status:<10} {seconds:>8}  {step.detail}")
            lines.extend(f"{'':<39}  {line}" for line in self._table_details(step))
        if self.cut:
            lines.append("cut: " + "; ".join(f"{cut['step']}: {cut['reason']}" for cut in self.cut))
        verdict = "planned (dry run)" if self.args.dry_run else ("PASSED" if self.passed() else "FAILED")
        lines.append(
            f"{verdict} in {self.deadline.elapsed():.0f} s" + "".join(f"; {p}" for p in self.problems)
        )
        return "\n".join(lines)


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi, or None without one."""
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.splitlines()[0].strip() if found.stdout.strip() else None


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the check (or, with --dry-run, only plan it); 0 if it passed."""
    args = parse_args(argv)
    bundle = Path(__file__).resolve().parent
    scratch = Path(tempfile.mkdtemp(prefix="tierstore-gpu-check-", dir=args.scratch))
    try:
        check = Check(bundle, args, scratch)
        if not args.dry_run:
            check.run()
        for step in check.steps:
            if step.output_tail:
                _progress(f"--- {step.name}: {step.detail}\n" + "\n".join(step.output_tail))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(check.document(), indent=2) + "\n")
        print(check.table())
        print(f"results: {args.json}")
    finally:
        if args.keep:
            _progress(f"scratch folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0 if args.dry_run or check.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
