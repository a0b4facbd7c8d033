"""The served contract (ballast/router/contract.py): every route with its schemas."""

from __future__ import annotations

import json

import pytest
from ray.serve._private.http_util import _walk_fastapi_routes
from routerkit import build_router, routed
from test_resilient_caller import FakeHandle

from ballast.router import app as router_app
from ballast.router.contract import openapi_document


def refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for v in node.values():
            yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


@pytest.fixture(scope="module")
def doc():
    return openapi_document(router_app.app.routes)


def test_every_route_has_its_request_and_response_schemas(doc):
    routes = [route for route, _, _ in _walk_fastapi_routes(router_app.app)]
    served = {(m, r.path) for r in routes if r.include_in_schema for m in r.methods}
    documented = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert documented == served and len(served) == 36
    for path, item in doc["paths"].items():
        for method, op in item.items():
            ok = [s for s in op["responses"] if s.startswith("2")]
            assert len(ok) == 1, (method, path)
            if path == "/health":  # vLLM's probe: a status, no body
                assert op["responses"][ok[0]]["content"] == {}
            elif path == "/v1/files/{file_id}/content":  # the file's bytes, as OpenAI serves them
                assert op["responses"][ok[0]]["content"]["application/octet-stream"]["schema"], path
            else:
                assert op["responses"][ok[0]]["content"]["application/json"]["schema"], (method, path)
            assert "application/json" in op["responses"]["default"]["content"], (method, path)
            if path == "/v1/files" and method == "post":  # an upload: OpenAI's multipart form
                assert op["requestBody"]["content"]["multipart/form-data"]["schema"]["$ref"], path
            elif method == "post" and not path.endswith(("/cancel", "/retry")):  # those two take no body
                assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"], path
    schemas = doc["components"]["schemas"]
    for ref in set(refs(doc)):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def test_the_schemas_say_what_the_routes_take(doc):
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert {"model", "messages", "max_tokens", "stream", "criticality"} <= set(chat["properties"])
    assert set(chat["required"]) == {"model", "messages"}
    assert chat.get("additionalProperties") is False  # unknown fields are refused
    assert {"prompt", "model", "max_tokens", "criticality", "service_tier", "stream", "resume"} == set(
        schemas["GenerateRequest"]["properties"]
    )
    generate = doc["paths"]["/v1/generate"]["post"]
    assert "text/event-stream" in generate["responses"]["200"]["content"]
    assert doc["paths"]["/v1/chat/completions"]["post"]["responses"]["default"]["content"]["application/json"][
        "schema"
    ] == {"$ref": "#/components/schemas/ErrorResponse"}
    json.dumps(doc)  # serializable as served


def test_the_router_serves_the_document_and_the_page_unless_turned_off():
    router = build_router({}, FakeHandle())
    with routed(router) as client:
        r = client.get("/openapi.json")
        assert r.status_code == 200 and r.json()["info"]["title"] == "Ballast"
        page = client.get("/docs")
        assert page.status_code == 200 and "/openapi.json" in page.text
    router = build_router({"http": {"docs_page": False}}, FakeHandle())
    with routed(router) as client:
        assert client.get("/docs").status_code == 404
        assert client.get("/openapi.json").status_code == 200
