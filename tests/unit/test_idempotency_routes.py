"""The Idempotency-Key through the routes (a router object without Ray, FastAPI's
TestClient, a scripted model handle): a repeat is the first answer replayed, and the
same key with another body is refused 422 naming the header, on the native and the
OpenAI routes alike, without a second generation."""

from __future__ import annotations

from routerkit import at_level, build_router, routed
from test_resilient_caller import FakeHandle, FakeResponse

from ballast.model.protocol import ModelResult

CFG = {
    "tenants": {"gold": {"rate_tokens_per_s": 1000, "burst_tokens": 100_000}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}},
}
GOLD = {"authorization": "Bearer dev-key-gold", "Idempotency-Key": "order-42"}


def router_answering(*texts: str):
    handle = FakeHandle(*(FakeResponse(0, result=ModelResult(t, len(t), None)) for t in texts))
    router = build_router(CFG, handle)
    at_level(router, 0)
    return router, handle


def test_a_key_reused_with_another_body_is_422_on_the_native_route() -> None:
    router, handle = router_answering("abc")
    with routed(router) as c:
        first = c.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 8})
        again = c.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 8})
        other = c.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 1})
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["x-ballast-idempotent-replay"] == "true" and again.json()["text"] == "abc"
    assert other.status_code == 422, other.text
    assert other.json()["error"]["code"] == "INVALID_REQUEST"
    assert other.json()["error"]["field"] == "Idempotency-Key"
    assert len(handle.generate.calls) == 1


def test_a_key_reused_with_another_body_is_422_on_the_openai_route() -> None:
    router, handle = router_answering("abc")
    model = router._cfg.model.name
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with routed(router) as c:
        first = c.post("/v1/chat/completions", headers=GOLD, json=body)
        again = c.post("/v1/chat/completions", headers=GOLD, json=body)
        other = c.post("/v1/chat/completions", headers=GOLD, json={**body, "temperature": 0.5})
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["x-ballast-idempotent-replay"] == "true"
    assert other.status_code == 422, other.text
    assert other.json()["error"]["param"] == "Idempotency-Key"
    assert len(handle.generate.calls) == 1
