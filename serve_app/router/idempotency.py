"""Idempotency-Key: a repeat gets the first answer, never a second generation.

Keys are scoped by tenant (two tenants may pick the same key). A repeat within
``ttl_s`` of the first answer gets that answer; a repeat while the first is still
running waits for it. A first attempt that *fails* is forgotten, so the client's
retry runs for real. The store is bounded: expired entries go first, then the
oldest; an evicted key simply runs again.

Scope: one router replica. With several routers the key is honoured per router
(a client retrying through another router may generate twice); see the note in
DESIGN/README.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional


class _FirstCancelled(Exception):
    """The first request for a key was cancelled (its client left): waiters run it themselves."""


@dataclass
class _Entry:
    future: "asyncio.Future[dict[str, Any]]"
    done_at_s: Optional[float] = None


class IdempotencyStore:
    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        # Insertion order == age order; only touched from the router's event loop.
        self._entries: "OrderedDict[tuple[str, str], _Entry]" = OrderedDict()
        self.replays = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self) -> None:
        now = self._clock()
        for key in [k for k, e in self._entries.items() if e.done_at_s is not None and now - e.done_at_s > self._ttl_s]:
            del self._entries[key]
        while len(self._entries) >= self._max:
            self._entries.popitem(last=False)

    async def run(
        self, tenant: str, key: str, fn: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[dict[str, Any], bool]:
        """``fn()``'s result, or the earlier one for the same (tenant, key); True when replayed."""
        slot = (tenant, key)
        while True:
            entry = self._entries.get(slot)
            if entry is not None and entry.done_at_s is not None and self._clock() - entry.done_at_s > self._ttl_s:
                del self._entries[slot]
                entry = None
            if entry is None:
                return await self._first(slot, fn), False
            self.replays += 1
            try:
                # shield: a repeat that gives up must not cancel the first request's work
                return await asyncio.shield(entry.future), True
            except _FirstCancelled:
                self.replays -= 1
                continue  # the first one's client left; this one still wants an answer

    async def _first(self, slot: tuple[str, str], fn: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        self._evict()
        future: "asyncio.Future[dict[str, Any]]" = asyncio.get_running_loop().create_future()
        entry = _Entry(future)
        self._entries[slot] = entry
        try:
            result = await fn()
        except BaseException as exc:
            if self._entries.get(slot) is entry:
                del self._entries[slot]  # failed: a retry must run for real
            if not future.done():
                future.set_exception(exc if isinstance(exc, Exception) else _FirstCancelled())
                future.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        future.set_result(result)
        entry.done_at_s = self._clock()
        return result
