"""The set-up's choice of torch (``tools/install-torch``, which ``make demo`` and ``make test`` run
first): a torch already installed is kept, a machine where ``nvidia-smi`` runs gets the CUDA build,
any other the CPU build, from pip's configured sources when they hold it, else from PyTorch's CPU
index. Decided by a dry run that prints the pip command instead of running it, with ``nvidia-smi``
and the environment's Python stood in for by scripts: nothing is downloaded or installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

INSTALL_TORCH = Path(__file__).resolve().parents[1] / "tools" / "install-torch"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def stand_in(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def fresh_python(tmp_path: Path, *, configured_sources_hold_cpu_wheel: bool) -> Path:
    """A stand-in for a new environment's Python: ``import torch`` fails, and pip's dry run of
    ``torch==...+cpu`` (the script's question whether pip's configured sources hold the CPU wheel)
    succeeds or fails as told. Anything else it is asked fails the test."""
    probe_status = 0 if configured_sources_hold_cpu_wheel else 1
    return stand_in(
        tmp_path / "python",
        'case "$*" in\n'
        '  "-c import torch") exit 1 ;;\n'
        f'  "-m pip install --dry-run "*" torch==2.13.0+cpu") exit {probe_status} ;;\n'
        "esac\n"
        'echo "unexpected: python $*" >&2\n'
        "exit 99",
    )


def dry_run(
    python: Path, tmp_path: Path, nvidia_smi: str | None, **variables: str
) -> subprocess.CompletedProcess[str]:
    """The script's dry run for ``python``.

    Args:
        python: the environment's Python.
        tmp_path: the test's directory; the stand-in ``nvidia-smi`` goes into ``bin`` under it,
            the only directory on ``PATH``.
        nvidia_smi: the stand-in's script body (``exit 0``: a GPU and its driver), or None for
            no ``nvidia-smi`` at all.
        variables: the script's environment (``TORCH_VARIANT``...).
    """
    bin_directory = tmp_path / "bin"
    bin_directory.mkdir(exist_ok=True)
    (bin_directory / "nvidia-smi").unlink(missing_ok=True)
    if nvidia_smi is not None:
        stand_in(bin_directory / "nvidia-smi", nvidia_smi)
    return subprocess.run(
        ["/bin/sh", str(INSTALL_TORCH), "--dry-run", str(python)],
        env={"PATH": str(bin_directory), **variables},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def chosen(python: Path, tmp_path: Path, nvidia_smi: str | None, **variables: str) -> list[str]:
    """The pip command the dry run prints (empty: nothing to install); arguments as
    :func:`dry_run`'s."""
    run = dry_run(python, tmp_path, nvidia_smi, **variables)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


@pytest.mark.parametrize("configured_sources_hold_cpu_wheel", [True, False], ids=["local", "pypi"])
def test_a_machine_with_an_nvidia_gpu_gets_the_cuda_build(
    tmp_path: Path, configured_sources_hold_cpu_wheel: bool
) -> None:
    python = fresh_python(tmp_path, configured_sources_hold_cpu_wheel=configured_sources_hold_cpu_wheel)
    assert chosen(python, tmp_path, "exit 0") == [str(python), "-m", "pip", "install", "torch==2.13.0"]


@pytest.mark.parametrize(
    "nvidia_smi", [None, "echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9"], ids=["absent", "no-driver"]
)
def test_a_machine_without_one_gets_the_cpu_build_from_pytorchs_cpu_index(
    tmp_path: Path, nvidia_smi: str | None
) -> None:
    python = fresh_python(tmp_path, configured_sources_hold_cpu_wheel=False)
    assert chosen(python, tmp_path, nvidia_smi) == [
        *(str(python), "-m", "pip", "install"),
        *("--extra-index-url", CPU_INDEX, "torch==2.13.0+cpu"),
    ]


def test_the_cpu_build_comes_from_pips_configured_sources_when_they_hold_it(tmp_path: Path) -> None:
    """A local wheel or a mirror: no index beyond what pip is configured with."""
    python = fresh_python(tmp_path, configured_sources_hold_cpu_wheel=True)
    assert chosen(python, tmp_path, None) == [str(python), "-m", "pip", "install", "torch==2.13.0+cpu"]


def test_an_installed_torch_is_kept_whatever_the_machine(tmp_path: Path) -> None:
    """This interpreter imports torch: nothing to install, even where a GPU would get CUDA."""
    assert chosen(Path(sys.executable), tmp_path, "exit 0") == []
    assert chosen(Path(sys.executable), tmp_path, None, TORCH_VARIANT="cuda") == []


def test_the_variant_index_and_version_can_be_chosen(tmp_path: Path) -> None:
    python = fresh_python(tmp_path, configured_sources_hold_cpu_wheel=True)
    pip_install = [str(python), "-m", "pip", "install"]
    assert chosen(python, tmp_path, "exit 0", TORCH_VARIANT="cpu") == [*pip_install, "torch==2.13.0+cpu"]
    assert chosen(python, tmp_path, None, TORCH_VARIANT="cuda") == [*pip_install, "torch==2.13.0"]
    cu126 = "https://download.pytorch.org/whl/cu126"
    assert chosen(python, tmp_path, "exit 0", TORCH_INDEX=cu126) == [
        *(*pip_install, "--extra-index-url", cu126, "torch==2.13.0")
    ]
    assert chosen(python, tmp_path, None, TORCH_VERSION="2.12.1", TORCH_INDEX=CPU_INDEX) == [
        *(*pip_install, "--extra-index-url", CPU_INDEX, "torch==2.12.1+cpu")
    ]


def test_an_unknown_variant_is_refused(tmp_path: Path) -> None:
    python = fresh_python(tmp_path, configured_sources_hold_cpu_wheel=True)
    run = dry_run(python, tmp_path, None, TORCH_VARIANT="rocm")
    assert run.returncode == 2 and "TORCH_VARIANT must be cpu or cuda, not 'rocm'" in run.stderr
