"""argparse types for the sizes and counts a command line takes (``tierstore``'s and the benchmark
scripts'): each raises ``argparse.ArgumentTypeError``, so that a bad value is a usage error that
names its option instead of a traceback."""

from __future__ import annotations

import argparse

from ..config import parse_byte_size
from ..errors import ConfigError


def byte_size(text: str) -> int:
    """A byte count written as a config writes one (``"64MiB"``, ``"1GB"``, ``"4096"``; 0 allowed)."""
    try:
        return parse_byte_size(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_byte_size(text: str) -> int:
    """A byte count (as `byte_size`) of at least one byte."""
    size = byte_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, not {text!r}")
    return size


def positive_int(text: str) -> int:
    """A whole number of at least 1 (a count of steps, objects, layers...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
