"""A hostile tenant, a keyless client and a careless operator against the real stack.

Each probe sends what an attacker or a mistaken operator would, and asserts the answer
Ballast gives: a 4xx naming the field for bad input, a refusal for a grant not written,
nothing held by repeats, nothing moved by keyless traffic. The last test sends every
poison at once from one tenant while another tenant streams: the streams finish whole
and the breaker stays closed. Load is bounded in count, loopback only.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time

import httpx
import pytest
from conftest import (
    ADMIN,
    BASE,
    FREE,
    GOLD,
    breaker,
    clear_chaos,
    model_status,
    set_chaos,
    wait_quiet,
    wait_until,
)

pytestmark = pytest.mark.integration

MODEL = "tiny-decoder"
CHAT = [{"role": "user", "content": "Hello"}]


def _error(r: httpx.Response) -> dict:
    body = r.json()
    return body["error"]


def assert_refused(r: httpx.Response, status_code: int, code: str, field: str | None = None) -> None:
    """A clear refusal: the status, Ballast's stable code, and the field where one is named."""
    assert r.status_code == status_code, r.text
    err = _error(r)
    assert err["code"] == code, r.text
    if field is not None:
        named = err.get("field") or err.get("param") or ""
        assert field in named or field in err["message"], r.text


# -- 1. caps fail closed -----------------------------------------------------------------


def test_a_claim_above_the_tenants_grant_is_lowered_and_a_class_switch_still_catches_it(client):
    """free's grant is sheddable_plus: its critical_plus claim is lowered (said in the answer),
    so a kill switch on sheddable_plus covers it."""
    r = client.post(
        "/v1/generate",
        headers={**FREE, "X-Ballast-Criticality": "critical_plus"},
        json={"prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    assert r.json()["criticality"] == "sheddable_plus"
    assert "criticality_lowered" in r.json()["degraded_reasons"]
    entry = client.post(
        "/admin/kill-switch",
        headers=ADMIN,
        json={"scope": "criticality", "value": "sheddable_plus", "reason": "hostile probe", "expires_in_s": 60},
    ).json()
    try:
        r = client.post(
            "/v1/generate",
            headers={**FREE, "X-Ballast-Criticality": "critical_plus"},
            json={"prompt": "hi", "max_tokens": 2},
        )
        assert_refused(r, 503, "KILL_SWITCH")
    finally:
        assert client.delete(f"/admin/kill-switch/{entry['id']}", headers=ADMIN).status_code == 200


# -- 2. malformed input is a 4xx ---------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/chat/completions", "/v1/completions", "/admin/kill-switch"])
def test_deeply_nested_json_is_a_422_not_a_500(client, ballast, path):
    # Inside the body limit, far past Python's recursion limit.
    body = b"[" * (ballast.limits.max_body_bytes - 1)
    headers = ADMIN if path.startswith("/admin") else GOLD
    r = client.post(path, headers={**headers, "content-type": "application/json"}, content=body)
    # OpenAI's routes answer a bad body 400 (what its clients expect), the others 422.
    assert_refused(r, 400 if path in ("/v1/chat/completions", "/v1/completions") else 422, "INVALID_REQUEST", "body")


@pytest.mark.parametrize("raw", [b"\xb2", b"1e3", b"-5", b"\xd9\xa3", b"0", b"9" * 40])
def test_a_bad_timeout_header_is_a_422_naming_it(client, raw):
    r = client.post(
        "/v1/generate", headers=[*GOLD.items(), ("X-Request-Timeout-Ms", raw)], json={"prompt": "hi", "max_tokens": 2}
    )
    assert_refused(r, 422, "INVALID_REQUEST", "X-Request-Timeout-Ms")


# -- 8, 12, 14. schemas, stops and sampling values are bounded ---------------------------


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "extra,status_code,code,field",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(20)}}},
            400,
            "SCHEMA_TOO_COMPLEX",
            "response_format",
        ),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "INVALID_REQUEST", "stop"),
        ({"stop": ["s" * 2000]}, 400, "INVALID_REQUEST", "stop"),
        ({"seed": 2**70}, 400, "INVALID_REQUEST", "seed"),
        ({"temperature": 3.5}, 400, "INVALID_REQUEST", "temperature"),
        ({"n": 9}, 400, "INVALID_REQUEST", "n"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "INVALID_REQUEST", "top_logprobs"),
        ({"logprobs": 3}, 400, "INVALID_REQUEST", "logprobs"),
        ({"top_logprobs": 2}, 400, "INVALID_REQUEST", "top_logprobs"),
        ({"echo": True}, 400, "INVALID_REQUEST", "echo"),
    ],
)
def test_a_field_past_its_bound_is_refused_naming_it(client, extra, status_code, code, field):
    r = client.post(
        "/v1/chat/completions", headers=GOLD, json={"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}
    )
    assert_refused(r, status_code, code, field)


def test_a_temperature_at_the_edge_of_range_is_answered_greedy(client):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6}
    greedy = client.post("/v1/chat/completions", headers=GOLD, json={**body, "temperature": 0})
    tiny = client.post("/v1/chat/completions", headers=GOLD, json={**body, "temperature": 1e-40, "seed": 2**63 - 1})
    assert greedy.status_code == tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"]["content"] == greedy.json()["choices"][0]["message"]["content"]


