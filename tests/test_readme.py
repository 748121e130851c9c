"""The README's examples run exactly as written, and the README stays a short read.

Every ``python`` and ``sh`` block of README.md runs in an empty directory, with this interpreter
first on ``PATH`` (so ``python`` is the one tierstore is installed in). A block that needs an
optional extra skips, naming it, where that extra is not installed. ``console`` blocks (set-up
and install commands) are shown only: CI runs ``make demo`` and ``make test`` itself.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from .helpers import run_child

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(?P<language>[a-z]*)\n(?P<code>.*?)^```$", re.DOTALL | re.MULTILINE)

# What a block needs beyond the runtime dependencies, told by what it mentions.
EXTRAS = {
    "trainer_example": ("huggingface", ("deepspeed", "transformers", "accelerate")),
    "deepspeed": ("deepspeed", ("deepspeed",)),
    "zarr": ("zarr", ("zarr", "fsspec")),
    "adios2": ("adios2", ("adios2",)),
}


def blocks(language: str) -> list[str]:
    return [found["code"] for found in BLOCK.finditer(README.read_text()) if found["language"] == language]


def runnable() -> list[tuple[str, str]]:
    return [("python", code) for code in blocks("python")] + [("sh", code) for code in blocks("sh")]


def missing_extra(code: str) -> str | None:
    for word, (extra, modules) in EXTRAS.items():
        if word in code:
            absent = [module for module in modules if importlib.util.find_spec(module) is None]
            if absent:
                return f"needs tierstore[{extra}] ({', '.join(absent)} not installed)"
    return None


@pytest.mark.parametrize(("language", "code"), runnable(), ids=lambda value: value.split("\n")[0][:40])
def test_each_example_runs_as_written(
    language: str, code: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    reason = missing_extra(code)
    if reason is not None:
        pytest.skip(reason)
    if "deepspeed" in code:  # its native ops built before the timed run, not inside it
        request.getfixturevalue("deepspeed_ops")
    command = (
        [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
    )
    environment = dict(
        os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    done = run_child(command, cwd=tmp_path, env=environment, timeout=600)
    assert done.returncode == 0, (
        f"the README's {language} block failed:\n{code}\n{done.stdout}\n{done.stderr}"
    )


def test_every_workload_has_an_example() -> None:
    code = "\n".join(code for _, code in runnable())
    for name in (
        "TierStore",
        "OffloadedAdamW",
        "ActivationOffload",
        "ts_deepspeed.initialize",
        "trainer_example",
    ):
        assert name in code
    assert "TieredStorageWriter" in code and "TieredStorageReader" in code


def test_the_first_store_keeps_its_objects_across_a_reopen() -> None:
    """A newcomer's first store is persistent (a manifest) and is opened twice, reading back what
    the first open put: a scratch store would lose its objects at close (the run above fails)."""
    (first, *_) = blocks("python")
    assert '"manifest":' in first
    assert first.count("TierStore.from_config(config)") == 2


def test_the_readme_is_short_and_keeps_the_set_up_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 200
    (setup,) = [code for code in blocks("console") if "make demo" in code]
    assert "make test" in setup


def test_the_readmes_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"the README links to {target}, which does not exist"
