"""What the resilient caller races its attempts with, and how it learns where one went.

``Racer`` holds attempts in flight as asyncio tasks: ``start`` one, wait for the ``first`` of
several to end (without cancelling the others, which ``asyncio.wait_for`` would), read its
``outcome``, ``drop`` the losers. The unit tests hand the caller a racer on a fake clock.

``ServeReplicas`` answers, for an attempt sent through a Serve handle, which replica took
it and whether that replica went silent (its heartbeat stopped while another's moves), from
what this process's request routers saw (``ballast.model.routing``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ballast.policies.breaker import Permit


class Racer:
    """Attempts in flight as asyncio tasks (the event loop's)."""

    def start(self, answer: Awaitable[Any]) -> Any:
        return asyncio.ensure_future(answer)

    async def first(self, pending: Sequence[Any], timeout_s: float) -> int | None:
        """The index of the first of ``pending`` to end within ``timeout_s``; None when none did."""
        done, _ = await asyncio.wait(pending, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
        return next((i for i, p in enumerate(pending) if p in done), None)

    def outcome(self, done: Any) -> Any:
        """What an ended attempt answered (its exception raised)."""
        return done.result()

    def drop(self, pending: Any) -> None:
        """An attempt no longer wanted: cancelled, and its end, whatever it is, read."""
        pending.cancel()
        pending.add_done_callback(_read_end)


def _read_end(task: Any) -> None:
    if not task.cancelled():
        task.exception()  # read, so that asyncio does not log it as never retrieved


class Replicas(Protocol):
    def placed(self, response: Any) -> str | None: ...

    def silent(self, model: str, replica: str) -> bool: ...

    def others(self, model: str, besides: str) -> int: ...


class ServeReplicas:
    """Where this process's Serve handles placed each attempt, and which replicas went silent."""

    # The request routers' clock (Serve's ``get_curr_time_s``, the wall clock): the heartbeats
    # were seen on it.
    def __init__(self, silent_after_s: float, clock: Callable[[], float] = time.time) -> None:
        self._after_s = silent_after_s
        self._clock = clock

    def placed(self, response: Any) -> str | None:
        from ballast.model.routing_state import placed

        return placed(response)

    def silent(self, model: str, replica: str) -> bool:
        from ballast.model.routing_state import is_silent

        return is_silent(model, replica, self._after_s, self._clock())

    def others(self, model: str, besides: str) -> int:
        """The model's replicas heard from other than ``besides``: where a hedge could go."""
        from ballast.model.routing_state import others

        return others(model, besides, self._after_s, self._clock())


@dataclass
class Try:
    """One attempt in a race: its call (to cancel), what it is awaited by, its breaker permit,
    when it was sent, and whether it is a hedge."""

    handle: Any
    pending: Any
    permit: Permit
    t0: float
    hedge: bool = False
    value: Any = None  # its answer, once it won


class AllFailed(Exception):
    """Every attempt of a race failed: the kind that says most (``worst``), and the replicas
    found silent (to be passed over by the next attempt)."""

    def __init__(self, kind: str, silent: tuple[str, ...]) -> None:
        super().__init__(kind, silent)
        self.kind, self.silent = kind, silent


class ReplicaSilent(Exception):
    """A stream's replica went silent mid-way (its heartbeat stopped): lost capacity, carried
    on elsewhere as a lost replica's stream is."""

    def __init__(self, replica: str) -> None:
        super().__init__(replica)
        self.replica = replica


# From what says most about the model to what says least: the next try follows the first.
_ORDER = ("deadline_exceeded", "model_error", "attempt_timeout", "backpressure")


def worst(kinds: Sequence[str]) -> str:
    """The kind of a race whose attempts all failed with ``kinds`` (not empty)."""
    return next((k for k in _ORDER if k in kinds), kinds[0])
