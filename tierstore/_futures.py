"""Small helpers for composing ``concurrent.futures.Future`` objects."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def completed(value: T) -> Future[T]:
    """A future that already holds ``value``."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def when_all(futures: Sequence[Future[Any]], on_done: Callable[[], T]) -> Future[T]:
    """A future that completes once every one of ``futures`` has.

    ``on_done`` always runs exactly once, after the last input completes (use it for cleanup such
    as closing a file descriptor); its return value becomes the result. If an input failed, the
    combined future carries the first input error instead, even if ``on_done`` also raised.
    """
    combined: Future[T] = Future()
    remaining = len(futures)
    lock = threading.Lock()

    def finish() -> None:
        first_error = next((f.exception() for f in futures if f.exception() is not None), None)
        try:
            result = on_done()
        except BaseException as error:
            combined.set_exception(first_error or error)
            return
        if first_error is not None:
            combined.set_exception(first_error)
        else:
            combined.set_result(result)

    def one_done(_: Future[Any]) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining == 0
        if last:
            finish()

    if not futures:
        finish()
    for future in futures:
        future.add_done_callback(one_done)
    return combined


def with_failover(attempt: Callable[[], Future[T]], again: Callable[[BaseException], bool]) -> Future[T]:
    """The result of ``attempt()``, run anew each time its future fails and ``again(error)`` says
    another way is left (the next tier of a store, the remaining paths of a tier). ``again`` sees
    every failure, also an error ``attempt`` raises itself, so it is where the caller records what
    failed and cleans up when it gives up."""
    result: Future[T] = Future()

    def start() -> None:
        try:
            future = attempt()
        except BaseException as error:
            if again(error):
                start()
            else:
                result.set_exception(error)
            return
        future.add_done_callback(settle)

    def settle(done: Future[T]) -> None:
        error = done.exception()
        if error is None:
            result.set_result(done.result())
        elif again(error):
            start()
        else:
            result.set_exception(error)

    start()
    return result
