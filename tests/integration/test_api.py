"""The HTTP contract against a real local Ray Serve: generate, stream, every error."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FREE, GOLD, status

pytestmark = pytest.mark.integration


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_generate_plain(client):
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "Hello", "max_tokens": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens_generated"] == 12
    assert len(body["text"]) == 12  # printable ASCII: one byte, one character
    assert body["model"] == "tiny-decoder"
    assert body["degradation_level"] == 0
    assert body["degraded"] is False and body["degraded_reasons"] == []


def test_generate_is_deterministic_greedy(client):
    a = client.post("/v1/generate", headers=GOLD, json={"prompt": "same", "max_tokens": 8}).json()
    b = client.post("/v1/generate", headers=FREE, json={"prompt": "same", "max_tokens": 8}).json()
    assert a["text"] == b["text"]


def test_generate_stream_one_event_per_token_batch(client, ballast):
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "Hi", "max_tokens": 10, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    chunk = ballast.model.stream_chunk_tokens
    tokens = [e for e in events if e[0] == "token"]
    assert [d["tokens"] for _, d in tokens] == [chunk, chunk, 10 - 2 * chunk]
    assert events[-1][0] == "done"
    assert events[-1][1]["tokens_generated"] == 10
    # Streamed text equals the unary text for the same prompt (greedy).
    plain = client.post("/v1/generate", headers=GOLD, json={"prompt": "Hi", "max_tokens": 10}).json()
    assert "".join(d["text"] for _, d in tokens) == plain["text"]


def test_a_cut_stream_resumed_by_its_client_reads_as_the_whole_stream(client):
    # The client of a stream cut at its router (its node lost) sends it again with the
    # ids the token events carried and the characters it has; the model goes on from there.
    body = {"prompt": "resume me", "max_tokens": 24, "stream": True}
    whole = [d for e, d in sse_events(client.post("/v1/generate", headers=GOLD, json=body).text) if e == "token"]
    assert all(len(d["ids"]) == d["tokens"] for d in whole)
    got = whole[:2]  # what reached the client before the cut
    ids = [i for d in got for i in d["ids"]]
    text = "".join(d["text"] for d in got)
    r = client.post("/v1/generate", headers=GOLD, json={**body, "resume": {"ids": ids, "text_chars": len(text)}})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    rest = "".join(d["text"] for e, d in events if e == "token")
    assert text + rest == "".join(d["text"] for d in whole)  # nothing missing, nothing twice
    done = events[-1][1]
    assert events[-1][0] == "done" and done["tokens_generated"] == 24 and done["resumed_tokens"] == len(ids)


@pytest.mark.parametrize(
    "extra, headers, field",
    [
        ({"stream": False, "resume": {"ids": [104], "text_chars": 1}}, {}, "resume"),
        ({"resume": {"ids": [104, 256], "text_chars": 1}}, {}, "resume.ids"),
        ({"resume": {"ids": [-1], "text_chars": 1}}, {}, "resume.ids.0"),
        ({"resume": {"ids": [104] * 9, "text_chars": 9}}, {}, "resume.ids"),
        ({"resume": {"ids": [], "text_chars": 0}}, {}, "resume.ids"),
        ({"resume": {"ids": [104], "text_chars": 1}}, {"Idempotency-Key": "k-resume"}, "Idempotency-Key"),
    ],
)
def test_a_bad_resume_is_422_naming_the_field(client, extra, headers, field):
    body = {"prompt": "x", "max_tokens": 8, "stream": True, **extra}
    r = client.post("/v1/generate", headers={**GOLD, **headers}, json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["code"], err["field"]) == ("INVALID_REQUEST", field), err


def test_max_tokens_clamped_by_level_is_reported_degraded(client, ballast):
    level0_max = ballast.degradation.levels[0].max_tokens
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": "x", "max_tokens": level0_max + 20})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens_generated"] == level0_max
    assert body["degraded"] is True and body["degraded_reasons"] == ["max_tokens_clamped"]


@pytest.mark.parametrize(
    "headers, message",
    [({}, "missing"), ({"Authorization": "Bearer nope"}, "unknown"), ({"Authorization": "Basic abc"}, "missing")],
)
def test_401_missing_or_unknown_key(client, headers, message):
    r = client.post("/v1/generate", headers=headers, json={"prompt": "x"})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "UNAUTHENTICATED" and message in err["message"]


def test_403_status_without_admin_token(client):
    r = client.get("/v1/status", headers=GOLD)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "FORBIDDEN"
    assert client.get("/v1/status").status_code == 401


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 999999}, "max_tokens"),
        ({"prompt": "x", "criticality": "urgent"}, "criticality"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "stream": "maybe"}, "stream"),
        ({"prompt": "x", "temperature": 2}, "temperature"),
    ],
)
def test_422_names_the_field(client, body, field):
    r = client.post("/v1/generate", headers=GOLD, json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "INVALID_REQUEST"
    assert err["field"] == field and field in err["message"]


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b""])
def test_422_body_not_a_json_object(client, raw):
    r = client.post("/v1/generate", headers={**GOLD, "Content-Type": "application/json"}, content=raw)
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "body"


def test_413_body_too_large(client, ballast):
    big = b'{"prompt": "' + b"a" * (ballast.limits.max_body_bytes + 10) + b'"}'
    r = client.post("/v1/generate", headers={**GOLD, "Content-Type": "application/json"}, content=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"


def test_413_prompt_too_large(client, ballast):
    prompt = "é" * (ballast.limits.max_prompt_bytes // 2 + 1)  # 2 bytes each: over in bytes
    r = client.post("/v1/generate", headers=GOLD, json={"prompt": prompt})
    assert r.status_code == 413
    assert "prompt" in r.json()["error"]["message"]


def test_unknown_route_and_method_use_the_error_body(client):
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND"
    r = client.get("/v1/generate", headers=GOLD)
    assert r.status_code == 405 and r.json()["error"]["code"] == "METHOD_NOT_ALLOWED"


def test_health_endpoints(client):
    assert client.get("/healthz/live").json() == {"status": "ok"}
    r = client.get("/healthz/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_status_reports_level_inputs_and_replicas(client):
    s = status(client)
    assert s["ingress"] == "haproxy"  # the config's default, applied before ray.init
    assert s["fast_path"] is True  # http.fast_path, applied with the ingress before ray.init
    assert not {"level", "source", "breakers", "gate"} & set(s)  # every model alike, under models
    (name,) = s["models"]
    model = s["models"][name]
    assert model["level"] in range(5) and model["source"] == "snapshot"
    snap = s["snapshot"]
    assert snap["version"] >= 1 and 0 <= snap["age_s"] < 2
    inputs = snap["models"][name]["inputs"]
    assert set(inputs) >= {"queue_length", "queue_wait_p95_ms", "gpu_util_pct", "vram_pct", "error_rate"}
    if torch.cuda.is_available():  # the replicas see this GPU too (num_gpus 0 does not hide it)
        assert 0 <= inputs["gpu_util_pct"] <= 100 and 0 < inputs["vram_pct"] < 100, inputs
    else:
        assert inputs["gpu_util_pct"] is None and inputs["vram_pct"] is None  # absent, not zero
    replicas = s["replicas"]["BallastModel"]
    assert replicas["desired"] >= 1 and replicas["running"] >= 1
    assert model["constraints"]["admitted"]
    assert snap["models"][name]["deployment"] == "BallastModel"
