"""Idempotency-Key: a repeat gets the first answer, never a second generation.

Keys are scoped by tenant (two tenants may pick the same key). A repeat within
``ttl_s`` of the first answer gets that answer; a repeat while the first is still
running waits for it. A first attempt that *fails* is forgotten, so the client's
retry runs for real. The store is bounded: expired entries go first, then the
oldest; an evicted key simply runs again.

Across routers: a key seen for the first time at this router is claimed in the
key table every router shares (``ballast.control.keys``, over
``ballast.policies.idempotency``): a repeat that reaches another router, through another
node's endpoint, waits for the first answer there or gets it. Only requests that
carry a key call it, with a short timeout; a claim that got no reply is made again
(the same owner's repeat is still its claim), and only when the table cannot be
reached at all is the key honoured by this router alone (``shared_unreachable``).

The answer (or the release of a failed attempt) is handed to the table in the
background and tried again, longer each time, until the table takes it: a call that
timed out on its way back may still have claimed the key there, and a claim left
open strands every repeat of the key at the other routers until its lease ends (the
request's whole deadline). So a claim whose call timed out is settled too.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional

from ballast.policies.idempotency import DONE, MINE
from ballast.policies.ttlmap import TTLMap
from ballast.errors import DeadlineExceeded


class _FirstCancelled(Exception):
    """The first request for a key was cancelled (its client left): waiters run it themselves."""


#: Tries to hand an answer or a release to the table, the timeout doubling each time.
SETTLE_ATTEMPTS = 3


class SharedKeys:
    """The shared key table as this router calls it: every call bounded by ``timeout_s``;
    a failure (the actor unreachable, restarting) answers None, never raises."""

    def __init__(self, handle: Callable[[], Any], owner: str, timeout_s: float = 1.0) -> None:
        self._handle = handle  # returns the actor handle (created or looked up lazily)
        self.owner = owner
        self.timeout_s = timeout_s
        self.unreachable = 0

    async def _call(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        try:
            ref = getattr(self._handle(), method).remote(*args)
            return await asyncio.wait_for(ref, timeout=timeout_s or self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - any failure: this router honours the key alone
            self.unreachable += 1
            return _UNREACHABLE

    async def claim(self, slot: tuple[str, str], lease_s: float, within_s: float = float("inf")) -> Any:
        """The table's answer to this router's claim. A call that got no answer is made
        again (its timeout doubling, at most ``SETTLE_ATTEMPTS`` calls, their timeouts
        within ``within_s``): the table may have taken the first, and a repeat by the same
        owner is still its own claim. Only when every call failed does the router honour
        the key alone, so two routers that were slow to hear from the table do not both
        run the request."""
        spent_s = 0.0
        for attempt in range(SETTLE_ATTEMPTS):
            timeout_s = min(self.timeout_s * 2**attempt, within_s - spent_s)
            if timeout_s <= 0:
                break
            answer = await self._call("claim", *slot, self.owner, lease_s, timeout_s=timeout_s)
            if answer is not _UNREACHABLE:
                return answer
            spent_s += timeout_s
        return _UNREACHABLE

    async def wait(self, slot: tuple[str, str], timeout_s: float) -> Any:
        return await self._call("wait", *slot, timeout_s, timeout_s=timeout_s + self.timeout_s)

    async def complete(self, slot: tuple[str, str], result: dict[str, Any]) -> bool:
        return await self._settle("complete", *slot, self.owner, result)

    async def release(self, slot: tuple[str, str]) -> bool:
        return await self._settle("release", *slot, self.owner)

    async def _settle(self, method: str, *args: Any) -> bool:
        """True once the table took the call (it may answer that the claim was not ours)."""
        for attempt in range(SETTLE_ATTEMPTS):
            if await self._call(method, *args, timeout_s=self.timeout_s * 2**attempt) is not _UNREACHABLE:
                return True
        return False


_UNREACHABLE = object()


class IdempotencyStore:
    def __init__(
        self,
        ttl_s: float,
        max_entries: int,
        clock: Callable[[], float] = time.monotonic,
        shared: Optional[SharedKeys] = None,
    ):
        self._clock = clock
        self._shared = shared
        # Each key's first attempt (its future), pending until it answers; insertion
        # order == age order, and a full store drops the oldest, running or not. Only
        # touched from the router's event loop.
        self._entries: "TTLMap[tuple[str, str], asyncio.Future[dict[str, Any]]]" = TTLMap(ttl_s, max_entries)
        self.replays = 0
        # Answers and releases on their way to the shared table (each ends within
        # SETTLE_ATTEMPTS calls); held so that they are not collected mid-way.
        self._settling: set["asyncio.Task[bool]"] = set()

    def _settle_later(self, call: Awaitable[bool]) -> None:
        task = asyncio.ensure_future(call)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self, tenant: str, key: str, fn: Callable[[], Awaitable[dict[str, Any]]], within_s: float = 60.0
    ) -> tuple[dict[str, Any], bool]:
        """``fn()``'s result, or the earlier one for the same (tenant, key); True when replayed.

        ``within_s``: the request's time left; the shared claim's lease, and how long
        this request waits for another router's first attempt."""
        slot = (tenant, key)
        while True:
            first = self._entries.get(slot, self._clock())
            if first is None:
                return await self._first(slot, fn, within_s)
            self.replays += 1
            try:
                # shield: a repeat that gives up must not cancel the first request's work
                return await asyncio.shield(first), True
            except _FirstCancelled:
                self.replays -= 1
                continue  # the first one's client left; this one still wants an answer

    async def _first(
        self, slot: tuple[str, str], fn: Callable[[], Awaitable[dict[str, Any]]], within_s: float
    ) -> tuple[dict[str, Any], bool]:
        self._entries.expire(self._clock())
        future: "asyncio.Future[dict[str, Any]]" = asyncio.get_running_loop().create_future()
        entry = self._entries.put(slot, future)
        try:
            result, replayed = await self._shared_first(slot, fn, within_s)
        except BaseException as exc:
            self._entries.remove(slot, entry)  # failed: a retry must run for real
            if not future.done():
                future.set_exception(exc if isinstance(exc, Exception) else _FirstCancelled())
                future.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        future.set_result(result)
        entry.finish(self._clock())
        return result, replayed

    async def _shared_first(
        self, slot: tuple[str, str], fn: Callable[[], Awaitable[dict[str, Any]]], within_s: float
    ) -> tuple[dict[str, Any], bool]:
        """Claim the key in the shared table: run ``fn`` when the claim is ours, take the
        answer another router gave, or wait for the one it is giving (then claim again)."""
        shared = self._shared
        if shared is None:
            return await fn(), False
        end = self._clock() + within_s
        while True:
            left = end - self._clock()
            claim = await shared.claim(slot, max(left, 0.001) + shared.timeout_s, within_s=max(left, shared.timeout_s))
            if claim is _UNREACHABLE:
                break  # honoured here alone; settled below in case the table took the claim
            if claim["state"] == DONE:
                self.replays += 1
                return claim["result"], True
            if claim["state"] == MINE:
                break
            if left <= 0:
                raise DeadlineExceeded("waited for the first attempt of this Idempotency-Key (another router) past the deadline")
            seen = await shared.wait(slot, min(left, 5.0))
            if isinstance(seen, dict) and seen["state"] == DONE:
                self.replays += 1
                return seen["result"], True
            # freed (its attempt failed or its router died), unreachable, or still running: claim again
        try:
            result = await fn()
        except BaseException:
            self._settle_later(shared.release(slot))
            raise
        self._settle_later(shared.complete(slot, result))
        return result, False
