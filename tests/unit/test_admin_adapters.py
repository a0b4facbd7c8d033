"""``/admin/adapters`` on a real Router object without Ray (routerkit): the checks in their
order, each refusal naming its field and recording nothing; ``adapters_root`` and written
tenants required; one add of a name at a time (409 for the second, even mid-flight); the
trial load before the controller's record; the router's catalog following the snapshot.

Stand-ins, for what cannot run here: the controller actor (``CoreLink``: each call goes to
a real ``ControllerCore`` in process, as the actor hands it on) and the model deployment's
handle (``StandInReplica``: it answers the trial load as told; the real replica's side,
against a real vLLM engine, is in test_vllm_lora.py). The snapshot exchange is the real
``SnapshotExchange`` over that link, so the router applies what the controller publishes.
"""

from __future__ import annotations

import asyncio
import pickle
import types
from typing import Any

import pytest
from fakes import FakeClock
from ray.exceptions import RayTaskError
from routerkit import build_router, routed
from test_resilient_caller import FakeHandle

from ballast.control.controller import ControllerCore
from ballast.control.snapshot import SnapshotExchange
from ballast.errors import AdapterRefused
from ballast.policies.adapters import MAX_RUNTIME_ADAPTERS
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
        # The actor's admin methods are its core's AdminState's (controller.py), the rest the core's.
        return getattr(self.core.admin if hasattr(self.core.admin, method) else self.core, method)(*args)

    async def report(self, report: RouterReport) -> dict[str, Any]:
        return self.core.report_router(report)


