"""Property-based pass over the contract the router serves: no input makes a 5xx.

Schemathesis reads ``GET /openapi.json`` from a real Router object without Ray
(tests/unit/routerkit.py) and generates, for every operation, requests that follow the
schemas (positive) and requests that break them (negative); besides, raw bytes and
arbitrary JSON go to every route that reads a body. Each request is sent with a
tenant's key and again with the admin token, and every answer must be below 500.

What cannot run here is faked, and named so: the model deployment (``AnsweringHandle``:
every call answers at once) and the controller actor (``CoreLink``: the admin calls go
to a real ``ControllerCore`` on a fake clock, in process). Nothing moves the level or
sets a kill switch the router enforces (the snapshot is offered at level 0 before each
request), so a 503 here can only be a fault.

The Batch API's routes run on a real store: a redis-server for the module
(``EmbeddedRedis``), with room enough that no tenant limit stops the pass short of the
routes' own checks; besides the schema's cases, generated JSONL files are uploaded and
batches created from them, so every line goes through the online call's checks. The
client holds one event loop for the module, as a replica does (the store's connections
belong to the loop that opened them). The loops that run batch lines are not started: the
answers then depend on the requests alone (test_dispatcher.py and the integration suite
run them).

Deterministic: hypothesis runs derandomized with no example database, so a clean clone
sends the same requests; the counts run are printed (``pytest -s``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fakes import FakeClock
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from openai.types import Batch
from routerkit import at_level, build_router, routed
from schemathesis import GenerationMode
from test_resilient_caller import FakeResponse, FakeStream

from ballast.batch.embedded import EmbeddedRedis
from ballast.config import load_config
from ballast.control.controller import ControllerCore
from ballast.model.protocol import ModelCall, ModelChunk, ModelResult

KEY = {"Authorization": "Bearer dev-key-gold"}
SERVED_MODEL = "tiny-decoder"  # the built-in model's name
EMBED_MODEL = "tiny-embed"  # the built-in model again, as an embeddings model (kind: embed)
ADMIN = {"Authorization": "Bearer admin-token"}
CFG = {
    "models": [{"name": SERVED_MODEL}, {"name": EMBED_MODEL, "kind": "embed"}],
    "tenants": {"gold": {}},
    "auth": {"demo_keys": {"dev-key-gold": "gold"}, "demo_admin_token": "admin-token"},
    "chaos": {"enabled": True},
}
# Limits high enough that the pass reaches every route's own checks (the store's refusals
# past them are tested against the store itself).
ROOMY_BATCH = {"max_files": 10_000, "max_batches_in_flight": 1000}
# Per operation and generation mode (36 operations positive, the 11 POSTs with a body negative,
# x 2 credentials), with the generated batch files: about 4,600 requests, 30 s on two cores.
EXAMPLES = 40
BODY_ROUTES = (
    "/v1/generate",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/batches",
    "/admin/kill-switch",
    "/admin/adapters",
    "/admin/chaos",
    "/admin/recycle",
)


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )


class AnsweringMethod:
    """A fake Serve handle method (the model deployment cannot run here): every call answers
    (an embeddings call with a vector per input)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.calls = 0
        self.pooled = 0  # embeddings calls

    def remote(self, call: ModelCall) -> Any:
        assert isinstance(call, ModelCall), call
        self.calls += 1
        if self.stream:
            return FakeStream(
                FakeResponse(0, result=ModelChunk("ok", (1,))),
                FakeResponse(0, result=ModelChunk("", (), finish_reason="stop")),
            )
        if call.pool is not None:
            self.pooled += 1
            return FakeResponse(0, result=ModelResult("", 0, "stop", embeddings=tuple(bytes(8) for _ in call.inputs)))
        return FakeResponse(0, result=ModelResult("ok", 1, "stop"))


class AnsweringHandle:
    """A fake model deployment handle: unary calls, streams and pings all answer."""

    def __init__(self) -> None:
        self.generate = AnsweringMethod(stream=False)
        self.generate_stream = AnsweringMethod(stream=True)
        self.ping = self

    def options(self, stream: bool = False) -> AnsweringHandle:
        return self

    async def _pong(self) -> dict[str, Any]:
        return {}

    def remote(self) -> Any:  # ping.remote()
        return self._pong()


class CoreLink:
    """A fake controller link (the actor needs Ray): each admin call goes to a real
    ``ControllerCore`` in process, as the actor would hand it on."""

    def __init__(self) -> None:
        self.core = ControllerCore(load_config(CFG), clock=FakeClock(0), wall_clock=FakeClock(1_000_000))

    async def call(self, method: str, *args: Any) -> Any:
        # The actor's admin methods are its core's AdminState's (controller.py), the rest the core's.
        return getattr(self.core.admin if hasattr(self.core.admin, method) else self.core, method)(*args)

    async def exchange_once(self) -> None:
        """The snapshot exchange: the router keeps the snapshot the test offers."""


