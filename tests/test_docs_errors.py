"""The errors page lists every error tierstore raises on purpose, each with the builtin it also is."""

import inspect
import re
from pathlib import Path

import tierstore
from tierstore import errors

PAGE = Path(__file__).parent.parent / "docs" / "errors.md"
ROW = re.compile(r"^\| `(?P<name>\w+)` \| `(?P<also>\w+)` \|", re.MULTILINE)


def test_every_error_class_is_on_the_errors_page() -> None:
    rows = {row["name"]: row["also"] for row in ROW.finditer(PAGE.read_text())}
    classes = {
        name: error
        for name, error in vars(errors).items()
        if inspect.isclass(error)
        and issubclass(error, errors.TierStoreError)
        and error is not errors.TierStoreError
    }
    assert sorted(set(classes) - set(rows)) == [], "errors missing from docs/errors.md"
    assert sorted(set(rows) - set(classes)) == [], "rows of docs/errors.md for no error class"
    for name, error in classes.items():
        assert rows[name] in {base.__name__ for base in error.__mro__[1:]}, f"{name} is no {rows[name]}"
        assert getattr(tierstore, name) is error, f"{name} is not exported by tierstore, as the page says"