# -- 3. the kill switch checks what the operator names ---------------------------------


@pytest.mark.parametrize(
    "scope,value,allowed",
    [
        ("criticality", "sheddable ", "sheddable_plus"),
        ("tenant", "nobody", "gold"),
        ("model", "gpt-4", MODEL),
    ],
)
def test_a_kill_switch_that_would_block_nothing_is_refused_naming_the_allowed_values(client, scope, value, allowed):
    r = client.post(
        "/admin/kill-switch",
        headers=ADMIN,
        json={"scope": scope, "value": value, "reason": "typo in an incident", "expires_in_s": 60},
    )
    assert_refused(r, 422, "INVALID_REQUEST", "value")
    assert allowed in _error(r)["message"]
    entries = client.get("/admin/kill-switch", headers=ADMIN).json()["entries"]
    assert all(e["value"] != value for e in entries)


# -- 4. repeats of a running Idempotency-Key hold nothing ---------------------------------


def test_repeats_of_a_running_key_hold_no_place_and_a_reused_key_is_refused(client):
    """A long first request and 20 repeats of its key: gold holds one place in flight, not
    21; a repeat with another body is 422; every repeat gets the first answer."""
    wait_quiet(client)
    set_chaos(client, "primary", step_delay_ms=50)  # seconds for the first answer's 160 steps
    key = f"hostile-{time.monotonic_ns()}"
    body = {"prompt": "the first of its key", "max_tokens": 160}
    headers = {**GOLD, "Idempotency-Key": key}
    try:

        async def run() -> tuple[list, list, httpx.Response]:
            async with httpx.AsyncClient(base_url=BASE, timeout=60) as c:
                first = asyncio.create_task(c.post("/v1/generate", headers=headers, json=body))
                await asyncio.sleep(0.5)
                repeats = [asyncio.create_task(c.post("/v1/generate", headers=headers, json=body)) for _ in range(20)]
                await asyncio.sleep(1.0)
                held = []  # gold's places in flight, sampled while the first still runs
                while not first.done() and len(held) < 5:
                    held.append((await c.get("/v1/status", headers=ADMIN)).json()["tenant_inflight"].get("gold", 0))
                    await asyncio.sleep(0.2)
                reused = await c.post("/v1/generate", headers=headers, json={**body, "max_tokens": 1})
                return [await first, *await asyncio.gather(*repeats)], held, reused

        answers, held, reused = asyncio.run(run())
    finally:
        clear_chaos(client)
    assert held and max(held) == 1, held  # the first alone, never the repeats (21 before)
    assert_refused(reused, 422, "INVALID_REQUEST", "Idempotency-Key")
    assert all(a.status_code == 200 for a in answers), [a.text[:100] for a in answers if a.status_code != 200]
    assert len({a.json()["text"] for a in answers}) == 1


# -- 6. one tenant's keys evict only its own -------------------------------------------