@pytest.fixture(scope="module")
def store_server(tmp_path_factory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def stack(store_server):
    handle = AnsweringHandle()
    store = {"store_url": store_server.url, "store_password_file": str(store_server.password_file)}
    router = build_router({**CFG, "batch": {**store, **ROOMY_BATCH}}, {SERVED_MODEL: handle, EMBED_MODEL: handle})
    assert router.store is not None and router.dispatch is not None
    router.dispatch = None  # its loops are not started (module docstring); /v1/status still shows them
    link = CoreLink()
    router._admin._link = router._admin._exchange = link
    at_level(router, 0)
    with routed(router) as client, client:  # entered: one event loop for every request
        doc = client.get("/openapi.json").json()
        yield router, client, schemathesis.openapi.from_dict(doc), handle
        client.portal.call(router.store.close)


class Tally:
    """Requests sent and answers by status, across the module; printed at its end; and the
    Batch API's requests answered 200, by route prefix (what reached the store)."""

    sent: Counter = Counter()
    fives: list[str] = []
    stored: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    print(f"\nfuzz: {sum(Tally.sent.values())} requests, by status {dict(sorted(Tally.sent.items()))}")
    print(f"fuzz: the Batch API's answered 200, by route: {dict(sorted(Tally.stored.items()))}")


def send(router, client, method: str, path: str, headers: dict[str, str], **kw: Any) -> Any:
    at_level(router, 0)  # a fresh snapshot: /health and /healthz/ready answer from it
    r = client.request(method, path, headers=headers, **kw)
    Tally.sent[r.status_code] += 1
    if r.status_code >= 500:
        Tally.fives.append(f"{method} {path} {kw!r:.300} -> {r.status_code} {r.text[:300]}")
    assert r.status_code < 500, Tally.fives[-1]
    if r.status_code == 200 and path.startswith(BATCH_PREFIXES):
        Tally.stored[next(p for p in BATCH_PREFIXES if path.startswith(p))] += 1
    return r


def served_variant(path: str, body: Any) -> Any:
    """An OpenAI body as generated, naming the served model and leaving the lengths to
    the context (a generated body rarely names it, and rarely fits the model's context)."""
    if path == "/v1/embeddings" and isinstance(body, dict):
        return {**body, "model": EMBED_MODEL}
    if path == "/v1/responses" and isinstance(body, dict):
        return {**{k: v for k, v in body.items() if k != "max_output_tokens"}, "model": SERVED_MODEL}
    if path not in ("/v1/chat/completions", "/v1/completions") or not isinstance(body, dict):
        return None
    lengths = ("max_tokens", "max_completion_tokens", "min_tokens")
    return {**{k: v for k, v in body.items() if k not in lengths}, "model": SERVED_MODEL}


#: The Batch API's routes: fuzzed on the module's store like every other route.
BATCH_PREFIXES = ("/v1/files", "/v1/batches", "/admin/batches", "/admin/dlq")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_operation_answers_5xx_for_what_its_schema_generates(stack, mode):
    router, client, schema, handle = stack
    ops = [result.ok() for result in schema.get_all_operations()]
    assert len(ops) == 36 and len([op for op in ops if op.path.startswith(BATCH_PREFIXES)]) == 13
    if mode is GenerationMode.NEGATIVE:  # what a schema can break: a body (a path's string takes any string)
        ops = [op for op in ops if op.method.upper() == "POST" and len(op.body) > 0]
    for op in ops:

        @fuzz_settings(EXAMPLES)
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case) -> None:
            kw = case.as_transport_kwargs(base_url="http://testserver")
            body = {"json": kw["json"]} if "json" in kw else {"content": kw["data"]} if "data" in kw else {}
            path = kw["url"].removeprefix("http://testserver")
            for auth in (KEY, ADMIN):
                headers = {**{k: str(v) for k, v in kw.get("headers", {}).items()}, **auth}
                send(router, client, kw["method"], path, headers, params=kw.get("params") or None, **body)
            served = served_variant(path, body.get("json"))
            if served is not None:  # deeper: past the model's name and the length checks
                send(router, client, kw["method"], path, {**headers, **KEY}, json=served)

        run()
    if mode is GenerationMode.POSITIVE:
        assert handle.generate.calls + handle.generate_stream.calls > 0  # valid requests reached the model
        assert handle.generate.pooled > 0  # embeddings too
        assert Tally.stored[BATCH_PREFIXES[0]] > 0  # valid uploads reached the store


