"""The GPU check (``tools/gpu_check.py`` builds the bundle, its ``run.py`` runs it) on this machine:
offline (tierstore's wheel only, built with the installed setuptools) and without CUDA."""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from .helpers import run_child

REPO = Path(__file__).resolve().parents[1]
BUILDER = REPO / "tools" / "gpu_check.py"
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
OFFLINE = {**os.environ, "PIP_NO_INDEX": "1"}  # nothing here may reach a package index

PROBE_TESTS = """
import pytest
import torch

import tierstore


@pytest.mark.{marker}
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_probe_on_the_device() -> None:
    assert torch.ones(1, device="cuda").item() == 1


@pytest.mark.{marker}
def test_probe_imports_the_installed_wheel() -> None:
    assert "tierstore-gpu-check-" in tierstore.__file__, tierstore.__file__
""".format(marker="gpu")  # spelled out, the mark would make the runner take this file for one with gpu tests
"""gpu-marked tests added to a bundle's copy (the real ones may skip or fail for reasons of their
own): one skipped without CUDA, one that passes where tierstore comes from the scratch folder."""


def run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return run_child([sys.executable, *map(str, command)], env=OFFLINE, timeout=300)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle for this machine's Python that carries tierstore's wheel alone (the other
    requirements are installed here already)."""
    out = tmp_path_factory.mktemp("gpu-check") / "bundle"
    built = run(BUILDER, "--out", out, "--no-extra-wheels", "--python-version", HERE)
    assert built.returncode == 0, built.stderr
    return out


def copy_with_probe_tests(bundle: Path, destination: Path) -> Path:
    shutil.copytree(bundle, destination)
    (destination / "tests" / "test_probe_gpu_check.py").write_text(PROBE_TESTS)
    return destination


def steps(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {step["name"]: step for step in document["steps"]}


def test_the_steps_limits_fit_within_the_deadline() -> None:
    """The tests' and every benchmark's own limits, with the runner's reserve, add up to no more
    than the deadline: each step can run to its limit without the deadline cutting a later one."""
    spec = importlib.util.spec_from_file_location("gpu_check_run", REPO / "tools" / "gpu_check_run.py")
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner  # its dataclasses look their module up while being made
    try:
        spec.loader.exec_module(runner)
    finally:
        del sys.modules[spec.name]
    limits = runner.TESTS_TIMEOUT_S + sum(benchmark.timeout_s for benchmark in runner.GPU_BENCHMARKS)
    assert limits + runner.RESERVE_S <= runner.DEADLINE_S


def test_the_bundle_carries_what_tierstore_needs_beyond_what_the_node_provides() -> None:
    node_default = run(BUILDER, "--print-requirements")
    torch_only = run(BUILDER, "--print-requirements", "--node-provides", "torch")
    assert node_default.returncode == 0 and torch_only.returncode == 0, (
        node_default.stderr + torch_only.stderr
    )
    pinned = dict(line.split("==") for line in torch_only.stdout.split())
    assert set(node_default.stdout.split()) == {
        f"{name}=={pinned[name]}"
        for name in ("annotated-types", "pydantic", "pydantic-core", "typing-extensions", "typing-inspection")
    }
    assert set(pinned) - set(dict(line.split("==") for line in node_default.stdout.split())) == {
        "numpy",
        "h5py",
        "filelock",
        "tqdm",
        "xxhash",
    }
    assert all(importlib.metadata.version(name) == version for name, version in pinned.items())


def test_a_bundle_holds_the_wheel_the_tests_the_benchmarks_and_the_runner(bundle: Path) -> None:
    wheels = sorted((bundle / "wheels").iterdir())
    assert [wheel.name for wheel in wheels] == ["tierstore-0.1.0-py3-none-any.whl"]
    with zipfile.ZipFile(wheels[0]) as wheel:
        assert {
            "tierstore/store.py",
            "tierstore/backends/nvme.py",
            "tierstore/optimizer/state_kernels.cpp",
            "tierstore-deepspeed.pth",
        } <= set(wheel.namelist())
    assert (bundle / "run.py").read_text() == (REPO / "tools" / "gpu_check_run.py").read_text()
    assert (bundle / "pyproject.toml").read_text() == (REPO / "pyproject.toml").read_text()
    assert (bundle / "tests" / "conftest.py").is_file() and (bundle / "benchmarks" / "common.py").is_file()
    assert (bundle / "benchmarks" / "__init__.py").is_file()  # its benchmarks run as modules
    assert not (bundle / "benchmarks" / "results").exists()
    assert not list(bundle.rglob("__pycache__"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["python_version"] == HERE and manifest["requirements"] == []
    assert manifest["wheels"] == {wheels[0].name: hashlib.sha256(wheels[0].read_bytes()).hexdigest()}
    assert len(manifest["commit"]) == 40


def test_the_builder_replaces_only_a_bundle(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("kept")
    refused = run(BUILDER, "--out", tmp_path, "--no-extra-wheels")
    assert refused.returncode != 0 and "is not a GPU check bundle" in refused.stderr
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_a_dry_run_plans_every_step_and_runs_none(bundle: Path, tmp_path: Path) -> None:
    copy = copy_with_probe_tests(bundle, tmp_path / "bundle")
    planned = run(copy / "run.py", "--dry-run", "--json", tmp_path / "plan.json", "--scratch", tmp_path)
    assert planned.returncode == 0, planned.stderr
    document = json.loads((tmp_path / "plan.json").read_text())
    names = list(steps(document))
    assert names[:4] == ["install", "requirements", "probe", "tests"]
    assert all(name.startswith("bench ") for name in names[4:])
    modules = [steps(document)[name]["command"][1:3] for name in names[4:]]
    assert modules and all(flag == "-m" and module.startswith("benchmarks.") for flag, module in modules)
    assert {step["status"] for step in document["steps"]} == {"planned"} and document["passed"] is None
    install, tests = steps(document)["install"]["command"], steps(document)["tests"]["command"]
    assert "--no-index" in install and str(copy / "wheels" / "tierstore-0.1.0-py3-none-any.whl") in install
    assert tests[tests.index("-m") + 1 :][:3] == ["pytest", "-m", "gpu"]
    gpu_files = [part for part in tests if part.startswith("tests/")]
    assert "tests/test_probe_gpu_check.py" in gpu_files and "tests/test_gpu_check.py" not in gpu_files
    assert all(name in planned.stdout for name in names) and "planned (dry run)" in planned.stdout
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bundle", "plan.json"]  # no scratch left


def test_each_gpu_benchmark_starts_as_a_module_from_the_bundle(bundle: Path, tmp_path: Path) -> None:
    """The benchmarks' commands as the check plans them, with ``--help`` for their arguments, run from
    a copy of the bundle's benchmarks as the check runs them (without CUDA they are never started)."""
    shutil.copytree(bundle / "benchmarks", tmp_path / "benchmarks")
    planned = run(bundle / "run.py", "--dry-run", "--json", tmp_path / "plan.json", "--scratch", tmp_path)
    assert planned.returncode == 0, planned.stderr
    benchmarks = [
        step
        for name, step in steps(json.loads((tmp_path / "plan.json").read_text())).items()
        if name.startswith("bench ")
    ]
    for step in benchmarks:
        started = run_child([*step["command"][:3], "--help"], env=OFFLINE, timeout=300, cwd=tmp_path)
        assert started.returncode == 0 and started.stdout.startswith("usage: "), step["name"] + started.stderr


