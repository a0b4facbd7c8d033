"""A router serving several models (ballast/router/lanes.py): the request's ``model`` field
chooses the lane; each model has its own gate, breaker and level; what a key may use is
the catalog's (404 model_not_found alike for unknown and forbidden names); a tenant's
quota holds across models in each model's cost per token.

A real router object (tests/unit/routerkit.py) with one scripted Serve handle per model.
"""

from __future__ import annotations

from typing import Any

import pytest

from ballast.config import load_config
from ballast.model.protocol import ModelResult
from routerkit import at_level, build_router, routed
from test_resilient_caller import FakeHandle, FakeResponse

CFG: dict[str, Any] = {
    "models": [
        {"name": "small"},
        {"name": "large", "tenants": ["gold"], "cost_per_token": 4.0},
    ],
    "tenants": {
        "gold": {"rate_tokens_per_s": 1e-9, "burst_tokens": 10_000},  # no refill within a test
        "free": {},
    },
    "auth": {"demo_keys": {"key-gold": "gold", "key-free": "free"}},
}
GOLD = {"authorization": "Bearer key-gold"}
FREE = {"authorization": "Bearer key-free"}


def answer(text: str) -> FakeResponse:
    return FakeResponse(0, result=ModelResult(text, len(text), "stop"))


def at_levels(router: Any, levels: dict[str, int]) -> None:
    """A snapshot with each model's own level (the first model's at the top, as the
    controller publishes it)."""
    at_level(router, levels["small"], levels)


@pytest.fixture()
def handles() -> dict[str, FakeHandle]:
    return {"small": FakeHandle(), "large": FakeHandle()}


@pytest.fixture()
def router(handles):
    r = build_router(CFG, handles)
    at_levels(r, {"small": 0, "large": 0})
    return r


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def test_each_key_lists_the_models_it_may_use(router):
    with routed(router) as c:
        gold = c.get("/v1/models", headers=GOLD).json()["data"]
        free = c.get("/v1/models", headers=FREE).json()["data"]
    assert [(m["id"], m["parent"]) for m in gold] == [("small", None), ("large", None)]
    assert [m["id"] for m in free] == ["small"]


def test_the_model_field_chooses_the_deployment(router, handles):
    handles["large"].generate.script.append(answer("big"))
    handles["small"].generate.script.append(answer("tiny"))
    with routed(router) as c:
        big = c.post("/v1/chat/completions", headers=GOLD, json=chat("large"))
        tiny = c.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 4})  # no model: the first
    assert big.status_code == 200 and big.json()["model"] == "large"
    assert big.json()["choices"][0]["message"]["content"] == "big"
    assert tiny.status_code == 200 and (tiny.json()["model"], tiny.json()["text"]) == ("small", "tiny")
    assert [c.model for c in handles["large"].generate.calls] == ["large"]
    assert [c.model for c in handles["small"].generate.calls] == ["small"]


@pytest.mark.parametrize("name", ["large", "nope", "small:sql"])
def test_a_model_the_key_may_not_use_is_404_model_not_found_alike(router, handles, name):
    with routed(router) as c:
        r = c.post("/v1/chat/completions", headers=FREE, json=chat(name))
        native = c.post("/v1/generate", headers=FREE, json={"prompt": "hi", "model": name})
    for got in (r, native):
        assert got.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error"
    assert err["message"] == f"model {name!r} does not exist or this key may not use it; yours: small"
    assert not handles["large"].generate.calls and not handles["small"].generate.calls  # nothing reached a model


def test_a_flooded_models_level_sheds_its_traffic_alone(router, handles):
    at_levels(router, {"small": 0, "large": 3})
    handles["small"].generate.script.append(answer("ok"))
    with routed(router) as c:
        shed = c.post("/v1/chat/completions", headers=GOLD, json=chat("large", criticality="sheddable"))
        served = c.post("/v1/chat/completions", headers=GOLD, json=chat("small", criticality="sheddable"))
    assert shed.status_code == 503 and shed.json()["error"]["code"] == "OVERLOADED"
    assert shed.json()["error"]["message"].startswith("model 'large': degradation level 3")
    assert served.status_code == 200 and served.headers["x-ballast-level"] == "0"
    lanes = router.pipeline.lanes
    assert (lanes["large"].tally.shed, lanes["small"].tally.shed) == (1, 0)  # each model's level hears its own


def test_each_model_has_its_own_gate_and_breaker(router):
    small, large = router.pipeline.lanes["small"], router.pipeline.lanes["large"]
    assert small.gate is not large.gate and small.caller is not large.caller
    assert [b.model_name for b in large.caller.backends] == ["large"]
    status = router.pipeline.status()
    assert set(status["models"]) == {"small", "large"} and status["gate"] == status["models"]["small"]["gate"]


def test_the_quota_charges_each_models_tokens_at_its_cost(router, handles):
    bucket = router.pipeline.quotas.buckets["gold"]
    handles["small"].generate.script.append(answer("abcd"))
    handles["large"].generate.script.append(answer("abcd"))
    with routed(router) as c:
        before = bucket.tokens
        assert c.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 4}).status_code == 200
        small_used = before - bucket.tokens
        before = bucket.tokens
        r = c.post("/v1/generate", headers=GOLD, json={"prompt": "hi", "max_tokens": 4, "model": "large"})
        assert r.status_code == 200
        large_used = before - bucket.tokens
    # The same prompt and answer in the same tokens (both built-in byte models: 2 + 4), a token costing 4 on "large".
    assert small_used == pytest.approx(6, abs=1e-3) and large_used == pytest.approx(24, abs=1e-3)


def test_a_one_model_router_keeps_its_one_model_shape():
    r = build_router({"auth": {"demo_keys": {"k": "t"}}, "tenants": {"t": {}}}, FakeHandle())
    assert list(r.pipeline.lanes) == [load_config({}).model.name]
    assert r.pipeline.gate is r.pipeline.primary.gate and r.tally is r.pipeline.primary.tally


def test_a_recycle_names_any_models_deployment_and_nothing_else(handles):
    cfg = {**CFG, "auth": {**CFG["auth"], "demo_admin_token": "admin"}, "fallback": {"model": {"name": "fb"}}}
    router = build_router(cfg, handles)
    with routed(router) as c:
        bad = c.post("/admin/recycle", headers={"authorization": "Bearer admin"}, json={"deployment": "BallastModel-x"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "deployment"
    served = "BallastModel, BallastFallbackModel, BallastModel-large"
    assert bad.json()["error"]["message"] == f"deployment: not one of {served}"


def test_a_native_answer_names_what_was_asked_or_the_fallback():
    from ballast.router.generate import Asked

    assert Asked("llama", "sql").shown("llama") == "sql"  # an adapter, as the request named it
    assert Asked("llama", "llama:sql").shown("llama") == "llama:sql"
    assert Asked("llama", "sql").shown("llama-small") == "llama-small"  # the fallback answered
    assert Asked("llama", None).shown("llama") == "llama"  # no model named: the first
