"""The documentation's configuration reference is written from the option models and stays current."""

import re
import tomllib
from pathlib import Path

from tierstore import load_config
from tierstore.app.reference import table, update
from tierstore.config import StoreConfig

PAGE = Path(__file__).parent.parent / "docs" / "configuration.md"


def test_the_configuration_page_holds_the_reference_the_models_write() -> None:
    text = PAGE.read_text()
    assert update(text) == text, (
        "the reference is stale: run python -m tierstore.app.reference docs/configuration.md"
    )


def test_every_option_is_listed_once_with_its_default() -> None:
    rows = table(StoreConfig).splitlines()[2:]
    keys = [row.split("`")[1] for row in rows]
    assert len(keys) == len(set(keys))
    assert {"cache.budget", "workers", "tiers[].capacity", "tiers[].paths[].node_limit.key"} <= set(keys)
    assert '| `cache.budget` | a number of bytes >= 0 | `"256MiB"` |' in table(StoreConfig)
    assert "| `tiers` | one or more tables | required |" in table(StoreConfig)


def test_the_configuration_pages_example_document_is_valid() -> None:
    section = PAGE.read_text().split("## An example", 1)[1]
    (example,) = re.findall(r"```toml\n(.*?)```", section.split("\n## ", 1)[0], re.DOTALL)
    config = load_config(tomllib.loads(example))
    assert [tier.name for tier in config.tiers] == ["nvme", "offload"]
