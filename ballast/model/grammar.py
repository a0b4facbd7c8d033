"""Guided-decoding grammars compiled off the replica's event loop, bounded in threads and time.

A ``response_format`` JSON schema, or a forced tool call's, becomes a grammar over
the model's vocabulary before vLLM can decode with it, and that compile's cost grows
with the schema's shape (nested ``anyOf`` multiplies it) with no bound of its own.
:class:`GrammarCompiles` runs one compile per schema:

- on a fixed pool of ``threads`` threads, never on the event loop, so every other
  request of the replica (structured or not) goes on being served meanwhile;
- at most ``threads`` compiles are in the pool at once: a request waits for a free
  thread on the event loop (an awaited semaphore, no thread), and that wait is bounded
  by the request's own deadline (the replica's ``wait_for``) and by the replica's
  ongoing requests (Serve's ``max_ongoing_requests``);
- a compile that has not finished ``timeout_s`` after it started is
  ``SchemaTooComplex`` (400, naming the request's field), for that request alone. A
  thread cannot be interrupted: the compile runs on to its end and holds its thread
  until then (the semaphore is released when it ends, not when its caller gives up),
  so however many slow schemas arrive, at most ``threads`` threads compile;
- the verdict on each schema (compiled, too slow, refused) is remembered by its
  digest, ``remembered`` of them, least recently used first out: a schema repeated
  costs no second compile, and a slow one sent again is refused at once.

Written here: the bound on threads that outlives its callers, and a per-schema
verdict, are what ``asyncio.to_thread`` and ``ThreadPoolExecutor`` do not give.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from ballast.errors import EngineRefused, SchemaTooComplex

__all__ = ["GrammarCompiles"]

_OK = ""  # the verdict of a schema that compiled


class GrammarCompiles:
    """Compile each schema once, off the event loop, within ``timeout_s`` (see the module).

    ``compile(schema)`` raises ``ValueError`` for a schema the engine refuses (its
    message is the reason) and returns when the grammar is built. One event loop uses
    an instance (the replica's)."""

    def __init__(
        self, compile: Callable[[str], None], *, threads: int, timeout_s: float, remembered: int = 1024
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if isinstance(remembered, bool) or not isinstance(remembered, int) or remembered < 1:
            raise ValueError(f"remembered must be an int >= 1, got {remembered!r}")
        self._compile = compile
        self.threads = threads
        self.timeout_s = float(timeout_s)
        self._remembered = remembered
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._slots: Optional[asyncio.Semaphore] = None  # made on the loop that uses it
        self._slots_loop: Optional[asyncio.AbstractEventLoop] = None
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # digest -> _OK, "slow" or the refusal
        self.compiles = 0  # compiles started
        self.running = 0  # compiles in the pool now (<= threads)

    async def check(self, schema: str, field: str) -> None:
        """Return once ``schema`` has compiled; ``SchemaTooComplex`` when it did not within
        ``timeout_s``, ``EngineRefused`` when the engine refuses it (both name ``field``)."""
        digest = hashlib.sha256(schema.encode("utf-8", "surrogatepass")).digest()
        verdict = self._verdict(digest)
        if verdict is None:
            verdict = await self._run(digest, schema)
        if verdict == "slow":
            raise SchemaTooComplex(
                f"{field}: its grammar did not compile within {self.timeout_s:g} s; send a simpler schema", field=field
            )
        if verdict != _OK:
            raise EngineRefused(f"{field}: vLLM refuses the JSON schema: {verdict}", field=field)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _verdict(self, digest: bytes) -> Optional[str]:
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

    async def _run(self, digest: bytes, schema: str) -> str:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # the replica has one loop; a test has one each
            self._slots, self._slots_loop = asyncio.Semaphore(self.threads), loop
        slots = self._slots
        await slots.acquire()  # cancelled here (the caller's deadline): nothing was taken
        verdict = self._verdict(digest)  # decided while this one waited
        if verdict is not None:
            slots.release()
            return verdict
        self.compiles += 1
        self.running += 1
        started = loop.create_future()

        def work() -> str:
            loop.call_soon_threadsafe(_set, started)
            try:
                self._compile(schema)
                return _OK
            except ValueError as e:
                return str(e) or type(e).__name__

        def ended(_: object) -> None:  # the compile's end frees its thread, whoever still waits
            def free() -> None:
                self.running -= 1
                slots.release()

            loop.call_soon_threadsafe(free)

        job = self._pool.submit(work)
        job.add_done_callback(ended)
        done = asyncio.wrap_future(job)
        await started  # at once: the pool has a free thread for every slot
        try:
            return self._remember(digest, await asyncio.wait_for(asyncio.shield(done), self.timeout_s))
        except asyncio.TimeoutError:
            return self._remember(digest, "slow")


def _set(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)
