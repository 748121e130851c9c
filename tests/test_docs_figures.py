"""Every benchmark figure the README and the documentation quote is the one its JSON holds.

The figures live in blocks written by ``benchmarks.figures`` from ``benchmarks/results/*.json``;
these tests check that each block is what its JSON writes today, that no figure is quoted outside
a block (in prose, where nothing would keep it current), and that ``make bench`` regenerates every
JSON a block reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import figures

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A measured figure: a ratio (1.56x), a decimal with a unit of time, speed, size or share
# (3.98 s, 1.15 GB/s, 3.2 GB), or a percentage. Versions, hyperparameters and sizes written as
# configuration ("64MiB", "1.5GB", 4096 x 8192) are not figures.
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?x\b|\b\d+\.\d+\s(?:s|ms|GB/s|MB/s|GB|MB|KB|TB)(?![\w/])|\b\d+(?:\.\d+)?\s?%"
)


# Pages still being written, whose hand-quoted figures are known and named here; each must move its
# figures into a block (``<!-- figures: NAME -->``, rendered by benchmarks.figures).


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_each_quoted_figure_is_the_one_its_json_holds(page: Path) -> None:
    text = page.read_text()
    assert figures.update(text) == text, (
        f"{page.relative_to(ROOT)} quotes figures its JSON no longer holds: "
        f"run python -m benchmarks.figures {page.relative_to(ROOT)}"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_figure_is_quoted_outside_a_generated_block(page: Path) -> None:
    quoted = [
        f"line {number}: {found.group(0)!r}"
        for number, line in enumerate(figures.outside_blocks(page.read_text()).splitlines(), 1)
        for found in FIGURE.finditer(line)
    ]
    assert not quoted, f"{page.relative_to(ROOT)} quotes figures outside a figures block: {quoted}"


def test_the_readme_has_the_headline_table_and_the_performance_page_every_benchmark() -> None:
    assert figures.blocks((ROOT / "README.md").read_text()) == ["headline"]
    assert sorted(figures.blocks((ROOT / "docs" / "performance.md").read_text())) == sorted(figures.RENDERERS)


def test_make_bench_regenerates_every_json_a_block_reads_and_then_the_figures() -> None:
    makefile = (ROOT / "Makefile").read_text().replace("\\\n\t\t", "")
    recipe = makefile.split("\nbench: ", 1)[1].split("\n\n", 1)[0]
    for name, command in figures.COMMANDS.items():
        assert f"$(BIN)/python {command}\n" in recipe, f"make bench does not regenerate {name}.json"
        assert (ROOT / "benchmarks" / "results" / f"{name}.json").exists()
    last = recipe.rstrip().splitlines()[-1].split()
    assert last[:3] == ["$(BIN)/python", "-m", "benchmarks.figures"], (
        "make bench must end by rewriting the figures"
    )
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        if figures.blocks(page.read_text()):
            assert name in last[3:], f"make bench does not rewrite the figures of {name}"


def test_each_block_states_its_command_date_and_machine() -> None:
    for name in figures.RENDERERS:
        data = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
        line = figures.provenance(name, data)
        assert f"`python {figures.COMMANDS[name]}`" in line
        metadata = data.get("metadata", data)
        if "date" in metadata:
            assert metadata["date"][:10] in line
        if "host" in metadata:
            assert f"{metadata['host']['cpus']} CPUs" in line


def test_a_changed_result_changes_the_quoted_figure(tmp_path: Path) -> None:
    """The blocks really are read from the JSON: a new result is a stale page until rewritten."""
    for json_file in (ROOT / "benchmarks" / "results").glob("*.json"):
        (tmp_path / json_file.name).write_text(json_file.read_text())
    optimizer = json.loads((tmp_path / "optimizer.json").read_text())
    optimizer["summary"]["speedup_vs_deepspeed"] = 9.87
    (tmp_path / "optimizer.json").write_text(json.dumps(optimizer))
    text = (ROOT / "README.md").read_text()
    rewritten = figures.update(text, tmp_path)
    assert rewritten != text and "9.87x" in rewritten and "9.87x" not in text