def test_a_flood_of_one_tenants_keys_evicts_none_of_another_tenants(client, ballast):
    """free sends more unique keys than the store holds in all (its bound and the global
    one): gold's key, the oldest of all, still replays."""
    idem = ballast.resilience.idempotency
    gold = {**GOLD, "Idempotency-Key": f"gold-{time.monotonic_ns()}"}
    first = client.post("/v1/generate", headers=gold, json={"prompt": "keep me", "max_tokens": 4})
    assert first.status_code == 200, first.text
    for i in range(idem.max_entries + 10):
        r = client.post(
            "/v1/generate",
            headers={**FREE, "Idempotency-Key": f"flood-{i}-{time.monotonic_ns()}"},
            json={"prompt": "x", "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
    again = client.post("/v1/generate", headers=gold, json={"prompt": "keep me", "max_tokens": 4})
    assert again.status_code == 200 and again.headers.get("x-ballast-idempotent-replay") == "true", again.headers
    assert again.json()["text"] == first.json()["text"]


# -- 11. runtime files are private -----------------------------------------------------


def test_haproxys_runtime_files_are_private(ballast):
    sock = os.environ.get("RAY_SERVE_HAPROXY_SOCKET_PATH")
    if not sock:
        pytest.skip("the stack runs Serve's proxy, not HAProxy")
    home = os.path.dirname(sock)
    st = os.lstat(home)
    assert stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) & 0o077 == 0, oct(st.st_mode)
    assert st.st_uid == os.getuid()
    assert home != f"/tmp/ballast-haproxy-{ballast.http.port}"  # not guessable from the port
    # Serve keeps each node's files in a directory of its own under it.
    sockets = wait_until(
        lambda: [
            os.path.join(d, f)
            for d, _, fs in os.walk(home)
            for f in fs
            if stat.S_ISSOCK(os.lstat(os.path.join(d, f)).st_mode)
        ],
        20,
        what="HAProxy's sockets",
    )
    admin = [p for p in sockets if os.path.basename(p) == os.path.basename(sock)]
    assert admin, sockets
    for path in admin:  # the admin socket is the owner's alone (Ray's template says 666)
        assert stat.S_IMODE(os.lstat(path).st_mode) & 0o077 == 0, (path, oct(os.lstat(path).st_mode))
    # Every other socket (metrics) is behind the 0700 directory asserted above.


# -- poison from one tenant while another streams --------------------------------------


def _poisons(limits) -> list[tuple[str, dict, bytes | dict]]:
    """(path, extra headers, body): each a request that must be refused for itself alone."""
    deep = b"[" * (limits.max_body_bytes - 1)
    return [
        ("/v1/chat/completions", {"content-type": "application/json"}, deep),
        ("/v1/generate", {"content-type": "application/json"}, deep),
        ("/v1/generate", {"content-type": "application/json"}, b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
        ("/v1/generate", {"content-type": "application/json"}, b'{"prompt": "x", "max_tokens": NaN}'),
        ("/v1/generate", {"content-type": "application/json"}, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
        ("/v1/chat/completions", {}, {"model": MODEL, "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}),
        ("/v1/chat/completions", {}, {"model": MODEL, "messages": CHAT, "stop": ["s" * 2000]}),
        ("/v1/chat/completions", {}, {"model": MODEL, "messages": CHAT, "seed": 2**70}),
        ("/v1/chat/completions", {}, {"model": MODEL, "messages": CHAT, "temperature": -1}),
        ("/v1/chat/completions", {}, {"model": MODEL, "messages": CHAT, "top_p": 0}),
        ("/v1/completions", {}, {"model": MODEL, "prompt": "x", "max_tokens": -3}),
    ]


async def _stream_whole(c: httpx.AsyncClient, max_tokens: int) -> dict:
    """A gold stream read to its end: its token count and how it finished."""
    tokens, done = 0, None
    async with c.stream(
        "POST", "/v1/generate", headers=GOLD, json={"prompt": "a long story", "max_tokens": max_tokens, "stream": True}
    ) as r:
        assert r.status_code == 200
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "token":
                tokens += json.loads(line[6:])["tokens"]
            elif line.startswith("data: ") and event in ("done", "error"):
                done = (event, json.loads(line[6:]))
    return {"tokens": tokens, "done": done}


def test_poison_from_one_tenant_leaves_another_tenants_streams_whole_and_the_breaker_closed(client, ballast):
    wait_quiet(client)
    failed_before = dict(model_status(client)["breakers"]["primary"]["failed_attempts"])
    max_tokens = 48
    poisons = _poisons(ballast.limits)

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=BASE, timeout=60) as c:
            streams = [asyncio.create_task(_stream_whole(c, max_tokens)) for _ in range(3)]
            answers = []
            for _ in range(3):  # each poison three times, while the streams run
                for path, headers, body in poisons:
                    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                    r = await c.post(path, headers={**FREE, **headers}, **kw)
                    answers.append((path, r.status_code, r.text[:200]))
            return await asyncio.gather(*streams), answers

    streams, answers = asyncio.run(run())
    assert [s["done"][0] for s in streams] == ["done"] * 3, streams
    assert all(s["tokens"] == max_tokens for s in streams), streams
    bad = [a for a in answers if not 400 <= a[1] < 500]
    assert not bad, bad
    assert breaker(client) == "closed"
    # Refused for their own input: no attempt at the model failed, nothing moved the breaker.
    assert model_status(client)["breakers"]["primary"]["failed_attempts"] == failed_before
