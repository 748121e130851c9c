"""Griffe extension: Sphinx cross-reference roles in docstrings as inline code.

Docstrings name other objects the reST way (``:class:`~tierstore.errors.ConfigError```,
``:meth:`close```); Markdown would show the role's colons. Each becomes inline code of the name
(the last component where the target starts with ``~``, as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):`(?P<tilde>~?)(?P<target>[^`]+)`"
)


def markdown_roles(text: str) -> str:
    """``text`` with every cross-reference role replaced by inline code of the name it shows."""

    def name(found: re.Match[str]) -> str:
        target = found["target"]
        return f"`{target.rsplit('.', 1)[-1] if found['tilde'] else target.lstrip('.')}`"

    return ROLE.sub(name, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring as it is loaded."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_roles(obj.docstring.value)
