"""Guided-decoding grammars compiled off the replica's event loop, bounded in threads and time,
and shared among tenants.

A ``response_format`` JSON schema, or a forced tool call's, becomes a grammar over
the model's vocabulary before vLLM can decode with it, and that compile's cost grows
with the schema's shape (nested ``anyOf`` multiplies it, and so do a pattern's nested
counts) with no bound of its own: the router bounds a schema's size
(``ballast.policies.schema``), not its compile time. :class:`GrammarCompiles` runs one
compile per schema:

- on a fixed pool of ``threads`` threads, never on the event loop, so every other
  request of the replica (structured or not) goes on being served meanwhile;
- at most ``threads`` compiles are in the pool at once, and at most ``per_tenant`` of
  them are one tenant's (half the threads by default, at least one): a request waits for
  a thread it may take on the event loop (a future, no thread), in arrival order among
  the requests that may take one, and that wait is bounded by the request's own deadline
  (the replica's ``wait_for``) and by the replica's ongoing requests (Serve's
  ``max_ongoing_requests``);
- a compile that has not finished ``timeout_s`` after it started is
  ``SchemaTooComplex`` (400, naming the request's field), for that request alone. A
  thread cannot be interrupted: the compile runs on to its end and holds its thread,
  counted to its tenant, until then (its caller giving up frees nothing), so however
  many slow schemas arrive, at most ``threads`` threads compile, and one tenant's slow
  schemas hold at most its share: the other tenants' compiles keep the rest. A tenant
  never borrows past its share, even from idle threads: a thread lent to a compile that
  turns out slow could not be taken back;
- the verdict on each schema (compiled, too slow, refused) is remembered by its
  digest, ``remembered`` of them, least recently used first out: a schema repeated
  costs no second compile, and a slow one sent again is refused at once.

With one thread there is no share to keep: a slow compile makes every tenant's
structured requests wait for its end (``model.grammar_compile_threads`` 2 or more keeps
tenants apart).

Written here: the bound on threads that outlives its callers, per tenant, and a
per-schema verdict, are what ``asyncio.to_thread`` and ``ThreadPoolExecutor`` do not give.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ballast.errors import EngineRefused, SchemaTooComplex

__all__ = ["GrammarCompiles"]

_OK = ""  # the verdict of a schema that compiled


class GrammarCompiles:
    """Compile each schema once, off the event loop, within ``timeout_s``, on at most
    ``per_tenant`` of the ``threads`` for one tenant (see the module).

    ``compile(schema)`` raises ``ValueError`` for a schema the engine refuses (its
    message is the reason) and returns when the grammar is built. One event loop uses
    an instance at a time (the replica's; a test's loop replaces the last one)."""

    def __init__(
        self,
        compile: Callable[[str], None],
        *,
        threads: int,
        timeout_s: float,
        remembered: int = 1024,
        per_tenant: int | None = None,
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if isinstance(remembered, bool) or not isinstance(remembered, int) or remembered < 1:
            raise ValueError(f"remembered must be an int >= 1, got {remembered!r}")
        share = max(1, threads // 2) if per_tenant is None else per_tenant
        if isinstance(share, bool) or not isinstance(share, int) or not 1 <= share <= threads:
            raise ValueError(f"per_tenant must be an int in [1, threads], got {per_tenant!r}")
        self._compile = compile
        self.threads = threads
        self.per_tenant = share
        self.timeout_s = float(timeout_s)
        self._remembered = remembered
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # digest -> _OK, "slow" or the refusal
        self.compiles = 0  # compiles started
        # Guards running and _held: a thread is taken on the event loop and given back by
        # its compile's end, in the pool thread, whether or not an event loop still runs.
        self._lock = threading.Lock()
        self.running = 0  # compiles in the pool now (<= threads)
        self._held: dict[str, int] = {}  # tenant -> its compiles in the pool (<= per_tenant); no zero entry
        # Callers waiting for a thread, in arrival order (each a request the replica holds),
        # on the loop that last used the instance; touched on that loop only.
        self._waiting: deque[tuple[str, asyncio.Future[None]]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def check(self, schema: str, field: str, tenant: str = "") -> None:
        """Return once ``schema`` has compiled; ``SchemaTooComplex`` when it did not within
        ``timeout_s``, ``EngineRefused`` when the engine refuses it (both name ``field``).
        Its compile counts to ``tenant``'s share of the threads."""
        digest = hashlib.sha256(schema.encode("utf-8", "surrogatepass")).digest()
        verdict = self._verdict(digest)
        if verdict is None:
            verdict = await self._run(digest, schema, tenant)
        if verdict == "slow":
            raise SchemaTooComplex(
                f"{field}: its grammar did not compile within {self.timeout_s:g} s; send a simpler schema", field=field
            )
        if verdict != _OK:
            raise EngineRefused(f"{field}: vLLM refuses the JSON schema: {verdict}", field=field)

    def held(self, tenant: str) -> int:
        """How many of the threads ``tenant``'s compiles hold now."""
        with self._lock:
            return self._held.get(tenant, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _verdict(self, digest: bytes) -> str | None:
        verdict = self._verdicts.get(digest)
        if verdict is not None:
            self._verdicts.move_to_end(digest)
        return verdict

    def _remember(self, digest: bytes, verdict: str) -> str:
        self._verdicts[digest] = verdict
        self._verdicts.move_to_end(digest)
        while len(self._verdicts) > self._remembered:
            self._verdicts.popitem(last=False)
        return verdict

    async def _run(self, digest: bytes, schema: str, tenant: str) -> str:
        loop = asyncio.get_running_loop()
        await self._take(tenant, loop)  # cancelled there (the caller's deadline): nothing was taken
        verdict = self._verdict(digest)  # decided while this one waited
        if verdict is not None:
            self._give_back(tenant)
            return verdict
        self.compiles += 1
        started = loop.create_future()

        def work() -> str:
            loop.call_soon_threadsafe(_set, started)
            try:
                self._compile(schema)
                return _OK
            except ValueError as e:
                return str(e) or type(e).__name__

        job = self._pool.submit(work)
        job.add_done_callback(lambda _: self._give_back(tenant))  # the compile's end, whoever still waits
        done = asyncio.wrap_future(job)
        await started  # at once: the pool has a free thread for every one taken
        try:
            return self._remember(digest, await asyncio.wait_for(asyncio.shield(done), self.timeout_s))
        except asyncio.TimeoutError:
            return self._remember(digest, "slow")

    # -- the threads' accounting ----------------------------------------------------------
    async def _take(self, tenant: str, loop: asyncio.AbstractEventLoop) -> None:
        """Take a thread for ``tenant``: at once when one is free, the tenant is within its
        share and no earlier caller may take it, else when ``_wake`` hands it one. A caller
        cancelled while it waits takes nothing (one handed a thread as it was cancelled
        gives it back)."""
        if loop is not self._loop:  # a new loop: the last one's waiters went with it
            self._loop, self._waiting = loop, deque()
        with self._lock:
            ahead = any(not f.done() and self._may_take(t) for t, f in self._waiting)  # woken soon: first
            if not ahead and self._may_take(tenant):
                self._hold(tenant)
                return
        entry = (tenant, loop.create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self._give_back(tenant)
            elif entry in self._waiting:
                self._waiting.remove(entry)
            raise

    def _may_take(self, tenant: str) -> bool:
        return self.running < self.threads and self._held.get(tenant, 0) < self.per_tenant

    def _hold(self, tenant: str) -> None:
        self.running += 1
        self._held[tenant] = self._held.get(tenant, 0) + 1

    def _give_back(self, tenant: str) -> None:
        """A thread of ``tenant``'s is free (its compile ended, or it was not needed): counted
        here, on any thread; the waiters are woken on the loop that holds them."""
        with self._lock:
            self.running -= 1
            left = self._held[tenant] - 1
            if left:
                self._held[tenant] = left
            else:
                del self._held[tenant]
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # that loop is closed: its waiters are gone with it
            pass

    def _wake(self) -> None:
        """Hand the free threads to the waiting callers in arrival order, passing over those
        whose tenant holds its share (they keep their place)."""
        for entry in list(self._waiting):
            tenant, fut = entry
            with self._lock:
                if self.running >= self.threads:
                    return
                if fut.done() or self._held.get(tenant, 0) >= self.per_tenant:
                    continue
                self._hold(tenant)
            self._waiting.remove(entry)
            fut.set_result(None)


def _set(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
