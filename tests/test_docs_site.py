"""The documentation site builds strictly and its API pages link to each other.

Docstrings name other objects with mkdocstrings' cross-references (``[`StagingArea`][]``); the
site is built once, as ``make docs`` builds it, and a link is followed to the anchor it names.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from .helpers import run_child

ROOT = Path(__file__).resolve().parent.parent

# A Sphinx role (:class:`X`, :meth:`~a.b.C.m`, ...): docstrings use mkdocstrings' syntax instead,
# and nothing on the site turns a role into a link.
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):`")


class Page(HTMLParser):
    """The ids of a page's elements and the links its docstrings' text holds, each with the heading
    it follows (a link inside ``<code>`` is a type annotation's, which mkdocstrings links anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[tuple[str, str, str]] = []  # (heading id, href, text)
        self.text: list[str] = []
        self._heading = ""
        self._code = 0
        self._link: tuple[str, list[str]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if element_id := attributes.get("id"):
            self.ids.add(element_id)
            if re.fullmatch(r"h[1-6]", tag):
                self._heading = element_id
        if tag == "code":
            self._code += 1
        if tag == "a" and attributes.get("href") and not self._code:
            self._link = (attributes["href"] or "", [])

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._link is not None:
            self._link[1].append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "code":
            self._code -= 1
        if tag == "a" and self._link is not None:
            href, text = self._link
            self.links.append((self._heading, href, "".join(text).strip()))
            self._link = None


def parse(page: Path) -> Page:
    parsed = Page()
    parsed.feed(page.read_text())
    return parsed


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly (a broken cross-reference fails the build) into a temporary folder."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs and mkdocstrings are not installed (pip install -e '.[docs]')")
    folder = tmp_path_factory.mktemp("docs") / "site"
    built = run_child(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(folder)],
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        cwd=ROOT,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr}"
    return folder


def test_tierstore_staging_links_to_the_staging_area(site: Path) -> None:
    pages = {page.resolve(): parse(page) for page in sorted((site / "api").glob("*.html"))}
    links = [
        (page, href)
        for page, parsed in pages.items()
        for heading, href, text in parsed.links
        if heading.endswith(".TierStore.staging") and text == "StagingArea"
    ]
    assert links, "TierStore.staging's docstring has no link to StagingArea"
    for page, href in links:
        path, _, fragment = href.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{href} (from {page.name}) names no page"
        assert fragment.endswith(".StagingArea"), f"{href} names no StagingArea anchor"
        ids = pages[target].ids if target in pages else parse(target).ids
        assert fragment in ids, f"{href} (from {page.name}): no element with id {fragment}"


def test_no_sphinx_role_is_shown(site: Path) -> None:
    shown = {
        page.name: ROLE.findall(" ".join(parse(page).text)) for page in sorted((site / "api").glob("*.html"))
    }
    assert not any(shown.values()), f"Sphinx roles shown as text (use [`Name`][] instead): {shown}"
