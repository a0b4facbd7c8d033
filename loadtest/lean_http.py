"""A lean HTTP/1.1 client for open-loop load generation on the machine under test.

The overload benchmark offers up to 4 C from the same two cores the server runs on.
A general client (httpx) spends a few milliseconds of Python per request, so at
4 C the generator falls behind its own schedule and the benchmark measures the
client, not the server. This client does only what a load generator needs: JSON
POSTs over a bounded pool of keep-alive connections to one loopback host, with
Content-Length or chunked answers, on uvloop when it is installed (Ray Serve
brings it). It is several times cheaper per request than httpx (see
``python -m loadtest.lean_http --compare``); it is not a general HTTP client
(no TLS, no redirects, no proxies, no compression).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class LeanHttpError(Exception):
    """No HTTP answer: connection refused or closed, malformed answer, or timeout."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True)
class LeanResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class LeanClient:
    """JSON POSTs to ``host:port`` over at most ``max_connections`` keep-alive connections."""

    def __init__(self, host: str, port: int, max_connections: int = 1000, timeout_s: float = 10.0) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: set[asyncio.StreamWriter] = set()

    async def post_json(
        self,
        path: str,
        body: Any,
        headers: dict[str, str] | None = None,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> LeanResponse:
        """POST ``body`` as JSON; the whole answer. ``on_chunk`` is handed each piece of the
        answer's body as it arrives (each chunk of a chunked answer; a sized body in one
        piece), before the answer is complete: a stream's events can be timed by it."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
        ]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            try:
                async with asyncio.timeout(self.timeout_s):
                    if conn is None:
                        conn = await self._connect()
                    try:
                        response, keep = await self._exchange(conn, request, on_chunk)
                    except (LeanHttpError, ConnectionError) as e:
                        # A pooled connection the server closed while idle: once more on a new one.
                        if not (reused and (isinstance(e, ConnectionError) or e.kind == "closed")):
                            raise
                        self._close(conn)
                        conn = await self._connect()
                        response, keep = await self._exchange(conn, request, on_chunk)
            except TimeoutError:
                if conn is not None:
                    self._close(conn)
                raise LeanHttpError("timeout", f"no answer within {self.timeout_s:g} s") from None
            except LeanHttpError:
                if conn is not None:
                    self._close(conn)
                raise
            except OSError as e:
                if conn is not None:
                    self._close(conn)
                raise LeanHttpError("connect", str(e)) from None
            if keep:
                self._idle.append(conn)
            else:
                self._close(conn)
            return response

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._open.add(writer)
        return reader, writer

    async def _exchange(
        self,
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        request: bytes,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> tuple[LeanResponse, bool]:
        reader, writer = conn
        writer.write(request)
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            raise LeanHttpError("closed", "connection closed before an answer") from None
        except asyncio.LimitOverrunError:
            raise LeanHttpError("malformed", "header block too long") from None
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise LeanHttpError("malformed", f"status line {lines[0]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = await self._chunked(reader, on_chunk)
            else:
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                else:  # HTTP/1.1 without a length: the body runs to the close
                    body = await reader.read()
                    headers["connection"] = "close"
                if on_chunk is not None and body:
                    on_chunk(body)
        except (asyncio.IncompleteReadError, ValueError) as e:
            raise LeanHttpError("malformed", f"body: {e}") from None
        keep = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        return LeanResponse(int(parts[1]), headers, body), keep

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader, on_chunk: Callable[[bytes], None] | None = None) -> bytes:
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                    pass
                return bytes(out)
            chunk = (await reader.readexactly(size + 2))[:-2]
            out += chunk
            if on_chunk is not None:
                on_chunk(chunk)

    def _close(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        writer = conn[1]
        self._open.discard(writer)
        writer.close()

    async def aclose(self) -> None:
        self._idle.clear()
        for writer in list(self._open):
            writer.close()
        self._open.clear()

    async def __aenter__(self) -> LeanClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def install_uvloop() -> bool:
    """Use uvloop's event loop for ``asyncio.run`` when it is installed; says whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# --- side-by-side cost: python -m loadtest.lean_http --compare ------------------------

_FIXED_SERVER = r"""
import asyncio, sys
BODY = b'{"error":{"code":"OVERLOADED","message":"refused by the comparison server"}}'
ANSWER = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: "
          + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":", 1)[1])
            await reader.readexactly(n)
            writer.write(ANSWER)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await asyncio.sleep(float(sys.argv[2]))
asyncio.run(main())
"""


def compare(requests: int = 3000, concurrency: int = 32, port: int = 8129) -> dict[str, float]:
    """Client CPU per request, httpx against this client, on the same fixed-answer server.

    The server runs in its own process; only this process's CPU time is counted, so
    the figures are what each client costs the machine per request.
    """
    import subprocess
    import sys
    import time

    import httpx

    server = subprocess.Popen(
        [sys.executable, "-c", _FIXED_SERVER, str(port), "120"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        body = {"prompt": "The quick brown fox", "max_tokens": 32, "criticality": "sheddable"}
        headers = {"Authorization": "Bearer x", "X-Request-Timeout-Ms": "1000"}

        async def with_httpx() -> int:
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=10) as c:

                async def worker(k: int) -> int:
                    return sum(
                        [
                            (await c.post("/v1/generate", json=body, headers=headers)).status_code == 429
                            for _ in range(k)
                        ]
                    )

                return sum(await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency))))

        async def with_lean() -> int:
            async with LeanClient("127.0.0.1", port, max_connections=concurrency) as c:

                async def worker(k: int) -> int:
                    return sum([(await c.post_json("/v1/generate", body, headers)).status == 429 for _ in range(k)])

                return sum(await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency))))

        out: dict[str, float] = {}
        for name, fn in (("httpx", with_httpx), ("lean", with_lean), ("lean+uvloop", with_lean)):
            if name == "lean+uvloop" and not install_uvloop():
                continue
            cpu0 = time.process_time()
            n = asyncio.run(fn())
            out[name] = (time.process_time() - cpu0) / n * 1000.0
            print(f"{name:<12} {n} answers, client CPU {out[name]:.3f} ms per request", flush=True)
        for name in out:
            if name != "httpx":
                print(f"httpx / {name}: {out['httpx'] / out[name]:.1f}x", flush=True)
        return out
    finally:
        asyncio.set_event_loop_policy(None)
        server.kill()
        server.wait()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="client CPU per request: httpx vs the lean client")
    p.add_argument("--compare", action="store_true", required=True)
    p.add_argument("--requests", type=int, default=3000)
    compare(p.parse_args().requests)