# Leaves include what JSON itself does not have but Python writes (NaN, Infinity), ints
# past int64 and lone surrogates (written as \ud800 escapes).
TEXT = st.text(st.characters(exclude_categories=()), max_size=20)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
# Keys the bodies take, so that arbitrary values reach the fields' validation too.
KEYS = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "stop",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "response_format",
        "resume",
        "seed",
        "temperature",
        "top_k",
        "scope",
        "value",
        "reason",
        "expires_in_s",
        "target",
        "replica_id",
        "criticality",
        "content",
        "role",
        "input_file_id",
        "endpoint",
        "completion_window",
        "metadata",
    ]
)
BODIES = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 60_000).map(lambda n: b"[" * n),  # nesting past any parser's recursion
    JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(KEYS, JSON, max_size=5).map(lambda v: json.dumps(v).encode()),
)


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_no_body_route_answers_5xx_for_arbitrary_bytes_or_json(stack, path):
    router, client, _, _ = stack

    @fuzz_settings(80)
    @given(body=BODIES)
    def run(body: bytes) -> None:
        for auth in (KEY, ADMIN):
            send(router, client, "POST", path, {**auth, "content-type": "application/json"}, content=body)

    run()


# A batch file's lines: requests as a client writes them (any method and url; a body that is
# arbitrary, or a valid one with arbitrary keys over it), arbitrary JSON, and bytes.
LINE_BODY = st.one_of(
    st.dictionaries(KEYS, JSON, max_size=5),
    st.dictionaries(KEYS, JSON, max_size=2).map(
        lambda extra: {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", **extra}
    ),
    st.dictionaries(KEYS, JSON, max_size=2).map(lambda extra: {"model": EMBED_MODEL, "input": ["hi"], **extra}),
)
REQUEST_LINE = st.fixed_dictionaries(
    {
        "custom_id": TEXT,
        "method": st.sampled_from(["POST", "GET"]),
        "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
    },
    optional={"body": LINE_BODY},
)
FILE_LINES = st.lists(
    st.one_of(REQUEST_LINE.map(json.dumps), JSON.map(json.dumps), st.binary(max_size=40)).map(
        lambda line: line if isinstance(line, bytes) else line.encode()
    ),
    max_size=6,
)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_no_batch_route_answers_5xx_for_a_generated_file(stack, endpoint):
    """Each generated file uploaded, a batch made of it (every line through the online call's
    checks), read back and cancelled, the file read and deleted: no answer is a 5xx, and a
    batch the API makes is one the official client parses."""
    router, client, _, _ = stack
    made: Counter = Counter()

    @fuzz_settings(60)
    @given(lines=FILE_LINES)
    def run(lines: list[bytes]) -> None:
        form = {"files": {"file": ("in.jsonl", b"\n".join(lines) + b"\n")}, "data": {"purpose": "batch"}}
        up = send(router, client, "POST", "/v1/files", KEY, **form)
        if up.status_code != 200:
            return
        file_id = up.json()["id"]
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
        batch = send(router, client, "POST", "/v1/batches", KEY, json=body)
        if batch.status_code == 200:
            parsed = Batch.model_validate(batch.json())
            made[parsed.status] += 1
            assert Batch.model_validate(send(router, client, "GET", f"/v1/batches/{parsed.id}", KEY).json()) == parsed
            cancelled = send(router, client, "POST", f"/v1/batches/{parsed.id}/cancel", KEY)
            assert cancelled.status_code == (409 if parsed.status == "failed" else 200), cancelled.text
        send(router, client, "GET", f"/v1/files/{file_id}/content", KEY)
        send(router, client, "DELETE", f"/v1/files/{file_id}", KEY)

    run()
    assert made["in_progress"] > 0 and made["failed"] > 0, made  # lines ran the checks, and files failed whole


HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40).map(
    lambda v: v.strip().encode("latin-1")
)  # what HTTP carries: Latin-1 bytes (a server strips the edges)
HEADERS = st.dictionaries(
    st.sampled_from(
        [
            "x-ballast-criticality",
            "x-request-timeout-ms",
            "idempotency-key",
            "x-ballast-operator",
            "authorization",
            "content-length",
        ]
    ),
    HEADER_VALUE,
    max_size=4,
)
VALID = {
    "/v1/generate": {"prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 4, "stream": True},
    "/v1/embeddings": {"model": EMBED_MODEL, "input": ["hi", "there"], "encoding_format": "base64"},
    "/admin/recycle": {"all": True},
}


@pytest.mark.parametrize("path", sorted(VALID))
def test_no_route_answers_5xx_for_arbitrary_header_values(stack, path):
    router, client, _, _ = stack
    body = json.dumps(VALID[path]).encode()

    @fuzz_settings(60)
    @given(headers=HEADERS)
    def run(headers: dict[str, bytes]) -> None:
        auth = ADMIN if path.startswith("/admin") else KEY
        headers = {"authorization": auth["Authorization"].encode(), **headers}
        if "content-length" in headers:  # a declared length that is not the body's is the server's to refuse
            headers["content-length"] = str(len(body)).encode()
        send(router, client, "POST", path, headers, content=body)

    run()
