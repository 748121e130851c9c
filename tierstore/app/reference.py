"""The configuration reference, written from the option models themselves.

Each table lists every key of a document with what it takes, its default and what it means, all read
from the fields that define the options (`tierstore._checks`), so the reference cannot drift from
what the code accepts. The documentation's configuration page (``docs/configuration.md``) holds the
tables between markers::

    <!-- reference: store -->
    ...
    <!-- /reference: store -->

``python -m tierstore.app.reference docs/configuration.md`` rewrites them; a test checks they are
current.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ByteSize
from pydantic.fields import FieldInfo

from .._checks import requirement
from ..config import StoreConfig
from ..integrations.deepspeed.config import TierstoreSection

TABLES: dict[str, tuple[type[BaseModel], frozenset[str]]] = {
    "store": (StoreConfig, frozenset()),
    "deepspeed": (TierstoreSection, frozenset({"tiers"})),
}
"""Each table's name in the page's markers, its model, and the keys listed without their own
keys (the DeepSpeed section's ``tiers`` are a store config's, listed in the store's table)."""

_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def table(model: type[BaseModel], collapsed: frozenset[str] = frozenset()) -> str:
    """The markdown table of ``model``'s keys, nested tables' keys dotted (``cache.budget``) and
    those of each table in a list marked ``[]`` (``tiers[].name``)."""
    lines = ["| key | value | default | meaning |", "|---|---|---|---|"]
    for key, field in _rows(model, "", collapsed):
        meaning = _markdown(field.description or "")
        lines.append(f"| `{key}` | {requirement(field, with_none=False)} | {_default(field)} | {meaning} |")
    return "\n".join(lines) + "\n"


def update(text: str) -> str:
    """``text`` (the configuration page) with every table between its markers rewritten."""
    for name, (model, collapsed) in TABLES.items():
        begin, end = f"<!-- reference: {name} -->\n", f"<!-- /reference: {name} -->"
        found = re.search(re.escape(begin) + r".*?" + re.escape(end), text, re.DOTALL)
        if found is None:
            raise ValueError(f"no '{begin.strip()}' ... '{end}' markers for the {name} table")
        text = text[: found.start()] + begin + table(model, collapsed) + end + text[found.end() :]
    return text


def _rows(model: type[BaseModel], prefix: str, collapsed: frozenset[str]) -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        key = prefix + name
        nested, listed = _nested_model(field.annotation)
        if nested is None or key in collapsed:
            yield key, field
            continue
        if not isinstance(field.default, BaseModel):  # a table with defaults of its own has no row
            yield key, field
        yield from _rows(nested, f"{key}[]." if listed else f"{key}.", collapsed)


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model of a field holding a table (or a list of tables: then True), if it does."""
    if get_origin(annotation) in (Union, UnionType):
        found = [_nested_model(arg) for arg in get_args(annotation)]
        return next((each for each in found if each[0] is not None), (None, False))
    if get_origin(annotation) is list:
        item, _ = _nested_model(get_args(annotation)[0])
        return item, True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, ByteSize):
        return f"`{_bytes(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def _bytes(value: int) -> str:
    """``268435456`` as ``"256MiB"``: the largest binary unit that divides it."""
    for unit, size in _BINARY_UNITS:
        if value and value % size == 0:
            return f'"{value // size}{unit}"'
    return str(value)


def _markdown(docstring: str) -> str:
    """A field's docstring as one table cell: reST literals as markdown code, on one line."""
    return " ".join(docstring.replace("``", "`").split()).replace("|", "\\|")


def main(arguments: list[str]) -> int:
    """``python -m tierstore.app.reference docs/configuration.md``: rewrite the file's tables; with no
    file, print them."""
    if not arguments:
        for name, (model, collapsed) in TABLES.items():
            print(f"<!-- reference: {name} -->\n{table(model, collapsed)}<!-- /reference: {name} -->\n")
        return 0
    path = Path(arguments[0])
    path.write_text(update(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
