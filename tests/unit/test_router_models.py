"""A router serving several models (ballast/router/lanes.py): the request's ``model`` field
chooses the lane; each model has its own gate, breaker and level; what a key may use is
the catalog's (404 model_not_found alike for unknown and forbidden names); a tenant's
quota holds across models in each model's cost per token.

A real router object (tests/unit/routerkit.py) with one scripted Serve handle per model.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fakes import FakeClock
from routerkit import at_level, build_router, routed
from test_resilient_caller import FakeHandle, FakeResponse

from ballast.config import load_config
from ballast.control.controller import ControllerCore
from ballast.control.snapshot import Snapshot
from ballast.model.protocol import ModelResult
from ballast.ops.status_text import format_status
from ballast.policies.reports import ModelLoad, RouterReport

CFG: dict[str, Any] = {
    "models": [
        {"name": "small"},
        {"name": "large", "tenants": ["gold"], "cost_per_token": 4.0},
    ],
    "tenants": {
        "gold": {"rate_tokens_per_s": 1e-9, "burst_tokens": 10_000},  # no refill within a test
        "free": {},
    },
    "auth": {"demo_keys": {"key-gold": "gold", "key-free": "free"}, "demo_admin_token": "admin"},
}
ADMIN = {"authorization": "Bearer admin"}
GOLD = {"authorization": "Bearer key-gold"}
FREE = {"authorization": "Bearer key-free"}


def answer(text: str) -> FakeResponse:
    return FakeResponse(0, result=ModelResult(text, len(text), "stop"))


def at_levels(router: Any, levels: dict[str, int]) -> None:
    """A snapshot with each model's own level."""
    at_level(router, 0, levels)


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


def test_a_model_other_than_the_first_has_its_own_level_and_constraints_everywhere(router, handles):
    """controller -> snapshot (as a dict, over the process boundary) -> the router's effective
    view -> its admission -> /v1/status -> `ballast status`: the second model flooded, each
    step names its level 3 and its own constraints, and the first model's 0."""
    clock, wall = FakeClock(0), FakeClock(time.time())
    core = ControllerCore(load_config(CFG), clock=clock, wall_clock=wall)
    for _ in range(2):
        load = {"small": ModelLoad(inflight=1), "large": ModelLoad(inflight=250, queue_wait_p95_ms=1.0)}
        core.report_router(RouterReport(router_id="r1", models=load))
        core.tick()
        clock.advance(1)
        wall.advance(1)
    wire = core.snapshot()
    assert (wire["models"]["small"]["level"], wire["models"]["large"]["level"]) == (0, 3)
    assert wire["models"]["large"]["target_level"] == 3
    assert not {"level", "reason", "constraints", "inputs"} & set(wire)
    assert router.snapshots.offer(Snapshot.from_dict(wire))
    deg = load_config(CFG).degradation_config()
    small, large = router.snapshots.effective("small"), router.snapshots.effective("large")
    assert (small.level, small.constraints, large.level, large.constraints) == (
        0,
        deg.constraints[0],
        3,
        deg.constraints[3],
    )
    handles["small"].generate.script.append(answer("ok"))
    with routed(router) as c:
        refused = c.post("/v1/chat/completions", headers=GOLD, json=chat("large", criticality="critical"))
        served = c.post("/v1/chat/completions", headers=GOLD, json=chat("small", criticality="critical"))
        doc = c.get("/v1/status", headers=ADMIN).json()
    assert refused.status_code == 503 and refused.json()["error"]["message"].startswith(
        "model 'large': degradation level 3"
    )
    assert served.status_code == 200 and served.headers["x-ballast-level"] == "0"
    assert {n: (m["level"], m["source"]) for n, m in doc["models"].items()} == {
        "small": (0, "snapshot"),
        "large": (3, "snapshot"),
    }
    assert doc["models"]["large"]["constraints"] == deg.constraints[3].to_dict()
    assert doc["snapshot"]["models"]["large"] == wire["models"]["large"]  # the controller's state, as it sent it
    assert "level" not in doc and "gate" not in doc
    text = format_status(doc)
    assert f"model large: level 3: {wire['models']['large']['reason']}" in text  # its target is 3 too
    assert f"model small: level 0: {wire['models']['small']['reason']}" in text


def test_each_model_has_its_own_gate_and_breaker(router):
    small, large = router.pipeline.lanes["small"], router.pipeline.lanes["large"]
    assert small.gate is not large.gate and small.caller is not large.caller
    assert [b.model_name for b in large.caller.backends] == ["large"]
    status = router.pipeline.status()
    assert list(status["models"]) == ["small", "large"]
    assert not {"gate", "breakers", "level", "retry_budget", "lost_capacity"} & set(status)  # nothing at the top


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


def test_a_one_model_router_has_that_one_lane_and_no_shortcut_to_it():
    r = build_router({"auth": {"demo_keys": {"k": "t"}}, "tenants": {"t": {}}}, FakeHandle())
    name = load_config({}).model.name
    assert list(r.pipeline.lanes) == [name] and r.pipeline.default_lane is r.pipeline.lanes[name]
    assert not any(hasattr(r.pipeline, part) for part in ("gate", "caller", "tally", "accounts", "primary"))
    assert not hasattr(r, "tally")


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
