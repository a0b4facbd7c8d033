"""critical_plus at a level that admits nothing: answered by a healthy fallback, nowhere else.

A real ``Router`` object (generate.py's whole path: auth, admission, quota, gate,
caller) without Ray: the Serve handles are the boundary, so they are the scripted
fakes of test_resilient_caller.py, and the controller link is replaced by a snapshot
offered to the router's own ``SnapshotCache``.
"""

from __future__ import annotations

import inspect
import time
import types
import uuid

import pytest
from fastapi.testclient import TestClient
from ray.exceptions import RayTaskError
from ray.serve._private.http_util import _walk_fastapi_routes

from serve_app.config import load_config
from serve_app.control.snapshot import Snapshot
from serve_app.router import app as router_app
from test_resilient_caller import FakeHandle, FakeResponse, fails

GOLD = {"authorization": "Bearer dev-key-gold"}
CFG = {
    "tenants": {"gold": {"max_criticality": "critical_plus"}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}},
    "fallback": {},
    # Opens at 2 failures in a window of 3 calls, for 10 s.
    "resilience": {"breaker": {"window_size": 3, "min_calls": 3, "failure_rate_threshold": 0.6,
                               "open_duration_s": 10, "open_jitter_ratio": 0}},
}


def answer(text: str) -> FakeResponse:
    return FakeResponse(0, result={"text": text, "tokens": 3})


def at_level(router, level: int) -> None:
    cfg = load_config(CFG)
    router._cache.offer(
        Snapshot(
            epoch=uuid.uuid4().hex[:12], version=1, created_at_s=time.time(), level=level, target_level=level,
            reason="test", constraints=cfg.degradation_config().constraints[level].to_dict(),
        )
    )


@pytest.fixture()
def stack():
    # Serve's ingress wraps the class; its own __init__ (app.py's) builds the state.
    wrapper = router_app.Router
    init = next(
        c.__dict__["__init__"] for c in wrapper.__mro__
        if "__init__" in c.__dict__ and c.__dict__["__init__"].__qualname__ == "Router.__init__"
    )
    primary, fallback = FakeHandle(), FakeHandle()
    router = object.__new__(wrapper)
    init(router, primary, CFG, fallback)
    router._exchange = types.SimpleNamespace(start=lambda: None)  # no controller here: the snapshot is offered below
    routes = [route for route, _, _ in _walk_fastapi_routes(router_app.app)]
    dep = inspect.signature(routes[0].endpoint).parameters["self"].default.dependency
    router_app.app.dependency_overrides[dep] = lambda: router
    try:
        yield router, primary, fallback, TestClient(router_app.app, raise_server_exceptions=False)
    finally:
        router_app.app.dependency_overrides.clear()


def generate(client, criticality: str):
    return client.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 4, "criticality": criticality})


def test_level_4_sends_critical_plus_to_the_fallback_and_refuses_the_rest(stack):
    router, primary, fallback, client = stack
    at_level(router, 4)
    fallback.generate.script.append(answer("small"))
    r = generate(client, "critical_plus")
    assert r.status_code == 200, r.text
    assert r.headers["x-ballast-fallback"] == "fallback_model"
    assert r.json()["text"] == "small" and r.json()["degradation_level"] == 4
    assert primary.generate.calls == [] and len(fallback.generate.calls) == 1
    r = generate(client, "critical")
    assert r.status_code == 503 and r.json()["error"]["code"] == "OVERLOADED"
    assert len(fallback.generate.calls) == 1  # critical is not sent anywhere


def test_level_4_with_the_fallback_unable_refuses_critical_plus_too(stack):
    router, primary, fallback, client = stack
    at_level(router, 4)
    error = RayTaskError("generate", "traceback", RuntimeError("cuda error"))
    fallback.generate.script.extend(fails(error, takes_s=0) for _ in range(3))
    for _ in range(3):  # the fallback fails three times: its breaker opens
        r = generate(client, "critical_plus")
        assert r.status_code == 503 and r.json()["error"]["code"] == "MODEL_UNAVAILABLE"
    fb = next(b for b in router._caller.backends if b.role == "fallback")
    assert fb.breaker.retry_after_s() > 0
    # Neither model can answer now: refused by the level, as any other class.
    r = generate(client, "critical_plus")
    assert r.status_code == 503 and r.json()["error"]["code"] == "OVERLOADED"
    assert primary.generate.calls == []


def test_level_0_sends_critical_plus_to_the_primary(stack):
    router, primary, fallback, client = stack
    at_level(router, 0)
    primary.generate.script.append(answer("big"))
    r = generate(client, "critical_plus")
    assert r.status_code == 200 and r.headers["x-ballast-fallback"] == "none"
    assert fallback.generate.calls == []
