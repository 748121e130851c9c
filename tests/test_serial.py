"""Per-key ordering (tierstore._serial): an operation interrupted while it is being submitted."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from tierstore._serial import KeyedSerializer


def test_an_operation_interrupted_while_submitted_is_cancelled_and_never_waited_for() -> None:
    """Ctrl-C lands in the thread that submits: the operation must not stay registered as pending,
    or ``drain`` (and so the store's ``close``) would wait for it for ever."""
    serializer = KeyedSerializer(2, "test-serial")
    schedule = serializer._executor.submit

    def interrupted(fn: Any, *args: Any) -> Future[Any]:
        raise KeyboardInterrupt

    serializer._executor.submit = interrupted  # type: ignore[method-assign,assignment]
    with pytest.raises(KeyboardInterrupt):
        serializer.submit("k", lambda: "lost")
    serializer._executor.submit = schedule  # type: ignore[method-assign]
    assert not serializer.pending("k")
    drained = threading.Thread(target=serializer.drain)
    drained.start()
    drained.join(timeout=5)
    assert not drained.is_alive(), "drain waits for an operation that was never scheduled"
    assert serializer.submit("k", lambda: "next").result(timeout=5) == "next"
    serializer.shutdown()
