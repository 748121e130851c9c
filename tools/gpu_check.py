"""Build the GPU check's bundle: a folder that runs tierstore's GPU tests and benchmarks in one
command on a GPU node without a package index (common on HPC clusters).

``python tools/gpu_check.py --out .gpu-bundle`` (``make gpu-bundle``) writes into the folder:

- ``wheels/``: tierstore's wheel (pure Python), and the wheels of its runtime needs that the node
  does not provide (``--node-provides``), for the node's Python (``--python-version``), pinned to the
  versions installed here so that the bundle is reproducible;
- ``tests/``, ``pyproject.toml`` (the ``gpu`` marker, pytest's options) and ``benchmarks/``;
- ``run.py`` (``tools/gpu_check_run.py``), the one command to run on the node:
  ``python3 BUNDLE/run.py``;
- ``manifest.json``: what was built, from which commit, for which Python.

It lives beside the project rather than in it: it builds and runs the project as a user would, from
its wheel, and nothing in the package needs it. Run it with the project's environment (``.venv``):
the versions pinned are the ones installed there, and tierstore's wheel is built with its setuptools,
offline. The other wheels come from the package index, or from ``--wheels-from`` offline.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.metadata
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from gpu_check_run import GPU_BENCHMARKS
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).with_name("gpu_check_run.py")

BUNDLE_KIND = "tierstore GPU check"
"""The manifest's ``bundle`` field: what marks a folder as a bundle this script may replace."""

NODE_PROVIDES = ("torch", "numpy", "h5py", "filelock", "tqdm", "xxhash")
"""The runtime needs a GPU node has by default (the project's test node: torch 2.11 with CUDA, and
these among its packages); the bundle carries the rest. ``run.py`` checks the node's versions."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
"""The platform tags whose wheels the node can load (glibc 2.17 or later on x86-64) by default."""

BUNDLED = ("tests", "benchmarks", "pyproject.toml")
"""What the bundle copies from the source tree beside the wheels (benchmarks/results/ left out)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The builder's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-bundle", help="the bundle's folder")
    parser.add_argument(
        "--python-version", default="3.12", help="the node's Python, major.minor (default 3.12)"
    )
    parser.add_argument(
        "--platform",
        action="append",
        dest="platforms",
        help=f"a platform tag the node loads wheels of; repeat for more (default: {', '.join(PLATFORMS)})",
    )
    parser.add_argument(
        "--node-provides",
        type=lambda text: {canonicalize_name(name) for name in text.split(",") if name.strip()},
        default={canonicalize_name(name) for name in NODE_PROVIDES},
        help=f"the distributions the node has, comma-separated (default: {','.join(NODE_PROVIDES)}): "
        "the bundle carries the others that tierstore needs",
    )
    parser.add_argument(
        "--wheels-from",
        type=Path,
        default=None,
        help="take the wheels from this folder instead of the package index (offline)",
    )
    parser.add_argument(
        "--no-extra-wheels",
        action="store_true",
        help="bundle tierstore's wheel only, for a node that has every runtime need already",
    )
    parser.add_argument(
        "--print-requirements",
        action="store_true",
        help="print the pinned requirements the bundle would carry, one a line, and build nothing",
    )
    return parser.parse_args(argv)


def target_environment(python_version: str) -> dict[str, str]:
    """The environment markers of the node (CPython on x86-64 Linux) for evaluating requirements."""
    return {
        "implementation_name": "cpython",
        "implementation_version": f"{python_version}.0",
        "os_name": "posix",
        "platform_machine": "x86_64",
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": f"{python_version}.0",
        "python_version": python_version,
        "sys_platform": "linux",
    }


def runtime_requirements(provides: set[str], python_version: str) -> list[str]:
    """``name==version`` for each distribution tierstore needs at run time on the node, through
    every level of requirements, less ``provides`` (whose own requirements the node meets): the
    versions installed here.

    Args:
        provides: Normalized names of the distributions the node has.
        python_version: The node's Python, major.minor (for requirements that depend on it).

    Raises:
        SystemExit: A distribution needed is not installed here, or not in a version that meets
            what requires it.
    """
    environment = target_environment(python_version)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pending = [(Requirement(text), "tierstore") for text in project["dependencies"]]
    pinned: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    while pending:
        requirement, needed_by = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in provides:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(
                f"{needed_by} needs {requirement}, not installed in {sys.prefix}: the bundle pins the "
                "versions installed where this runs (`make .venv/.test` installs them)"
            ) from None
        if not requirement.specifier.contains(distribution.version, prereleases=True):
            raise SystemExit(f"{needed_by} needs {requirement}, but {sys.prefix} has {distribution.version}")
        pinned[name] = distribution.version
        for extra in {"", *requirement.extras}:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for text in distribution.requires or []:
                needed = Requirement(text)
                if needed.marker is None or needed.marker.evaluate({**environment, "extra": extra}):
                    pending.append((needed, f"{name} {distribution.version}"))
    return [f"{name}=={version}" for name, version in sorted(pinned.items())]


