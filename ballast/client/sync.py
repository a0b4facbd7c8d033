"""The sync client: ``httpx.Client`` I/O around the shared core (core.py), nothing else."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator
from typing import Any

import httpx

from ballast.client.config import ClientConfig
from ballast.client.core import Call, ClientBase, StreamState
from ballast.client.protocol import GENERATE_PATH, Generation


class TokenStream(StreamState):
    """Iterates the token-batch texts of one streamed call (sync).

    Nothing is sent until the first ``next()``. After the iteration ends, ``done``
    holds the ``done`` payload as a ``Generation`` (its ``text`` the concatenated
    tokens). An ``error`` event raises its typed error from ``next()``. Use it as a
    context manager (or call ``close()``) to release the connection when stopping
    early.
    """

    def __init__(self, gen: Generator[str, None, None], call: Call) -> None:
        super().__init__(call)
        self._gen = gen

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BallastClient(ClientBase):
    """Sync client. ``transport`` replaces httpx's (tests: ``httpx.MockTransport``);
    ``clock`` (monotonic seconds), ``rand`` (u in [0, 1)) and ``sleep`` are injected
    for tests and shared by backoff, budget and throttle."""

    def __init__(
        self,
        cfg: ClientConfig,
        *,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(cfg, clock, rand)
        self._sleep = sleep
        self._http = httpx.Client(base_url=cfg.base_url, headers=self._core.headers(), transport=transport)

    def generate(
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
                resp = self._http.post(GENERATE_PATH, json=payload, headers=headers, timeout=timeout)
            except httpx.TransportError as e:
                self._sleep(call.on_transport_error(e))
                continue
            if not resp.is_success:
                self._sleep(call.on_error_answer(resp.status_code, resp.headers, resp.content))
                continue
            return call.on_success(resp.content)

    def stream(self, prompt: str, max_tokens: int = 64, criticality: str = "critical") -> TokenStream:
        call, payload = self._stream_call(prompt, max_tokens, criticality)
        return TokenStream(self._stream(call, payload), call)

    def _stream(self, call: Call, payload: dict[str, Any]) -> Generator[str, None, None]:
        while True:
            headers, timeout = call.begin_attempt()
            try:
                body = call.stream_payload(payload)  # with ``resume`` after a cut
                with self._http.stream("POST", GENERATE_PATH, json=body, headers=headers, timeout=timeout) as resp:
                    if not resp.is_success:
                        resp.read()
                        wait_s = call.on_error_answer(resp.status_code, resp.headers, resp.content)
                    else:
                        cut_wait_s = yield from self._events(call, resp)
                        if cut_wait_s is None:
                            self.last_done = call.finish_stream()
                            return
                        wait_s = cut_wait_s
            except httpx.TransportError as e:
                wait_s = call.on_transport_error(e)
            self._sleep(wait_s)

    @staticmethod
    def _events(call: Call, resp: httpx.Response) -> Generator[str, None, float | None]:
        """The stream's texts; then None once ``done`` came, else the wait before
        resuming the cut stream (``call.on_stream_cut`` raises when it is not resumed)."""
        try:
            for line in resp.iter_lines():
                text = call.on_stream_line(line)
                if text is not None:
                    yield text
                if call.done is not None:
                    return None
        except httpx.TransportError as e:  # converted: the retry loop must not see it
            return call.on_stream_cut(e)
        return call.on_stream_cut(None)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BallastClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