def test_without_cuda_the_gpu_tests_skip_and_the_benchmarks_say_so(bundle: Path, tmp_path: Path) -> None:
    copy = copy_with_probe_tests(bundle, tmp_path / "bundle")
    scratch, results = tmp_path / "scratch", tmp_path / "results.json"
    scratch.mkdir()
    checked = run(
        copy / "run.py",
        "--allow-no-cuda",
        "--json",
        results,
        "--scratch",
        scratch,
        "--pytest-args",
        "-k probe",
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    document = json.loads(results.read_text())
    assert document["passed"] is True and document["cut"] == [] and document["problems"] == []
    assert document["environment"]["cuda_available"] is False
    assert "tierstore-gpu-check-" in document["environment"]["tierstore_path"]
    assert document["tests"]["counts"] == {"passed": 1, "failed": 0, "errors": 0, "skipped": 1}
    assert document["tests"]["skip_reasons"] == {"needs a CUDA device": 1}
    benchmarks = [step for name, step in steps(document).items() if name.startswith("bench ")]
    assert all((step["status"], step["detail"]) == ("skipped", "skipped: no CUDA") for step in benchmarks)
    assert "PASSED" in checked.stdout and "no CUDA device" in checked.stdout
    assert not list(scratch.iterdir())


def test_a_requirement_the_node_does_not_meet_fails_the_check_and_names_it(
    bundle: Path, tmp_path: Path
) -> None:
    copy = copy_with_probe_tests(bundle, tmp_path / "bundle")
    info = "needs_absent-1.0.dist-info"
    with zipfile.ZipFile(copy / "wheels" / "needs_absent-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("needs_absent/__init__.py", "")
        wheel.writestr(
            f"{info}/METADATA",
            "Metadata-Version: 2.1\nName: needs-absent\nVersion: 1.0\nRequires-Dist: absent-on-the-node>=1\n",
        )
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(
            f"{info}/RECORD",
            f"needs_absent/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n",
        )
    scratch, results = tmp_path / "scratch", tmp_path / "results.json"
    scratch.mkdir()
    checked = run(copy / "run.py", "--allow-no-cuda", "--json", results, "--scratch", scratch)
    assert checked.returncode == 1
    document = json.loads(results.read_text())
    found = steps(document)
    assert found["install"]["status"] == "passed" and found["requirements"]["status"] == "failed"
    assert found["requirements"]["detail"].startswith(
        "needs-absent 1.0 requires absent-on-the-node, which is not installed."
    )
    assert {found[name]["detail"] for name in list(found)[2:]} == {"not run: requirements did not pass"}
    assert document["passed"] is False and "FAILED" in checked.stdout


def test_a_step_the_deadline_leaves_no_time_for_is_cut_and_named(bundle: Path, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    checked = run(bundle / "run.py", "--deadline", "5", "--json", results, "--scratch", tmp_path)
    assert checked.returncode == 1
    document = json.loads(results.read_text())
    assert document["cut"] == [{"step": "install", "reason": "cut: the deadline left no time to start it"}]
    assert {step["status"] for step in document["steps"][1:]} == {"skipped"}
    assert document["passed"] is False and "cut: install" in checked.stdout
