"""The rules every option check shares, each written once.

An option (the store's cache budget, a tier's placement, the optimizer's prefetch depth...) is
defined once, as a field of a pydantic model deriving from `ConfigModel`: its type, its default, its
constraints, and what it means in the docstring under it. Everything that takes the option validates
through that field:

* a configuration document (a dict, a TOML or JSON file, the DeepSpeed config's section), with
  ``Model.model_validate``;
* keyword arguments given from Python, with `check_arguments`: a value must already have the
  option's type (an integer, not ``"4"`` nor ``2.0``), and an error is a [`ConfigError`][]
  ``"<argument>: must be <requirement>, not <value>"``;
* another model taking the same option (the DeepSpeed section's ``workers``), with `defined_in`; a
  signature taking it as a keyword argument gets its default with `default_of`;
* the configuration reference (`tierstore.app.reference`), written from the same fields.

Either way a bool is refused where a number belongs: Python and pydantic read ``True`` as 1, so
``budget = true`` would be one byte and ``workers=True`` one thread. And a size in bytes (a field of
pydantic's ``ByteSize``) follows one rule from Python as in a document, `byte_count`: an integer >=
0 or text such as ``"64MiB"``; anything else is refused with one message,
``"<name>: must be a number of bytes >= 0 (an integer or text such as '64MiB'), not <value>"``.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, TypeGuard, TypeVar, Union, get_args, get_origin

import annotated_types
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from .errors import ConfigError

_FROM_PYTHON = "values given from Python"
"""The validation context of `check_arguments`: values must already have their field's type."""

Model = TypeVar("Model", bound=BaseModel)

SIZE_FORMS = "an integer or text such as '64MiB'"
"""The forms a size in bytes takes, in the words of every message that refuses one."""
SIZE_REQUIREMENT = f"a number of bytes >= 0 ({SIZE_FORMS})"
"""What a size in bytes must be, as every message that refuses one says it."""

_SIZE_TEXT = TypeAdapter(ByteSize)


@dataclasses.dataclass(frozen=True)
class Takes:
    """What a field takes, in words (`requirement`), where its type does not say it: metadata of
    an ``Annotated`` type whose validator converts what it is given
    (``Annotated[Format, BeforeValidator(parse), Takes("a format's name or a table")]``)."""

    words: str


