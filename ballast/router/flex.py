"""A router's flex hold for one model (each lane has its own): the glue around
ballast/policies/flex.py's ``FlexQueue``.

A ``service_tier: "flex"`` request that finds no spare capacity (``room() == 0``: the
model's level does not admit ``sheddable``, or its gate has no free slot; the pipeline
says which, ``Pipeline._flex_room``) waits here, not refused, until its turn or until
its time to start runs out (504 DEADLINE_EXCEEDED). Its turn comes on a tick: while
anything is held, a pump ticks once per ``interval_s`` (the snapshot interval: the
level can change no faster), asks ``FlexQueue.step`` which entries expired and whose
turn it is (``room()`` of them, earliest deadline first), and wakes them. A woken
request checks ``room()`` itself when it runs and goes only if there still is some,
else waits for the next tick in its place. Its check and what the pipeline does next
(the level's admission, the ticket, the gate's slot) run in one stretch of the event
loop with no await between, so the room it saw is the room it takes.

A request with nothing held before it and room now goes at once. While held it holds
only its entry here: no tenant place, quota or gate slot, and the tally never sees it.
Refusals: the hold full (503 FLEX_QUEUE_FULL), the tenant holding as many as its
concurrency cap (429 CONCURRENCY_LIMIT), no time left to start (504).

Waits and the pump's sleep go through injected ``wait_for`` and ``sleep`` so that
tests move a fake clock instead of sleeping. Everything runs on the router's event
loop; no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ballast.config import BallastConfig
from ballast.errors import BallastError, ConcurrencyLimited, DeadlineExceeded, FlexQueueFull
from ballast.policies.flex import NO_TIME, QUEUE_FULL, FlexQueue, FlexRefused, Held

WaitFor = Callable[[Awaitable[Any], float], Awaitable[Any]]
Sleep = Callable[[float], Awaitable[None]]


def flex_max_wait_s(cfg: BallastConfig) -> float:
    """How long a flex request without a timeout of its own may be held: ``batch.flex_max_wait_s``."""
    return cfg.batch.flex_max_wait_s


class FlexHold:
    """One model's held flex requests at one router, and the pump that wakes them."""

    def __init__(
        self,
        queue: FlexQueue,
        room: Callable[[], int],
        interval_s: float,
        model: str,
        clock: Callable[[], float] = time.monotonic,
        wait_for: WaitFor = asyncio.wait_for,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.queue = queue  # its clock must be ``clock``
        self._room = room
        self._interval_s = interval_s
        self._model = model
        self._clock = clock
        self._wait_for = wait_for
        self._sleep = sleep
        # Each held request's wake-up: True its turn, False its time ran out. Keys are the
        # queue's entries (an entry leaves both in the waiter's ``finally``): bounded by it.
        self._wakes: dict[Held, asyncio.Future[bool]] = {}
        self._pump: asyncio.Task[None] | None = None
        self.expired = 0  # held requests whose time to start ran out (answered 504), ever

    async def turn(self, tenant: str, start_by_s: float, tenant_cap: int) -> float:
        """Return when the request may go (the seconds it was held; 0: at once), or raise
        DeadlineExceeded, FlexQueueFull or ConcurrencyLimited; a cancelled wait (the
        client left) leaves the hold."""
        if not self.queue and self._room() > 0:
            return 0.0
        try:
            held = self.queue.push(tenant, start_by_s, tenant_cap)
        except FlexRefused as r:
            raise self._refusal(r.reason, tenant, tenant_cap) from None
        self._start_pump()
        try:
            while True:
                wake: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                self._wakes[held] = wake
                try:
                    its_turn = await self._wait_for(asyncio.shield(wake), held.start_by_s - self._clock())
                except asyncio.TimeoutError:
                    its_turn = False
                if not its_turn:
                    self.expired += 1
                    raise DeadlineExceeded(
                        f"held {self._clock() - held.since_s:.1f}s for spare capacity of model {self._model!r}; "
                        "none came in time to serve it before its deadline"
                    )
                if self._room() > 0:  # still there: the pipeline takes it before anything else runs
                    return self._clock() - held.since_s
        finally:
            self._wakes.pop(held, None)
            self.queue.leave(held)

    def tick(self) -> None:
        """Wake the expired (to answer 504) and those whose turn it is."""
        step = self.queue.step(self._room())
        for held, its_turn in [(h, False) for h in step.expired] + [(h, True) for h in step.ready]:
            wake = self._wakes.get(held)
            if wake is not None and not wake.done():
                wake.set_result(its_turn)

    def view(self) -> dict[str, object]:
        """What ``/v1/status`` shows of the hold (``FlexQueue.view``, and the expired)."""
        return {**self.queue.view(), "expired": self.expired}

    def close(self) -> None:
        """Stop the pump (a router going away; tests)."""
        if self._pump is not None:
            self._pump.cancel()

    def _start_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.queue:
            await self._sleep(self._interval_s)
            self.tick()

    def _refusal(self, reason: str, tenant: str, tenant_cap: int) -> BallastError:
        if reason == NO_TIME:
            return DeadlineExceeded(f"too little time left to wait for spare capacity of model {self._model!r}")
        if reason == QUEUE_FULL:
            return FlexQueueFull(
                f"model {self._model!r} holds {self.queue.max_held} flex requests already", retry_after_s=1.0
            )
        return ConcurrencyLimited(f"tenant '{tenant}' has {tenant_cap} flex requests held", retry_after_s=1.0)
