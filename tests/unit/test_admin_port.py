"""The admin routes on a local-only port (ballast/router/admin_port.py, ``http.admin_port``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys

import httpx
import pytest
from fakes import FakeClock
from fastapi.testclient import TestClient
from ray.serve._private.http_util import _walk_fastapi_routes

from ballast.config import load_config
from ballast.router import app as router_app
from ballast.router.admin_port import ADMIN_ROUTES, HOST, AdminListener, admin_app, reuseport_socket

ADMIN = {"Authorization": "Bearer admin-token"}
CFG = {"auth": {"demo_keys": {"k": "gold"}, "demo_admin_token": "admin-token"}, "tenants": {"gold": {}}}
MODEL = "tiny-decoder"  # the config's one model


def _router(**http):
    from routerkit import at_level, build_router
    from test_resilient_caller import FakeHandle

    r = build_router({**CFG, "http": http}, FakeHandle())
    at_level(r, 0)
    return r


def _path(path: str) -> str:
    return path.replace("{entry_id}", "no-such-id").replace("{name}", "no-such-name")


def test_the_admin_port_serves_every_admin_route_of_the_public_app():
    public = {
        (m, route.path)
        for route, _, _ in _walk_fastapi_routes(router_app.app)
        for m in route.methods
        if route.path.startswith("/admin/") or route.path == "/v1/status"
    }
    assert {(m, p) for m, p, _, _ in ADMIN_ROUTES} == public


def test_with_an_admin_port_the_public_port_answers_404_for_the_admin_routes_and_the_listener_serves_them():
    from routerkit import routed

    router = _router(admin_port=18555)
    with routed(router) as client:
        for method, path, _, _ in ADMIN_ROUTES:
            r = client.request(method, _path(path), headers=ADMIN, json={})
            assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND", (method, path)
        assert client.get("/healthz/live").status_code == 200
    # (Only routes that do not call the controller: there is none here.)
    local = TestClient(router.admin_listener.app, raise_server_exceptions=False)
    assert local.get("/v1/status", headers=ADMIN).json()["models"][MODEL]["level"] == 0
    assert local.get("/v1/status").status_code == 401  # the token is still needed there
    assert local.get("/v1/generate").json()["error"]["code"] == "NOT_FOUND"  # admin routes only
    bad = local.post("/admin/kill-switch", headers=ADMIN, json={"scope": "global"})
    assert 400 <= bad.status_code < 500


def test_without_an_admin_port_the_public_port_serves_them_as_before():
    from routerkit import routed

    router = _router()
    assert router.admin_listener is None
    with routed(router) as client:
        assert client.get("/v1/status", headers=ADMIN).json()["models"][MODEL]["level"] == 0
    assert load_config({}).http.admin_port is None
    with pytest.raises(ValueError, match="admin_port"):
        load_config({"http": {"port": 8123, "admin_port": 8123}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def test_every_router_on_the_node_binds_the_port_on_loopback_and_answers():
    async def walk() -> None:
        app = admin_app(_router()._admin)
        port = _free_port()
        first, second = AdminListener(app, port), AdminListener(app, port)
        first.start()
        second.start()
        try:
            assert first.bound == second.bound == (HOST, port)
            for listener in (first, second):
                while not listener._server.started:  # a server starting, not a clock under test
                    await asyncio.sleep(0.01)
            async with httpx.AsyncClient() as client:
                r = await client.get(f"http://{HOST}:{port}/v1/status", headers=ADMIN)
            assert r.status_code == 200 and r.json()["models"][MODEL]["level"] == 0
        finally:
            await first.stop()
            await second.stop()

    asyncio.run(walk())


def test_a_port_taken_by_another_program_is_tried_again_no_sooner_than_retry_s():
    async def walk() -> None:
        clock = FakeClock(0)
        port = _free_port()
        taken = socket.socket()
        taken.bind((HOST, port))
        taken.listen(1)
        listener = AdminListener(admin_app(_router()._admin), port, retry_s=5, clock=clock)
        try:
            listener.start()  # t=0: refused
            assert listener.bound is None
            for _ in range(4):  # t=1..4: not tried again
                clock.advance()
                taken.close() if clock.now_s == 4 else None
                listener.start()
                assert listener.bound is None
            clock.advance()  # t=5: tried again, and binds
            listener.start()
            assert listener.bound == (HOST, port)
        finally:
            taken.close()
            await listener.stop()

    asyncio.run(walk())


def test_another_local_user_cannot_bind_the_port_beside_the_routers():
    if os.geteuid() != 0 or shutil.which("su") is None:
        pytest.skip("needs root and su to act as another user")
    sock = reuseport_socket(_free_port())
    try:
        code = (
            "import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEPORT,1)\n"
            "try:\n s.bind(('127.0.0.1',int(sys.argv[1]))); print('bound')\nexcept OSError as e:\n print(e.errno)"
        )
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        out = subprocess.run(
            ["su", "nobody", "-s", "/bin/sh", "-c", '"$0" -c "$1" "$2"', python, code, str(sock.getsockname()[1])],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode != 0:
            pytest.skip(f"cannot run Python as nobody: {out.stderr.strip()}")
        import errno

        assert out.stdout.strip() == str(errno.EADDRINUSE)
    finally:
        sock.close()