def is_integer(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (a numpy integer counts: sizes are often computed with
    numpy): the one meaning of "an integer" for every option."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def byte_count(value: object) -> int | None:
    """``value`` as a number of bytes, by the one rule of every size in bytes, given from Python
    or in a document: an integer >= 0 (a whole float such as JSON's ``4e9`` counts) or text
    such as ``"64MiB"``, ``"2GB"`` or ``"4096"``; None for anything else (a negative size, a
    fraction of a byte, a bool, other text or types)."""
    if isinstance(value, str):
        try:
            return int(_SIZE_TEXT.validate_python(value))
        except ValidationError:
            return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return int(value) if is_integer(value) and value >= 0 else None


class ConfigModel(BaseModel):
    """Base of every option model (the store's document, the backends' options, the workloads'
    settings, the DeepSpeed section): unknown fields are errors, a field's docstring is its
    description, and a bool is no number."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _shared_rules(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        if is_integer(value) and not isinstance(value, int):
            value = operator.index(value)  # a numpy integer, as the int pydantic checks
        if isinstance(value, bool) and not _takes_bool(field.annotation):
            raise PydanticCustomError(
                "bool_number",
                "expected a number or a string, not the boolean {value}",
                {"value": str(value).lower()},
            )
        if value is not None and _is_byte_size(field.annotation):
            count = byte_count(value)
            if count is None:
                raise PydanticCustomError(
                    "byte_size",
                    "must be {requirement} ({forms}), not {value}",
                    {
                        "requirement": requirement(field, with_none=False),
                        "forms": SIZE_FORMS,
                        "value": repr(value),
                    },
                )
            return count
        if info.context == _FROM_PYTHON and not _holds(field.annotation, value):
            raise PydanticCustomError(
                "python_type", "expected {requirement}", {"requirement": requirement(field)}
            )
        return value


def defined_in(model: type[BaseModel], name: str) -> Any:
    """The field defining option ``name`` in ``model``, for another model that takes the same
    option: ``workers: int = defined_in(StoreOptions, "workers")`` (type, default, constraints
    and description come from the one definition)."""
    return model.model_fields[name]


def default_of(model: type[BaseModel], name: str) -> Any:
    """The default of option ``name`` in ``model``, for a signature that takes the option as a
    keyword argument: ``max_reads: int = default_of(PathConfig, "max_reads")`` (the one
    definition's default, never restated)."""
    return model.model_fields[name].get_default(call_default_factory=True)


def check_arguments(
    model: type[Model],
    arguments: Mapping[str, Any],
    *,
    where: str = "",
    names: Mapping[tuple[str, ...], str] | None = None,
) -> Model:
    """``arguments`` (keyword arguments given from Python, in ``model``'s layout) validated through
    ``model``'s fields, the option definitions: each value must already have its field's type, but a
    size in bytes takes text (``"512MiB"``) as in a document (`byte_count`).

    Args:
        model: the model defining the options.
        arguments: the values, keyed as the model's fields (a nested model's as a mapping).
        where: prefix of the error message (``"param_groups.0."``).
        names: the argument's name for a field path where it is not the dotted path itself
            (``("cache", "budget")`` is the store's ``cache_budget``).

    Raises:
        ConfigError: ``"<where><argument>: must be <requirement>, not <value>"`` for the first
            bad argument (a bad size in bytes in the words a document's gets), or
            ``"<where><argument>: <reason>"`` where a field's own check (a rule across fields)
            refused it.
    """
    try:
        return model.model_validate(arguments, context=_FROM_PYTHON)
    except ValidationError as error:
        problem = error.errors()[0]
        location = tuple(str(part) for part in problem["loc"])
        name = (names or {}).get(location, ".".join(location))
        value = _value_at(arguments, location)
        if problem["type"] == "value_error":
            reason = str(problem["ctx"]["error"])
        elif problem["type"] == "byte_size":
            reason = problem["msg"]
        else:
            reason = f"must be {requirement(_field_at(model, location))}, not {value!r}"
        raise ConfigError(f"{where}{name}: {reason}") from None


def requirement(field: FieldInfo, *, with_none: bool = True) -> str:
    """What a field takes, in words: ``"an integer >= 1"``, ``"'write-back' or 'write-through'"``,
    ``"None or a number of bytes >= 0"``; ``with_none=False`` leaves out an optional field's None
    (documents give an option no value by leaving it out)."""
    return _words(field.annotation, list(field.metadata), with_none)


def choices(literal: Any) -> str:
    """A ``Literal``'s values in words: ``"'stripe' or 'place'"``."""
    quoted = [repr(value) for value in get_args(literal)]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _words(annotation: Any, metadata: list[Any], with_none: bool) -> str:
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *more = get_args(annotation)
        return _words(inner, [*metadata, *more], with_none)
    described = next((item.words for item in metadata if isinstance(item, Takes)), None)
    if described is not None:
        return described
    if origin in (Union, UnionType):
        arguments = get_args(annotation)
        words = " or ".join(_words(arg, metadata, with_none) for arg in arguments if arg is not NoneType)
        return f"None or {words}" if with_none and NoneType in arguments else words
    if origin is Literal:
        return choices(annotation)
    if origin is list:
        (item,) = get_args(annotation)
        least = _bound(metadata, annotated_types.MinLen, "min_length")
        count = "one or more" if least == 1 else "a list of"
        return f"{count} {_plural(_words(item, [], with_none))}"
    if origin is dict or annotation is dict:
        return "a table"
    if annotation is bool:
        return "a boolean"
    if isinstance(annotation, type) and issubclass(annotation, int):
        noun = "a number of bytes" if issubclass(annotation, ByteSize) else "an integer"
        return noun + _range(metadata, 0 if issubclass(annotation, ByteSize) else None)
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "a path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a table"
    if annotation is str:
        pattern = next((item.pattern for item in metadata if getattr(item, "pattern", None)), None)
        return "a string" if pattern is None else f"a string matching `{pattern}`"
    return "anything"


def _range(metadata: Sequence[Any], floor: int | None) -> str:
    """`` >= 1``, `` from 1 to 1024`` or ``""`` from a number's bounds."""
    least = _bound(metadata, annotated_types.Ge, "ge")
    least = floor if least is None else least
    most = _bound(metadata, annotated_types.Le, "le")
    if least is not None and most is not None:
        return f" from {least} to {most}"
    if least is not None:
        return f" >= {least}"
    return "" if most is None else f" <= {most}"


def _bound(metadata: Sequence[Any], kind: type[Any], attribute: str) -> Any:
    return next((getattr(item, attribute) for item in metadata if isinstance(item, kind)), None)


def _plural(words: str) -> str:
    """``"a table"`` as ``"tables"``."""
    return words.removeprefix("a ").removeprefix("an ") + "s"


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type takes a bool as itself (``bool``, ``bool | None``, ``Any``...)."""
    return annotation is bool or annotation is Any or any(_takes_bool(arg) for arg in get_args(annotation))


def _is_byte_size(annotation: Any) -> bool:
    """Whether a field holds a size in bytes (``ByteSize``, optional or annotated)."""
    if isinstance(annotation, type):
        return issubclass(annotation, ByteSize)
    return any(_is_byte_size(arg) for arg in get_args(annotation) if arg is not NoneType)


def _holds(annotation: Any, value: object) -> bool:
    """Whether a value given from Python already has a type the field holds: pydantic would
    otherwise turn ``"4"`` and ``2.0`` into the integer option 4 or 2 (sizes in bytes have their own
    rule, `byte_count`)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _holds(get_args(annotation)[0], value)
    if origin in (Union, UnionType):
        return any(_holds(arg, value) for arg in get_args(annotation))
    if annotation is NoneType:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if isinstance(annotation, type) and issubclass(annotation, int):
        return is_integer(value)
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return isinstance(value, (str, os.PathLike))
    return True  # a choice, a string, a table: pydantic's own check takes them only as they are


def _field_at(model: type[BaseModel], location: tuple[str, ...]) -> FieldInfo:
    """The field at a validation error's location (``("cache", "budget")``)."""
    field = model.model_fields[location[0]]
    nested = field.annotation
    if len(location) > 1 and isinstance(nested, type) and issubclass(nested, BaseModel):
        return _field_at(nested, location[1:])
    return field


def _value_at(arguments: Mapping[str, Any], location: tuple[str, ...]) -> Any:
    value: Any = arguments
    for part in location:
        if not isinstance(value, Mapping) or part not in value:
            return value
        value = value[part]
    return value
