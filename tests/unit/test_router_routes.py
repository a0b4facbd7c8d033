"""The router's route table and its refusals before any model work, without Ray.

The routes are declared on the ``Router`` class (app.py), each handing its request to
a front; Serve's ``ingress`` finds them on the class. Here a router object without
Ray, a controller or a model answers through FastAPI itself the refusals that need
no model work (401, 403, 404, 405, 413, 422).
"""

import types

import pytest
from ray.serve._private.http_util import _walk_fastapi_routes
from routerkit import build_router, routed
from test_resilient_caller import FakeHandle

from ballast.router import app as router_app

ROUTES = {
    ("/v1/generate", "POST", None),
    ("/v1/chat/completions", "POST", None),
    ("/v1/completions", "POST", None),
    ("/v1/embeddings", "POST", None),
    ("/v1/models", "GET", None),
    ("/openapi.json", "GET", None),
    ("/docs", "GET", None),
    ("/v1/status", "GET", None),
    ("/healthz/live", "GET", None),
    ("/healthz/ready", "GET", None),
    ("/health", "GET", None),
    ("/version", "GET", None),
    ("/admin/kill-switch", "POST", 201),
    ("/admin/kill-switch", "GET", None),
    ("/admin/kill-switch/{entry_id}", "DELETE", None),
    ("/admin/adapters", "POST", 201),
    ("/admin/adapters", "GET", None),
    ("/admin/adapters/{name}", "DELETE", None),
    ("/admin/chaos", "POST", None),
    ("/admin/chaos", "DELETE", None),
    ("/admin/recycle", "POST", 202),
    ("/admin/replicas", "GET", None),
    # OpenAI's Batch API (router/batches.py) and its admin routes
    ("/v1/files", "POST", None),
    ("/v1/files", "GET", None),
    ("/v1/files/{file_id}", "GET", None),
    ("/v1/files/{file_id}", "DELETE", None),
    ("/v1/files/{file_id}/content", "GET", None),
    ("/v1/responses", "POST", None),
    ("/v1/responses/{response_id}", "GET", None),
    ("/v1/responses/{response_id}", "DELETE", None),
    ("/v1/batches", "POST", None),
    ("/v1/batches", "GET", None),
    ("/v1/batches/{batch_id}", "GET", None),
    ("/v1/batches/{batch_id}/cancel", "POST", None),
    ("/admin/batches", "GET", None),
    ("/admin/dlq", "GET", None),
    ("/admin/dlq/{dlq_id}/retry", "POST", None),
    ("/admin/dlq/{dlq_id}", "DELETE", None),
}


def routes():
    return [route for route, _, prefix in _walk_fastapi_routes(router_app.app)]


def test_every_route_is_registered_once_on_the_router():
    table = {(r.path, m, r.status_code) for r in routes() for m in r.methods}
    assert table == ROUTES
    assert len(routes()) == len(ROUTES)


@pytest.fixture()
def client():
    # A real router object without Ray or a controller: none of these refusals gets as
    # far as the model or the controller.
    router = build_router({"auth": {"demo_admin_token": "admin-token"}}, FakeHandle())
    with routed(router) as c:
        yield c


ADMIN = {"authorization": "Bearer admin-token"}


@pytest.mark.parametrize(
    "method,path,kw,status,code",
    [
        ("POST", "/v1/generate", {}, 401, "UNAUTHENTICATED"),
        ("POST", "/v1/generate", {"headers": {"authorization": "Bearer unknown"}}, 401, "UNAUTHENTICATED"),
        ("POST", "/v1/generate", {"headers": {"authorization": "Basic x"}}, 401, "UNAUTHENTICATED"),
        ("GET", "/v1/status", {}, 401, "UNAUTHENTICATED"),
        ("GET", "/v1/status", {"headers": {"authorization": "Bearer unknown"}}, 403, "FORBIDDEN"),
        ("POST", "/admin/kill-switch", {"headers": {"authorization": "Bearer unknown"}}, 403, "FORBIDDEN"),
        ("POST", "/admin/recycle", {"headers": ADMIN, "content": b"[]"}, 422, "INVALID_REQUEST"),
        ("POST", "/admin/recycle", {"headers": ADMIN, "content": b"{bad"}, 422, "INVALID_REQUEST"),
        ("POST", "/admin/recycle", {"headers": ADMIN, "json": {"all": False}}, 422, "INVALID_REQUEST"),
        ("POST", "/admin/recycle", {"headers": ADMIN, "json": {"zzz": 1}}, 422, "INVALID_REQUEST"),
        (
            "POST",
            "/admin/recycle",
            {"headers": {**ADMIN, "content-length": "99999999"}, "content": b"{}"},
            413,
            "PAYLOAD_TOO_LARGE",
        ),
        ("GET", "/nope", {}, 404, "NOT_FOUND"),
        ("PUT", "/admin/chaos", {}, 405, "METHOD_NOT_ALLOWED"),
        ("GET", "/v1/generate", {}, 405, "METHOD_NOT_ALLOWED"),
    ],
)
def test_refusals_before_any_model_work(client, method, path, kw, status, code):
    r = client.request(method, path, **kw)
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    assert "retry-after" not in r.headers


def test_the_field_is_named_in_a_validation_error(client):
    r = client.post("/admin/recycle", headers=ADMIN, json={"zzz": 1})
    assert r.json()["error"] == {
        "code": "INVALID_REQUEST",
        "message": "zzz: Extra inputs are not permitted",
        "field": "zzz",
    }


def test_liveness_needs_nothing(client):
    r = client.get("/healthz/live")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_vllms_probes_answer_without_a_key(client):
    # /health is vLLM's readiness: no body; here the model cannot be reached (the fake has no ping).
    r = client.get("/health")
    assert r.status_code == 503 and r.content == b""
    v = client.get("/version")
    assert v.status_code == 200 and v.json()["version"]


def test_health_is_200_when_the_model_answers_and_the_snapshot_is_fresh():
    from routerkit import at_level

    async def pong():
        return {}

    handle = FakeHandle()
    handle.ping = types.SimpleNamespace(remote=pong)
    router = build_router({}, handle)
    with routed(router) as c:
        assert c.get("/health").status_code == 503  # no snapshot yet
        at_level(router, 0)
        r = c.get("/health")
        assert r.status_code == 200 and r.content == b""


def test_a_kill_switch_scope_or_id_past_its_length_is_refused_before_the_controller(client):
    r = client.post(
        "/admin/kill-switch",
        headers=ADMIN,
        json={"scope": "s" * 10_000, "value": "x", "reason": "r", "expires_in_s": 60},
    )
    assert r.status_code == 422 and r.json()["error"]["field"] == "scope"
    r = client.delete("/admin/kill-switch/" + "a" * 10_000, headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
