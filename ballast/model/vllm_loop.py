"""The event loop a vLLM engine runs on: a daemon thread of its own.

vLLM's ``AsyncLLM`` lives on one asyncio loop; the replica drives it from other threads
(its engine loop's worker thread, an admin call's). :class:`EngineLoop` owns that loop
and its thread, and :meth:`EngineLoop.call` runs a coroutine there from any thread and
waits for its result with a bound: the engine's state is only ever touched on its loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["CALL_SLACK_S", "SHUTDOWN_WAIT_S", "EngineLoop"]

CALL_SLACK_S = 30.0  # beyond a call's own bound: the engine loop itself is stuck
SHUTDOWN_WAIT_S = 15.0

T = TypeVar("T")


class EngineLoop:
    """One engine's event loop, running in a daemon thread named ``vllm-<name>``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._stopped = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"vllm-{name}", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` s; None: no
        bound); RuntimeError, the coroutine closed unrun, once the loop is stopped."""
        if self._stopped:
            coro.close()
            raise RuntimeError(f"engine {self.name!r} is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        """Stop the loop and wait for its thread (``SHUTDOWN_WAIT_S``); later calls are
        refused. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=SHUTDOWN_WAIT_S)
        if not self._thread.is_alive():
            self._loop.close()