class StandInReplica:
    """Stand-in for the model deployment's handle: ``add_adapter.remote`` answers as told
    (``refuse``: the replica's AdapterRefused, as Ray re-raises it; ``down``: no replica)."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []
        self.refuse: BaseException | None = None
        self.during: Any = None  # run (in a thread) while the trial load is in flight
        self.add_adapter = types.SimpleNamespace(remote=self._add)

    async def _add(self, name: str, path: str) -> dict[str, Any]:
        self.loads.append((name, path))
        during, self.during = self.during, None
        if during is not None:
            await asyncio.to_thread(during)
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
    cfg = {
        "auth": {"demo_admin_token": "admin-token"},
        "tenants": TENANTS,
        "models": [llama],
        "adapters_root": "/adapters",
    }
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


def add(s, headers: dict[str, str] = ADMIN, **body: Any):
    return s.client.post(
        "/admin/adapters", headers=headers, json={"model": "llama", "path": "/adapters/x", "tenants": ["*"], **body}
    )


def nothing_recorded(s) -> None:
    assert s.core.admin.adapters() == []
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
    assert s.link.calls == ["reserve_adapter", "set_adapter"]  # the name held, then recorded
    catalog = s.router.pipeline.catalog  # this router applied the snapshot at once
    assert catalog.may_use("gold", "llama:late") and not catalog.may_use("free", "late")
    assert s.router.pipeline.base_catalog.resolve("late") is None  # the config's, unchanged
    listed = s.client.get("/admin/adapters", headers=ADMIN)
    assert listed.status_code == 200 and listed.json() == {"adapters": [r.json()]}
    assert s.core.admin.kill_switches()["audit"][-1]["action"] == "adapter_added"


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
        ({"name": "late", "tenants": None}, "tenants"),  # written out: never implied
        ({"name": "late", "tenants": []}, "tenants"),
        ({"name": 5}, "name"),
    ],
)
def test_a_body_of_the_wrong_shape_is_refused_first(stack, body, field) -> None:
    r = add(stack, model="mistral", **body)  # the model would be refused too: the shape comes first
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    assert stack.replica.loads == []
    nothing_recorded(stack)


def test_a_name_added_at_run_time_is_a_conflict_until_it_is_deleted(stack) -> None:
    assert add(stack, name="late").status_code == 201
    for path in ("/adapters/other", "/adapters/x"):
        r = add(stack, name="late", path=path)
        assert r.status_code == 409 and r.json()["error"]["code"] == "ADAPTER_CONFLICT", r.text
        assert "delete it first" in r.json()["error"]["message"]
    assert stack.replica.loads == [("late", "/adapters/x")]  # no second trial load
    assert stack.client.delete("/admin/adapters/late", headers=ADMIN).status_code == 200
    assert add(stack, name="late", path="/adapters/other").status_code == 201


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
    stack.replica.refuse = None  # the failed add gave the name back: another may run now
    assert add(stack, name="late", path="/adapters/other").status_code == 201


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
    assert s.core.admin.adapters() != []  # none of those touched it
    r = s.client.delete("/admin/adapters/late", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"deleted": "late"}
    assert s.core.admin.adapters() == [] and s.router.pipeline.catalog.resolve("late") is None
    assert [e["action"] for e in s.core.admin.kill_switches()["audit"]] == ["adapter_added", "adapter_deleted"]
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
    cfg = {"auth": {"demo_admin_token": "admin-token"}, "adapters_root": "/a"}
    router = build_router(cfg, FakeHandle())  # the built-in model
    with routed(router) as client:
        body = {"model": "tiny-decoder", "name": "a", "path": "/a/a", "tenants": ["*"]}
        r = client.post("/admin/adapters", headers=ADMIN, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["field"] == "model" and "vLLM" in err["message"]


def test_past_the_bound_no_replica_is_asked_to_load_it(stack) -> None:
    for i in range(MAX_RUNTIME_ADAPTERS):
        stack.core.admin.set_adapter("llama", f"a{i}", f"/adapters/a{i}", ["*"], "ops")
    asyncio.run(stack.router._admin._exchange.exchange_once())  # this router's next snapshot
    r = add(stack, name="one-more")
    assert r.status_code == 400 and r.json()["error"]["field"] == "name"
    assert f"at most {MAX_RUNTIME_ADAPTERS}" in r.json()["error"]["message"]
    assert stack.replica.loads == []


def test_a_name_another_router_took_since_this_ones_snapshot_is_a_conflict_at_the_controller(stack) -> None:
    # Not in this router's snapshot yet:
    stack.core.admin.set_adapter("llama", "late", "/adapters/elsewhere", ["*"], "bob")
    r = add(stack, name="late")
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "ADAPTER_CONFLICT" and "delete it first" in r.json()["error"]["message"]
    assert [a["path"] for a in stack.core.admin.adapters()] == ["/adapters/elsewhere"]
    assert stack.replica.loads == []  # refused before any replica loaded it


def test_two_admins_adding_one_name_at_once_the_second_is_a_conflict_and_loads_nothing(stack) -> None:
    """The second add arrives while the first's trial load is in flight (its snapshot lists
    nothing yet): the controller's reservation answers it 409 before any replica loads it,
    so no replica ever holds the second directory under that name."""
    second: list[Any] = []
    stack.replica.during = lambda: second.append(add(stack, name="late", path="/adapters/b"))
    first = add(stack, name="late", path="/adapters/a")
    assert first.status_code == 201, first.text
    assert second[0].status_code == 409 and second[0].json()["error"]["code"] == "ADAPTER_CONFLICT"
    assert "another add of 'late' is in flight" in second[0].json()["error"]["message"]
    assert stack.replica.loads == [("late", "/adapters/a")]
    assert [a["path"] for a in stack.core.admin.adapters()] == ["/adapters/a"]


def test_without_adapters_root_no_adapter_may_be_added_at_run_time() -> None:
    router = build_router({"auth": {"demo_admin_token": "admin-token"}}, FakeHandle())
    link = CoreLink(router._cfg)
    router._admin._link = link
    with routed(router) as client:
        r = client.post("/admin/adapters", headers=ADMIN, json={"model": "tiny-decoder", "name": "a", "path": "/a"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "ADAPTERS_DISABLED"
        assert "adapters_root" in r.json()["error"]["message"]
        assert client.get("/admin/adapters", headers=ADMIN).json() == {"adapters": []}  # listing still answers
    assert link.calls == ["adapters"]


@pytest.mark.parametrize("path", ["/etc/late", "/adapters/../etc", "../late", "/adapters"])
def test_a_path_outside_adapters_root_is_refused_before_any_load(stack, path) -> None:
    r = add(stack, name="late", path=path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "ADAPTER_REFUSED" and err["field"] == "path"
    assert "is not under adapters_root '/adapters'" in err["message"]
    assert stack.replica.loads == []
    nothing_recorded(stack)
    assert "reserve_adapter" not in stack.link.calls


def test_every_tenant_is_written_out_and_listed_as_written(stack) -> None:
    r = add(stack, name="late", tenants="*")
    assert r.status_code == 201 and r.json()["tenants"] == ["*"]
    catalog = stack.router.pipeline.catalog
    assert catalog.may_use("gold", "late") and catalog.may_use("free", "late") and not catalog.may_use("other", "late")
    r = stack.client.post("/admin/adapters", headers=ADMIN, json={"model": "llama", "name": "b", "path": "/adapters/b"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "tenants"  # omitted: refused, not everyone
    r = add(stack, name="c", tenants=["*", "gold"])
    assert r.status_code == 400 and r.json()["error"]["field"] == "tenants"


def test_the_operator_is_recorded_as_claimed(stack) -> None:
    assert add(stack, name="late").status_code == 201
    assert add(stack, {"Authorization": "Bearer admin-token"}, name="b").status_code == 201
    audit = stack.core.admin.kill_switches()["audit"]
    assert [(e["by"], e["operator_claimed"]) for e in audit] == [("admin_token", "alice"), ("admin_token", None)]
    assert [a["added_by"] for a in stack.core.admin.adapters()] == ["alice", ""]


class RayLink(CoreLink):
    """CoreLink, with each controller error raised as Ray raises an actor's: pickled across
    the process boundary, then a RayTaskError that is also an instance of its class and
    carries it as ``cause``."""

    async def call(self, method: str, *args: Any) -> Any:
        try:
            return await super().call(method, *args)
        except Exception as e:
            cause = pickle.loads(pickle.dumps(e))
            raise RayTaskError(method, "traceback", cause).as_instanceof_cause() from None


def test_the_controllers_conflict_through_ray_is_still_a_409(stack) -> None:
    link = RayLink(stack.router._cfg)
    stack.router._admin._link = link
    link.core.admin.reserve_adapter("llama", "late", "/adapters/other", ["*"])  # another router's add in flight
    r = add(stack, name="late")
    assert r.status_code == 409 and r.json()["error"]["code"] == "ADAPTER_CONFLICT", r.text
    link.core.admin.set_adapter("llama", "other", "/adapters/other", ["*"], "bob")  # ... and one recorded meanwhile
    r = add(stack, name="other")
    assert r.status_code == 409 and "delete it first" in r.json()["error"]["message"]
    for i in range(MAX_RUNTIME_ADAPTERS - 2):  # the table (a reservation counts) fills up behind the snapshot
        link.core.admin.set_adapter("llama", f"a{i}", f"/adapters/a{i}", ["*"], "bob")
    r = add(stack, name="x")  # the controller's ValueError through Ray: still 400 naming the field
    assert r.status_code == 400 and r.json()["error"]["field"] == "name", r.text
    assert f"at most {MAX_RUNTIME_ADAPTERS}" in r.json()["error"]["message"]
    assert stack.replica.loads == []
