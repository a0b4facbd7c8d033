"""The admin routes on a local-only port (``http.admin_port``).

With ``http.admin_port`` set, ``/v1/status`` and ``/admin/*`` are not answered on the
public port (404, as for any unknown route) but by a second HTTP server in each router
replica, bound to ``127.0.0.1:<admin_port>``: only a process on the node itself reaches
it, through none of Serve's ingress (HAProxy, the proxy) and so from no other machine.

Every router replica on a node binds the same port with ``SO_REUSEPORT``, and the
kernel spreads the connections among them (each answers as the admin routes on the
public port would: actions go through the controller; status is the answering
router's view). Linux lets a port be shared this way only by sockets of the same
effective user, so while a router holds it no other local user can bind it beside
them; a replica that cannot bind (the port taken by another program) logs it and tries
again at its next health check, ``retry_s`` apart at least.

The server is uvicorn (what Serve itself runs), on the replica's event loop, without
its signal handling: the replica's own handlers stay in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ballast.errors import BallastError, NotFound
from ballast.router.api import error_response

log = logging.getLogger("ballast.router")

HOST = "127.0.0.1"

#: (method, path, Admin method, status): the routes the admin port serves, and the ones
#: the public port refuses while it does.
ADMIN_ROUTES = (
    ("GET", "/v1/status", "status", 200),
    ("POST", "/admin/kill-switch", "set_kill_switch", 201),
    ("GET", "/admin/kill-switch", "list_kill_switches", 200),
    ("DELETE", "/admin/kill-switch/{entry_id}", "delete_kill_switch", 200),
    ("POST", "/admin/adapters", "add_adapter", 201),
    ("GET", "/admin/adapters", "list_adapters", 200),
    ("DELETE", "/admin/adapters/{name}", "delete_adapter", 200),
    ("POST", "/admin/chaos", "set_chaos", 200),
    ("DELETE", "/admin/chaos", "clear_chaos", 200),
    ("POST", "/admin/recycle", "recycle", 202),
    ("GET", "/admin/replicas", "replicas", 200),
    ("GET", "/admin/batches", "list_batches", 200),
    ("GET", "/admin/dlq", "list_dlq", 200),
    ("POST", "/admin/dlq/{dlq_id}/retry", "retry_dlq", 200),
    ("DELETE", "/admin/dlq/{dlq_id}", "delete_dlq", 200),
)


def admin_app(admin: Any) -> FastAPI:
    """A FastAPI app serving :data:`ADMIN_ROUTES` from ``admin`` (ballast/router/admin.py's
    ``Admin``), with the public app's error shapes."""
    app = FastAPI(title="Ballast admin", docs_url=None, redoc_url=None, openapi_url=None)

    async def ballast_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BallastError)
        return error_response(exc, openai=False)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return error_response(NotFound("no such route"), openai=False)
        err = BallastError(str(exc.detail))
        err.status, err.code = exc.status_code, "METHOD_NOT_ALLOWED" if exc.status_code == 405 else "HTTP_ERROR"
        return error_response(err, openai=False)

    app.add_exception_handler(BallastError, ballast_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for method, path, name, status in ADMIN_ROUTES:
        app.add_api_route(path, _endpoint(admin, name, _PATH_PARAM.findall(path)), methods=[method], status_code=status)
    return app


_PATH_PARAM = re.compile(r"\{(\w+)\}")


def _endpoint(admin: Any, name: str, params: list[str]) -> Callable[..., Any]:
    """The route's handler: ``admin.<name>(*path parameters, request)``."""

    async def endpoint(request: Request) -> Any:
        return await getattr(admin, name)(*(request.path_params[p] for p in params), request)

    return endpoint


def reuseport_socket(port: int, host: str = HOST) -> socket.socket:
    """A listening TCP socket on ``host:port`` that this user's other routers may bind too."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the replica keeps its own signal handlers
        yield


class AdminListener:
    """The admin app served on ``127.0.0.1:port`` on the running event loop, started by
    :meth:`start` (idempotent; called from the replica's health checks and requests)."""

    def __init__(
        self, app: FastAPI, port: int, retry_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.app = app
        self.port = port
        self.retry_s = retry_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._server: _Server | None = None
        self._failed_at: float | None = None
        self.bound: tuple[str, int] | None = None  # the address it listens on, once it does

    def start(self) -> None:
        if self._task is not None and not self._task.done():
            return
        now = self._clock()
        if self._failed_at is not None and now - self._failed_at < self.retry_s:
            return
        try:
            sock = reuseport_socket(self.port)
        except OSError as e:
            if self._failed_at is None:
                log.warning(
                    "admin port %s:%d: %s; the admin routes are unreachable here until it binds", HOST, self.port, e
                )
            self._failed_at = now
            return
        self._failed_at = None
        self.bound = sock.getsockname()
        self._server = _Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off"))
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._task = self._server = None
