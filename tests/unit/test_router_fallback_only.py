"""critical_plus at a level that admits nothing: answered by a healthy fallback, nowhere else.

A real ``Router`` object (tests/unit/routerkit.py: the whole path through FastAPI,
auth, admission, quota, gate, caller) without Ray; the Serve handles are scripted.
"""

from __future__ import annotations

import pytest
from ray.exceptions import RayTaskError
from routerkit import at_level, build_router, only_lane, routed
from test_resilient_caller import FakeHandle, FakeResponse, fails

from ballast.model.protocol import ModelResult

GOLD = {"authorization": "Bearer dev-key-gold"}
CFG = {
    "tenants": {"gold": {"max_criticality": "critical_plus"}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}},
    "fallback": {},
    # Opens at 2 failures in a window of 3 calls, for 10 s.
    "resilience": {
        "breaker": {
            "window_size": 3,
            "min_calls": 3,
            "failure_rate_threshold": 0.6,
            "open_duration_s": 10,
            "open_jitter_ratio": 0,
        }
    },
}


def answer(text: str) -> FakeResponse:
    return FakeResponse(0, result=ModelResult(text, 3, None))


@pytest.fixture()
def stack():
    primary, fallback = FakeHandle(), FakeHandle()
    router = build_router(CFG, primary, fallback)
    with routed(router) as client:
        yield router, primary, fallback, client


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
    fb = next(b for b in only_lane(router).caller.backends if b.role == "fallback")
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
