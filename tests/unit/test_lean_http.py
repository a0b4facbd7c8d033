"""The load generator's HTTP client against a real local HTTP/1.1 server (asyncio, loopback)."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadtest.bench_overload import _judge
from loadtest.lean_http import LeanClient, LeanHttpError, LeanResponse


async def until(pred, what: str, turns: int = 10_000) -> None:
    """Let the loop run (loopback I/O included) until ``pred()``; bounded, so a miss fails clearly."""
    for _ in range(turns):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


class Server:
    """A loopback HTTP/1.1 server whose answer depends on the request path; counts connections."""

    def __init__(self) -> None:
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.port = 0
        # /slow answers only once the test sets this: "slow" is as long as the test says,
        # with no real wait.
        self.release_slow = asyncio.Event()
        # /stream sends its second chunk only once the test sets this.
        self.release_stream = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                path = head[0].split(" ")[1]
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append((path, headers, body))
                if path == "/slow":
                    await self.release_slow.wait()
                if path == "/chunked":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                        b'5\r\n{"tex\r\n9;ext=1\r\nt": "hi"}\r\n0\r\n\r\n'
                    )
                elif path == "/stream":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata:1\r\n")
                    await writer.drain()
                    await self.release_stream.wait()
                    writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
                elif path == "/close":
                    writer.write(
                        b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
                    )
                    await writer.drain()
                    break
                elif path == "/drop-after":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
                    break  # closes without saying so: the next request on it finds it closed
                elif path == "/garbage":
                    writer.write(b"SPDY/9 what\r\n\r\n")
                else:
                    answer = json.dumps({"echo": json.loads(body or b"null")}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                        + str(len(answer)).encode()
                        + b"\r\n\r\n"
                        + answer
                    )
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_now -= 1
            writer.close()


async def test_posts_json_and_reuses_one_keep_alive_connection():
    async with Server() as srv, LeanClient("127.0.0.1", srv.port) as c:
        for i in range(5):
            r = await c.post_json("/echo", {"i": i}, {"Authorization": "Bearer k"})
            assert r.status == 200 and r.json() == {"echo": {"i": i}}
        assert srv.connections == 1
        path, headers, body = srv.requests[0]
        assert path == "/echo" and headers["authorization"] == "Bearer k"
        assert headers["content-type"] == "application/json" and json.loads(body) == {"i": 0}


async def test_decodes_a_chunked_answer_with_extensions():
    async with Server() as srv, LeanClient("127.0.0.1", srv.port) as c:
        r = await c.post_json("/chunked", {})
        assert r.status == 200 and r.json() == {"text": "hi"}
        assert (await c.post_json("/echo", 1)).json() == {"echo": 1}
        assert srv.connections == 1  # the chunked answer was read to its end, so the connection was reusable


async def test_each_chunk_is_handed_over_as_it_arrives_before_the_answer_ends():
    async with Server() as srv, LeanClient("127.0.0.1", srv.port) as c:
        seen: list[bytes] = []
        post = asyncio.ensure_future(c.post_json("/stream", {}, on_chunk=seen.append))
        await until(lambda: seen == [b"data:1"], "the first chunk, while the answer is still open")
        assert not post.done()
        srv.release_stream.set()
        r = await post
        assert seen == [b"data:1", b"data:2"] and r.status == 200 and r.body == b"data:1data:2"
        sized: list[bytes] = []
        assert (await c.post_json("/echo", 5, on_chunk=sized.append)).json() == {"echo": 5}
        assert sized == [b'{"echo": 5}']  # a sized body: one piece


async def test_connection_close_is_honoured_and_the_next_request_opens_a_new_one():
    async with Server() as srv, LeanClient("127.0.0.1", srv.port) as c:
        r = await c.post_json("/close", {})
        assert r.status == 503 and r.headers["connection"] == "close"
        assert (await c.post_json("/echo", 2)).status == 200
        assert srv.connections == 2


async def test_an_idle_connection_the_server_dropped_is_replaced_once():
    async with Server() as srv, LeanClient("127.0.0.1", srv.port) as c:
        assert (await c.post_json("/drop-after", {})).status == 200
        await until(lambda: srv.open_now == 0, "the server closed the connection")
        assert (await c.post_json("/echo", 3)).json() == {"echo": 3}
        assert srv.connections == 2


async def test_connections_are_bounded():
    async with Server() as srv, LeanClient("127.0.0.1", srv.port, max_connections=2) as c:
        posts = asyncio.gather(*(c.post_json("/slow", i) for i in range(6)))
        await until(lambda: len(srv.requests) == 2, "two slow requests at the server")
        for _ in range(100):  # the other four wait for a connection, however long the slow ones take
            await asyncio.sleep(0)
        assert len(srv.requests) == 2 and srv.open_now == 2
        srv.release_slow.set()
        answers = await posts
        assert [r.status for r in answers] == [200] * 6
        assert srv.most_open <= 2 and srv.connections == 2


async def test_timeouts_refusals_and_garbage_are_clear_errors():
    async with Server() as srv:
        async with LeanClient("127.0.0.1", srv.port, timeout_s=0.05) as c:
            with pytest.raises(LeanHttpError) as e:
                await c.post_json("/slow", {})
            assert e.value.kind == "timeout"
            srv.release_slow.set()  # the slow answer lands on a connection the client closed
            await until(lambda: srv.open_now == 0, "the server done with the timed-out connection")
        async with LeanClient("127.0.0.1", srv.port) as c:
            with pytest.raises(LeanHttpError) as e:
                await c.post_json("/garbage", {})
            assert e.value.kind == "malformed"
            assert (await c.post_json("/echo", 4)).status == 200  # the bad connection was not pooled
        port = srv.port
    with pytest.raises(ValueError):
        LeanClient("127.0.0.1", port, max_connections=0)


async def test_a_refused_connection_is_a_connect_error():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with LeanClient("127.0.0.1", port) as c:
        with pytest.raises(LeanHttpError) as e:
            await c.post_json("/", {})
        assert e.value.kind == "connect"


def test_the_bench_counts_a_200_only_with_text_and_errors_by_code():
    ok = LeanResponse(200, {}, b'{"text": "abc", "tokens_generated": 3}')
    assert _judge(ok) == (200, "OK")
    assert _judge(LeanResponse(200, {}, b"")) == (0, "malformed_200")
    assert _judge(LeanResponse(200, {}, b'{"tokens_generated": 3}')) == (0, "malformed_200")
    assert _judge(LeanResponse(503, {}, b'{"error": {"code": "OVERLOADED", "message": "x"}}')) == (503, "OVERLOADED")
    assert _judge(LeanResponse(502, {}, b"<html>bad gateway</html>")) == (502, "HTTP_502")
