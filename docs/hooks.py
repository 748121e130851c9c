"""MkDocs hook: lay out the package as it is installed, for the API reference.

The source folders map to modules (``backends/`` is ``tierstore.backends``, ...; pyproject.toml's
``package-dir``), which griffe cannot follow from the checkout. Before a build this writes
``build/docs-tree/tierstore``: links to ``tierstore/``'s files plus one link per mapped folder,
the same layout ``make lint`` gives mypy.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "docs-tree"


def package_tree(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Write ``tree`` (links shaped as the installed package) from ``root``'s pyproject.toml."""
    mapping: dict[str, str] = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    shutil.rmtree(tree, ignore_errors=True)
    package = tree / "tierstore"
    package.mkdir(parents=True)
    for entry in (root / mapping["tierstore"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for module, folder in sorted(mapping.items()):
        parts = module.split(".")
        if len(parts) == 2 and not (package / parts[1]).exists():
            (package / parts[1]).symlink_to(root / folder)
    return tree


def on_startup(command: str, dirty: bool, **kwargs: Any) -> None:
    package_tree()


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Publish the benchmark plots as ``results/<name>.png`` (they live in benchmarks/results)."""
    from mkdocs.structure.files import File

    for plot in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        files.append(
            File(
                f"results/{plot.name}",
                src_dir=str(plot.parent.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
