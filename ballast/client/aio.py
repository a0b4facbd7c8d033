"""The async client: ``httpx.AsyncClient`` I/O around the shared core (core.py), nothing else."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx

from ballast.client.config import ClientConfig
from ballast.client.core import Call, ClientBase, StreamState
from ballast.client.protocol import GENERATE_PATH, Generation


class AsyncTokenStream(StreamState):
    """``TokenStream`` for the async client: ``async for``, ``aclose()``, ``async with``."""

    def __init__(self, gen: AsyncGenerator[str, None], call: Call) -> None:
        super().__init__(call)
        self._gen = gen

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncBallastClient(ClientBase):
    """Async twin of ``BallastClient``; ``sleep`` is an async callable (``asyncio.sleep``)."""

    def __init__(
        self,
        cfg: ClientConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        super().__init__(cfg, clock, rand)
        self._sleep = sleep
        self._http = httpx.AsyncClient(base_url=cfg.base_url, headers=self._core.headers(), transport=transport)

    async def generate(
        self,
        prompt: str,
        max_tokens: int = 64,
        criticality: str = "critical",
        idempotency_key: str | None = None,
    ) -> Generation:
        call, payload = self._unary_call(prompt, max_tokens, criticality, idempotency_key)
        while True:
            headers, timeout = call.begin_attempt()
            try:
                resp = await self._http.post(GENERATE_PATH, json=payload, headers=headers, timeout=timeout)
            except httpx.TransportError as e:
                await self._sleep(call.on_transport_error(e))
                continue
            if not resp.is_success:
                await self._sleep(call.on_error_answer(resp.status_code, resp.headers, resp.content))
                continue
            return call.on_success(resp.content)

    def stream(self, prompt: str, max_tokens: int = 64, criticality: str = "critical") -> AsyncTokenStream:
        call, payload = self._stream_call(prompt, max_tokens, criticality)
        return AsyncTokenStream(self._stream(call, payload), call)

    async def _stream(self, call: Call, payload: dict[str, Any]) -> AsyncGenerator[str, None]:
        while True:
            headers, timeout = call.begin_attempt()
            try:
                body = call.stream_payload(payload)  # with ``resume`` after a cut
                async with self._http.stream(
                    "POST", GENERATE_PATH, json=body, headers=headers, timeout=timeout
                ) as resp:
                    if not resp.is_success:
                        await resp.aread()
                        wait_s = call.on_error_answer(resp.status_code, resp.headers, resp.content)
                    else:
                        cut: httpx.TransportError | None = None
                        try:
                            async for line in resp.aiter_lines():
                                text = call.on_stream_line(line)
                                if text is not None:
                                    yield text
                                if call.done is not None:
                                    break
                        except httpx.TransportError as e:  # converted: the retry loop must not see it
                            cut = e
                        if call.done is not None:
                            self.last_done = call.finish_stream()
                            return
                        wait_s = call.on_stream_cut(cut)  # raises when it is not resumed
            except httpx.TransportError as e:
                wait_s = call.on_transport_error(e)
            await self._sleep(wait_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def close(self) -> None:
        await self.aclose()

    async def __aenter__(self) -> AsyncBallastClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
