"""``http``: where the app listens, and what stands in front of the router replicas."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ballast.config.base import Strict


class HttpConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # What listens on host:port. "haproxy": Serve's HAProxy mode (an HAProxy per node in
    # front of the router replicas, which serve HTTP themselves); "proxy": Serve's
    # Python HTTP proxy actor. Fixed when Ray starts (environment of Ray's processes).
    ingress: Literal["haproxy", "proxy"] = "haproxy"
    # Serve's per-request access log lines from the router and model replicas. Ballast's
    # own metrics count every request by tenant, criticality and code; the lines cost
    # CPU on every request (docs/benchmarks.md), so they are off by default.
    access_log: bool = False
    # GET /docs, the browsable page of the contract; GET /openapi.json is always served.
    docs_page: bool = True
    # Serve's replica fast path: user code and the handles' request routing run on the
    # replica's own event loop instead of threads of their own, and replica logs go to
    # their files only, not also to stderr. Fixed when Ray starts, like ``ingress``.
    fast_path: bool = True
    # HAProxy refuses the classes the degradation level sheds (by the request's
    # X-Ballast-Criticality header) before Python runs: ballast/router/edge.py. Only
    # with ingress "haproxy"; fixed when Ray starts, like ``ingress``.
    edge: bool = True
    # With ingress "haproxy": how long a stopping router replica stays reachable so that
    # HAProxy drops it before it refuses new connections (HAProxy then retries another);
    # None: Serve's default, 30 s. Every redeploy, recycle and stop of a router waits
    # this long. Fixed when Ray starts, like ``ingress``.
    router_drain_s: float | None = Field(default=None, ge=0)
    # /health and /healthz/ready answer from the router's cached readiness: the model is
    # pinged at most once per this interval, one ping in flight however many callers,
    # a failed ping cached as well (ballast/router/readiness.py).
    ready_probe_interval_s: float = Field(default=1.0, gt=0, le=60)
    # When set, /admin/* and /v1/status are served only on 127.0.0.1:<admin_port> by
    # each router replica (the public port answers 404 for them); the CLI's pid file
    # names this URL. None: the admin routes share the public port.
    admin_port: int | None = Field(default=None, ge=1, le=65535)

    @model_validator(mode="after")
    def _admin_port_apart(self) -> HttpConfig:
        if self.admin_port is not None and self.admin_port == self.port:
            raise ValueError(f"admin_port: must differ from port ({self.port})")
        return self
