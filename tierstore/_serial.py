"""Per-key ordering on a shared thread pool.

Operations on one key run one after another in call order (so a ``get`` sees the ``put`` issued
before it), operations on different keys run in parallel. Chaining is done with done-callbacks,
never by parking a worker thread on a predecessor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")


class KeyedSerializer:
    def __init__(self, workers: int, name: str) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._tails: dict[str, Future[Any]] = {}
        self._lock = threading.Lock()

    def submit(self, key: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` after every operation already submitted for ``key``."""
        result: Future[T] = Future()

        def run() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                result.set_result(fn(*args))
            except BaseException as error:
                result.set_exception(error)

        result.add_done_callback(lambda done: self._forget(key, done))  # before anyone can see it
        with self._lock:
            previous = self._tails.get(key)
            self._tails[key] = result
        try:
            if previous is None:
                self._executor.submit(run)
            else:
                previous.add_done_callback(lambda _: self._executor.submit(run))
        except BaseException:  # a Ctrl-C here: never scheduled, so nobody may wait for it
            result.cancel()
            raise
        return result

    def pending(self, key: str) -> bool:
        """Whether an operation on ``key`` is queued or running."""
        with self._lock:
            return key in self._tails

    def drain(self) -> None:
        """Wait until every submitted operation has finished."""
        while True:
            with self._lock:
                tails = list(self._tails.values())
            if not tails:
                return
            wait(tails)

    def shutdown(self) -> None:
        self.drain()
        self._executor.shutdown(wait=True)

    def _forget(self, key: str, done: Future[Any]) -> None:
        with self._lock:
            if self._tails.get(key) is done:
                del self._tails[key]
