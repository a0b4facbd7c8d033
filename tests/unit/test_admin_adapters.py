"""``/admin/adapters`` on a real Router object without Ray (routerkit): the checks in their
order, each refusal naming its field and recording nothing; the trial load before the
controller's record; the router's catalog following the snapshot.

Stand-ins, for what cannot run here: the controller actor (``CoreLink``: each call goes to
a real ``ControllerCore`` in process, as the actor hands it on) and the model deployment's
handle (``StandInReplica``: it answers the trial load as told; the real replica's side,
against a real vLLM engine, is in test_vllm_lora.py). The snapshot exchange is the real
``SnapshotExchange`` over that link, so the router applies what the controller publishes.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest
from ray.exceptions import RayTaskError

from fakes import FakeClock
from routerkit import build_router, routed
from test_resilient_caller import FakeHandle

from ballast.control.controller import ControllerCore
from ballast.control.snapshot import SnapshotExchange
from ballast.errors import AdapterRefused
from ballast.policies.reports import RouterReport
from tests.unit.hf_fixture import make_tiny_llama

ADMIN = {"Authorization": "Bearer admin-token", "X-Ballast-Operator": "alice"}
TENANTS = {"gold": {}, "free": {}, "other": {}}


class CoreLink:
    """Stand-in for the controller actor's link: a real ``ControllerCore`` in process."""

    def __init__(self, cfg: Any) -> None:
        self.core = ControllerCore(cfg, clock=FakeClock(0), wall_clock=FakeClock(1_000_000))
        self.calls: list[str] = []

    async def call(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        return getattr(self.core, method)(*args)

    async def report(self, report: RouterReport) -> dict[str, Any]:
        return self.core.report_router(report)


class StandInReplica:
    """Stand-in for the model deployment's handle: ``add_adapter.remote`` answers as told
    (``refuse``: the replica's AdapterRefused, as Ray re-raises it; ``down``: no replica)."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []
        self.refuse: BaseException | None = None
        self.add_adapter = types.SimpleNamespace(remote=self._add)

    async def _add(self, name: str, path: str) -> dict[str, Any]:
        self.loads.append((name, path))
        if self.refuse is not None:
            raise self.refuse
        return {"name": name, "path": path}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def stack(ckpt):
    llama = {
        "name": "llama",
        "backend": "vllm",
        "path": str(ckpt),
        "adapters": {"sql": "/adapters/sql"},
        "tenants": ["gold", "free"],
    }
    cfg = {"auth": {"demo_admin_token": "admin-token"}, "tenants": TENANTS, "models": [llama]}
    replica = StandInReplica()
    router = build_router(cfg, FakeHandle())
    link = CoreLink(router._cfg)
    admin = router._admin
    admin._link = link
    admin._handle_for = lambda model: replica
    admin._exchange = SnapshotExchange(
        router.snapshots,
        link.report,
        lambda: RouterReport(router_id=router.router_id),
        interval_s=1,
        timeout_s=5,
        on_snapshot=router.reporter.on_snapshot,
    )
    with routed(router) as client:
        yield types.SimpleNamespace(router=router, client=client, core=link.core, link=link, replica=replica)


def add(s, **body: Any):
    return s.client.post("/admin/adapters", headers=ADMIN, json={"model": "llama", "path": "/adapters/x", **body})


def nothing_recorded(s) -> None:
    assert s.core.adapters() == []
    assert "set_adapter" not in s.link.calls


def test_an_adapter_is_loaded_on_one_replica_recorded_and_routed_to(stack) -> None:
    s = stack
    r = add(s, name="late", path="/adapters/late", tenants=["gold"])
    assert r.status_code == 201, r.text
    assert r.json() == {
        "model": "llama",
        "name": "late",
        "path": "/adapters/late",
        "tenants": ["gold"],
        "added_at_s": 1_000_000.0,
        "added_by": "alice",
    }
    assert s.replica.loads == [("late", "/adapters/late")]  # the trial load came first
    assert s.link.calls == ["set_adapter"]
    catalog = s.router.pipeline.catalog  # this router applied the snapshot at once
    assert catalog.may_use("gold", "llama:late") and not catalog.may_use("free", "late")
    assert s.router.pipeline.base_catalog.resolve("late") is None  # the config's, unchanged
    listed = s.client.get("/admin/adapters", headers=ADMIN)
    assert listed.status_code == 200 and listed.json() == {"adapters": [r.json()]}
    assert s.core.kill_switches()["audit"][-1]["action"] == "adapter_added"


@pytest.mark.parametrize(
    "body,field",
    [
        ({"model": "mistral", "name": "late"}, "model"),  # no such model
        ({"name": "sql"}, "name"),  # the config's adapter
        ({"name": "llama"}, "name"),  # the model's own name
        ({"name": "llama:late"}, "name"),
        ({"name": "a b"}, "name"),
        ({"name": "late", "tenants": ["nobody"]}, "tenants"),  # not declared
        ({"name": "late", "tenants": ["other"]}, "tenants"),  # outside the model's grant
        ({"model": "mistral", "name": "sql", "tenants": ["nobody"]}, "model"),  # the model first
        ({"name": "sql", "tenants": ["nobody"]}, "name"),  # then the name
    ],
)
def test_the_catalogs_refusals_name_the_field_before_any_load(stack, body, field) -> None:
    r = add(stack, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "ADAPTER_REFUSED" and err["field"] == field and f"{field}: " in err["message"]
    assert stack.replica.loads == []
    nothing_recorded(stack)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"name": "late", "extra": 1}, "extra"),
        ({"name": ""}, "name"),
        ({"name": "n" * 65}, "name"),
        ({"name": "late", "path": ""}, "path"),
        ({"name": "late", "tenants": "gold"}, "tenants"),
        ({"name": "late", "tenants": ["g" * 65]}, "tenants.0"),
        ({"name": 5}, "name"),
    ],
)
def test_a_body_of_the_wrong_shape_is_refused_first(stack, body, field) -> None:
    r = add(stack, model="mistral", **body)  # the model would be refused too: the shape comes first
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    assert stack.replica.loads == []
    nothing_recorded(stack)


def test_a_name_added_at_run_time_is_taken_for_the_next_add(stack) -> None:
    assert add(stack, name="late").status_code == 201
    r = add(stack, name="late", path="/adapters/other")
    assert r.status_code == 400 and r.json()["error"]["field"] == "name"
    assert stack.replica.loads == [("late", "/adapters/x")]  # no second trial load


@pytest.mark.parametrize("wrapped", [False, True], ids=["as_raised", "through_ray"])
def test_the_replicas_refusal_is_the_answer_and_nothing_is_recorded(stack, wrapped) -> None:
    refusal = AdapterRefused("late", "/adapters/x", "vLLM refuses it: LoRA rank 32 is greater than max_lora_rank 16")
    stack.replica.refuse = RayTaskError("add_adapter", "traceback", refusal) if wrapped else refusal
    r = add(stack, name="late")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "ADAPTER_REFUSED" and "greater than max_lora_rank 16" in err["message"]
    assert stack.replica.loads == [("late", "/adapters/x")]
    nothing_recorded(stack)
    assert stack.router.pipeline.catalog.resolve("late") is None


def test_no_replica_to_try_it_is_a_503_and_nothing_is_recorded(stack) -> None:
    stack.replica.refuse = RuntimeError("no replica")
    r = add(stack, name="late")
    assert r.status_code == 503 and r.json()["error"]["code"] == "MODEL_UNAVAILABLE"
    assert "retry-after" in r.headers
    nothing_recorded(stack)


def test_delete_a_run_time_adapter_a_configs_adapter_and_none(stack) -> None:
    s = stack
    assert add(s, name="late").status_code == 201
    r = s.client.delete("/admin/adapters/sql", headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["code"] == "ADAPTER_IN_CONFIG"
    assert "remove it from the config" in r.json()["error"]["message"]
    for name in ("nope", "n" * 200):
        r = s.client.delete(f"/admin/adapters/{name}", headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    assert s.core.adapters() != []  # none of those touched it
    r = s.client.delete("/admin/adapters/late", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"deleted": "late"}
    assert s.core.adapters() == [] and s.router.pipeline.catalog.resolve("late") is None
    assert [e["action"] for e in s.core.kill_switches()["audit"]] == ["adapter_added", "adapter_deleted"]
    assert s.client.delete("/admin/adapters/late", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    "method,path", [("POST", "/admin/adapters"), ("GET", "/admin/adapters"), ("DELETE", "/admin/adapters/x")]
)
def test_the_routes_need_the_admin_token(stack, method, path) -> None:
    assert stack.client.request(method, path, json={}).status_code == 401
    r = stack.client.request(method, path, headers={"Authorization": "Bearer nope"}, json={})
    assert r.status_code == 403
    assert stack.link.calls == [] and stack.replica.loads == []


def test_adapters_are_vllms_a_model_on_another_engine_is_refused() -> None:
    router = build_router({"auth": {"demo_admin_token": "admin-token"}}, FakeHandle())  # the built-in model
    with routed(router) as client:
        r = client.post("/admin/adapters", headers=ADMIN, json={"model": "tiny-decoder", "name": "a", "path": "/a"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["field"] == "model" and "vLLM" in err["message"]


def test_past_the_bound_no_replica_is_asked_to_load_it(stack) -> None:
    from ballast.policies.adapters import MAX_RUNTIME_ADAPTERS

    for i in range(MAX_RUNTIME_ADAPTERS):
        stack.core.set_adapter("llama", f"a{i}", f"/adapters/a{i}", None, "ops")
    asyncio.run(stack.router._admin._exchange.exchange_once())  # this router's next snapshot
    r = add(stack, name="one-more")
    assert r.status_code == 400 and r.json()["error"]["field"] == "name"
    assert f"at most {MAX_RUNTIME_ADAPTERS}" in r.json()["error"]["message"]
    assert stack.replica.loads == []


def test_a_name_another_router_took_since_this_ones_snapshot_is_refused_by_the_controller(stack) -> None:
    stack.core.set_adapter("llama", "late", "/adapters/elsewhere", None, "bob")  # not in this router's snapshot yet
    r = add(stack, name="late")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "ADAPTER_REFUSED" and err["field"] == "name" and "taken" in err["message"]
    assert [a["path"] for a in stack.core.adapters()] == ["/adapters/elsewhere"]
