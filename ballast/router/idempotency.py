"""Idempotency-Key: a repeat gets the first answer, never a second generation.

Procedure for a request with a key (``IdempotencyStore.run``), the key looked up before
the request takes anything:

1. a key held here for a *different* request (another ``fingerprint``: a hash of what
   it asks the model) is refused, 422 INVALID_REQUEST on ``Idempotency-Key``;
2. a key answered within ``ttl_s`` is answered again (a replay);
3. a key whose first attempt is running is waited for, at most until the repeat's own
   deadline (then 504 DEADLINE_EXCEEDED for the repeat; the first goes on); the first
   attempt's failure is the repeat's too, and a first whose client left lets the
   repeat run it;
4. a new key is claimed (here, then in the shared table) and only then is ``fn``
   called: ``fn`` is the first attempt whole, acquiring whatever the request needs.
   A first attempt that *fails*, or is refused before it runs, is forgotten, so the
   client's retry runs for real.

So a repeat holds nothing but its wait: no tenant place, quota, gate slot or model
capacity (the caller acquires those inside ``fn``).

Keys are scoped by tenant (two tenants may pick the same key) and bounded per tenant
(``ballast.policies.ttlmap``): a tenant past ``max_entries_per_tenant`` keys or
``max_answer_bytes_per_tenant`` bytes of answers loses its own oldest answers, never
another tenant's; ``max_entries`` bounds them all. A running first attempt is never
evicted: a new key of a tenant whose keys all run (or of a store that is all running)
is refused 429 CONCURRENCY_LIMIT rather than run without the store, which would let a
retry generate twice. An evicted answer's key simply runs again.

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
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ballast.config import IdempotencySettings
from ballast.errors import ConcurrencyLimited, DeadlineExceeded, InvalidRequest
from ballast.model.protocol import ModelCall
from ballast.policies.idempotency import DONE, FULL, MINE, RUNNING, Claim, answer_bytes
from ballast.policies.ttlmap import TTLMap


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

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        try:
            ref = getattr(self._handle(), method).remote(*args)
            return await asyncio.wait_for(ref, timeout=timeout_s or self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - any failure: this router honours the key alone
            self.unreachable += 1
            return _UNREACHABLE

    async def claim(
        self, slot: tuple[str, str], lease_s: float, fingerprint: str, within_s: float = float("inf")
    ) -> Any:
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
            answer = await self._call("claim", *slot, self.owner, lease_s, fingerprint, timeout_s=timeout_s)
            if answer is not _UNREACHABLE:
                return answer
            spent_s += timeout_s
        return _UNREACHABLE

    async def wait(self, slot: tuple[str, str], timeout_s: float) -> Any:
        return await self._call("wait", *slot, timeout_s, timeout_s=timeout_s + self.timeout_s)

    async def complete(self, slot: tuple[str, str], result: Any) -> bool:
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


def request_fingerprint(call: ModelCall, max_tokens: int) -> str:
    """The request a key stands for: a hash of the model call as the client asked it
    (its ``max_tokens`` before any level clamps it; not what the router adds: the
    admitted length, the attempt's deadline, the prompt's ids), keys in sorted order."""
    asked = asdict(replace(call, prompt_ids=(), tokenizer="", max_tokens=0, deadline=None))
    raw = json.dumps([asked, max_tokens], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


def _reused() -> InvalidRequest:
    return InvalidRequest(
        "Idempotency-Key: already used for a different request (another body) by this tenant; a key names one request",
        field="Idempotency-Key",
    )


def _full(tenant: str, where: str) -> ConcurrencyLimited:
    return ConcurrencyLimited(
        f"tenant '{tenant}': every Idempotency-Key {where} holds is still running", retry_after_s=1.0
    )


@dataclass
class _First:
    """A key's first attempt here: its answer to come, and the request it stands for."""

    answer: asyncio.Future[Any]
    fingerprint: str


def _tenant(slot: tuple[str, str]) -> str:
    return slot[0]


