"""Serve's own word on the application's deployments, for ``/v1/status`` (``ballast status``).

A replica Serve cannot place yet (a placement group no node can hold now, a cluster still
scaling up) is a deployment ``UPDATING`` with replicas ``STARTING``; after
``RAY_SERVE_SLOW_STARTUP_WARNING_S`` (30 s) Serve's message says why: the resources each
replica needs and what the cluster has. Ballast's controller hears of a replica only once
it runs and reports, so this is read from Serve itself (``serve.status()``).

``serve.status()`` is a call to Serve's controller that blocks: it runs in a worker
thread, at most one at a time, and its answer is kept ``ttl_s`` (status pages are polled).
A read that fails leaves the section out, and the page answers without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ballast.router")


def read_deployments(app_name: str) -> dict[str, dict[str, Any]]:
    """Each deployment of ``app_name`` as Serve reports it: status, message, replicas by
    state. RuntimeError without Ray (``serve.status()`` would start one)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        raise RuntimeError("Ray is not running here")

    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {
        name: {
            "status": str(getattr(d.status, "value", d.status)),
            "message": d.message or "",
            "replicas": {str(getattr(s, "value", s)): n for s, n in d.replica_states.items() if n},
        }
        for name, d in app.deployments.items()
    }


class ServeStatusView:
    """The latest :func:`read_deployments`, read again once older than ``ttl_s``."""

    def __init__(
        self,
        app_name: str,
        ttl_s: float = 2.0,
        read: Callable[[str], dict[str, dict[str, Any]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._app = app_name
        self._ttl_s = ttl_s
        self._read = read or read_deployments
        self._clock = clock
        self._at: float | None = None
        self._value: dict[str, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()  # one read in flight; the others wait for its answer

    async def get(self) -> dict[str, dict[str, Any]] | None:
        """The deployments as last read (None when Serve could not be asked)."""
        async with self._lock:
            if self._at is None or self._clock() - self._at >= self._ttl_s:
                try:
                    self._value = await asyncio.to_thread(self._read, self._app)
                except Exception as e:  # the status page answers without Serve's section
                    log.debug("serve.status() failed: %r", e)
                    self._value = None
                self._at = self._clock()
            return self._value