def copy_source(destination: Path) -> None:
    """Copy the checkout's files (tracked, and untracked that git does not ignore) to
    ``destination``: the project as a clone of this working tree would have it, without build
    leftovers (``build/``, ``*.egg-info``) that could end up in the wheel."""
    listing = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, listing.split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(
            f"git {args[0]} failed in {REPO} (the builder needs a git checkout): {error}"
        ) from None


def _pip(*args: str) -> None:
    """Run pip (this interpreter's) quietly; its error, if any, ends the build."""
    command = [sys.executable, "-m", "pip", *args, "-q"]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pip {args[0]} failed:\n{done.stdout}{done.stderr}")


def download_wheels(requirements: list[str], wheels: Path, args: argparse.Namespace) -> None:
    """Download the wheel of each of ``requirements`` for the node's Python and platform, without
    their dependencies (``requirements`` is the whole closure already)."""
    platforms = [option for tag in args.platforms or PLATFORMS for option in ("--platform", tag)]
    source = ["--no-index", "--find-links", str(args.wheels_from)] if args.wheels_from else []
    _pip(
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        args.python_version,
        "--implementation",
        "cp",
        *platforms,
        *source,
        "--dest",
        str(wheels),
        *requirements,
    )


def build(args: argparse.Namespace, requirements: list[str]) -> None:
    """Write the bundle into a new folder beside ``args.out``, then put it in ``args.out``'s place
    (which must be absent, empty or an earlier bundle)."""
    out = args.out.absolute()
    if out.exists() and any(out.iterdir()) and not _is_bundle(out):
        raise SystemExit(f"{out} exists and is not a GPU check bundle: choose another --out")
    with tempfile.TemporaryDirectory(prefix="tierstore-source-") as source_folder:
        source = Path(source_folder)
        copy_source(source)
        missing = [benchmark.path for benchmark in GPU_BENCHMARKS if not (source / benchmark.path).is_file()]
        if missing:
            raise SystemExit(f"{', '.join(missing)}: in GPU_BENCHMARKS ({RUNNER.name}), not in the checkout")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
        try:
            partial.chmod(
                0o755
            )  # mkdtemp's folder is its owner's alone; a copied bundle may run as another user
            wheels = partial / "wheels"
            _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(source))
            if requirements:
                download_wheels(requirements, wheels, args)
            for name in BUNDLED:
                copy = shutil.copytree if (source / name).is_dir() else shutil.copy2
                copy(source / name, partial / name)
            shutil.rmtree(partial / "benchmarks" / "results", ignore_errors=True)
            shutil.copy2(RUNNER, partial / "run.py")
            document = manifest(partial, requirements, args)
            (partial / "manifest.json").write_text(json.dumps(document, indent=2) + "\n")
            if out.exists():
                shutil.rmtree(out)
            partial.rename(out)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def _is_bundle(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "manifest.json").read_text())["bundle"] == BUNDLE_KIND)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def manifest(bundle: Path, requirements: list[str], args: argparse.Namespace) -> dict[str, object]:
    """What the bundle holds and what it was built from, for the check's results."""
    return {
        "bundle": BUNDLE_KIND,
        "built": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "commit": _git("rev-parse", "HEAD").strip(),
        "uncommitted_changes": bool(_git("status", "--porcelain").strip()),
        "python_version": args.python_version,
        "platforms": list(args.platforms or PLATFORMS),
        "node_provides": sorted(args.node_provides),
        "requirements": requirements,
        "wheels": {
            path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted((bundle / "wheels").glob("*.whl"))
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Print the bundle's requirements, or build the bundle and say what it holds."""
    args = parse_args(argv)
    requirements = (
        [] if args.no_extra_wheels else runtime_requirements(args.node_provides, args.python_version)
    )
    if args.print_requirements:
        print("\n".join(requirements))
        return 0
    build(args, requirements)
    size = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    wheels = sorted(path.name for path in (args.out / "wheels").glob("*.whl"))
    print(f"{args.out}: {size / 1e6:.1f} MB, {len(wheels)} wheels ({', '.join(wheels)})")
    print(f"on the GPU node: python3 {args.out.name}/run.py --json RESULTS.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