class IdempotencyStore:
    """This router's keys, one ``TTLMap`` grouped by tenant (see the module docstring).

    ``clock`` and ``sleep`` are injected (a repeat's bounded wait is on them). Only
    touched from the router's event loop."""

    def __init__(
        self,
        settings: IdempotencySettings,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedKeys | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self._clock = clock
        self._sleep = sleep
        self._shared = shared
        # Each key's first attempt, pending until it answers (never evicted while pending).
        self._entries: TTLMap[tuple[str, str], _First] = TTLMap(
            settings.ttl_s,
            settings.max_entries,
            max_entries_per_group=settings.max_entries_per_tenant,
            max_bytes_per_group=settings.max_answer_bytes_per_tenant,
            group=_tenant,
        )
        self.replays = 0
        # Answers and releases on their way to the shared table (each ends within
        # SETTLE_ATTEMPTS calls); held so that they are not collected mid-way.
        self._settling: set[asyncio.Task[bool]] = set()

    def _settle_later(self, call: Awaitable[bool]) -> None:
        task = asyncio.ensure_future(call)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def visited(self) -> int:
        """Entries the store's sweeps and evictions looked at, since it started."""
        return self._entries.visited

    def tenant_len(self, tenant: str) -> int:
        return self._entries.group_len(tenant)

    async def run(
        self,
        tenant: str,
        key: str,
        fn: Callable[[], Awaitable[Any]],
        within_s: float = 60.0,
        fingerprint: str = "",
    ) -> tuple[Any, bool]:
        """``fn()``'s result, or the earlier one for the same (tenant, key); True when replayed.

        ``within_s``: the request's time left: how long a repeat waits for the first
        attempt (here or at another router), and the shared claim's lease.
        ``fingerprint``: the request the key stands for (a repeat must match it)."""
        slot = (tenant, key)
        end_s = self._clock() + within_s
        while True:
            held = self._entries.lookup(slot, self._clock())
            if held is None:
                return await self._first(slot, fn, end_s, fingerprint)
            if held.value.fingerprint != fingerprint:
                raise _reused()
            try:
                result = await self._wait(held.value.answer, end_s)
            except _FirstCancelled:
                continue  # the first one's client left; this one still wants an answer
            self.replays += 1
            return result, True

    async def _wait(self, answer: asyncio.Future[Any], end_s: float) -> Any:
        """The first attempt's answer (or its failure), waited for until ``end_s`` on the
        injected clock. Waiting never cancels the first attempt: ``asyncio.wait`` leaves
        ``answer`` alone when this repeat times out or its client leaves."""
        while not answer.done():
            left_s = end_s - self._clock()
            if left_s <= 0:
                raise DeadlineExceeded(
                    "waited for the first attempt of this Idempotency-Key past the request's deadline"
                )
            timer = asyncio.ensure_future(self._sleep(left_s))
            try:
                await asyncio.wait({answer, timer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                timer.cancel()
        return answer.result()

    async def _first(
        self, slot: tuple[str, str], fn: Callable[[], Awaitable[Any]], end_s: float, fingerprint: str
    ) -> tuple[Any, bool]:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        entry = self._entries.put(slot, _First(answer, fingerprint), self._clock())
        if entry is None:
            raise _full(slot[0], "this router")
        try:
            result, replayed = await self._shared_first(slot, fn, end_s, fingerprint)
        except BaseException as exc:
            self._entries.remove(slot, entry)  # failed: a retry must run for real
            if not answer.done():
                answer.set_exception(exc if isinstance(exc, Exception) else _FirstCancelled())
                answer.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        answer.set_result(result)
        self._entries.finish(slot, entry, self._clock(), answer_bytes(result))
        return result, replayed

    async def _shared_first(
        self, slot: tuple[str, str], fn: Callable[[], Awaitable[Any]], end_s: float, fingerprint: str
    ) -> tuple[Any, bool]:
        """Claim the key in the shared table: run ``fn`` when the claim is ours, take the
        answer another router gave, or wait for the one it is giving (then claim again)."""
        shared = self._shared
        if shared is None:
            return await fn(), False
        while True:
            left = end_s - self._clock()
            claim = await shared.claim(
                slot, max(left, 0.001) + shared.timeout_s, fingerprint, within_s=max(left, shared.timeout_s)
            )
            if claim is _UNREACHABLE:
                break  # honoured here alone; settled below in case the table took the claim
            if claim.state == FULL:
                raise _full(slot[0], "the shared table")
            if claim.state in (DONE, RUNNING) and claim.fingerprint != fingerprint:
                raise _reused()
            if claim.state == DONE:
                self.replays += 1
                return claim.result, True
            if claim.state == MINE:
                break
            if left <= 0:
                raise DeadlineExceeded(
                    "waited for the first attempt of this Idempotency-Key (another router) past the deadline"
                )
            seen = await shared.wait(slot, min(left, 5.0))
            if isinstance(seen, Claim) and seen.state == DONE and seen.fingerprint == fingerprint:
                self.replays += 1
                return seen.result, True
            # freed (its attempt failed or its router died), unreachable, still running,
            # or answered for another request (the next claim says so): claim again
        try:
            result = await fn()
        except BaseException:
            self._settle_later(shared.release(slot))
            raise
        self._settle_later(shared.complete(slot, result))
        return result, False
