"""``POST /v1/embeddings`` (ballast/router/embeddings.py, embeddings_api.py): the body and
its bounds, each refusal a 400 naming the field; one model call for all the inputs, their
ids the model's tokenizer's; the answer as numbers or base64; the kinds of models kept
apart on every route; the quota charged the inputs' tokens at the model's cost; a batch
line run as the online call; an embeddings model's fallback refused unless it embeds alike.

A real router object (tests/unit/routerkit.py) with one scripted Serve handle per model (the
engines' pooling is tested with the engines): what the handle is sent is what a replica
gets, and what it answers is a ``ModelResult`` with the vectors as an engine gives them.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Any

import pytest
from routerkit import at_level, build_router, routed
from test_resilient_caller import FakeHandle, FakeResponse

from ballast.config import load_config
from ballast.errors import InvalidRequest
from ballast.model.protocol import ModelCall, ModelResult, Pooling
from ballast.policies.deadline import Deadline
from ballast.router import embeddings_api as ea
from ballast.router.gate import GateSlot
from ballast.router.openai_api import BadRequest
from ballast.router.pipeline import Caller

CFG: dict[str, Any] = {
    "models": [
        {"name": "writer"},
        {
            "name": "embedder",
            "kind": "embed",
            "cost_per_token": 3.0,
            "architecture": {"max_seq_len": 64},
            "embed": {
                "dimensions": [4],
                "max_inputs": 3,
                "max_input_tokens": 32,
                "max_request_tokens": 40,
            },
        },
    ],
    "tenants": {"gold": {"rate_tokens_per_s": 1e-9, "burst_tokens": 10_000}},  # no refill within a test
    "auth": {"demo_keys": {"key-gold": "gold"}},
}
GOLD = {"authorization": "Bearer key-gold"}


def vec(*xs: float) -> bytes:
    """A vector as an engine answers it: float32, little-endian."""
    return struct.pack(f"<{len(xs)}f", *xs)


def vectors(*vs: bytes) -> FakeResponse:
    return FakeResponse(0, result=ModelResult("", 0, "stop", embeddings=vs))


@pytest.fixture()
def handles() -> dict[str, FakeHandle]:
    return {"writer": FakeHandle(), "embedder": FakeHandle()}


@pytest.fixture()
def router(handles):
    r = build_router(CFG, handles)
    at_level(r, 0)
    return r


def embed(c: Any, **body: Any) -> Any:
    return c.post("/v1/embeddings", headers=GOLD, json={"model": "embedder", **body})


def refusal(r: Any) -> tuple[int, str, str]:
    err = r.json()["error"]
    return r.status_code, err["param"], err["code"]


# ------------------------------------------------------------------------ the body


def test_every_form_of_input_is_a_list_of_inputs():
    def inputs(value: Any) -> Any:
        return ea.parse_embedding({"model": "m", "input": value}).inputs

    assert inputs("a b") == ["a b"]
    assert inputs(["a", "b"]) == ["a", "b"]
    assert inputs([1, 2, 3]) == [[1, 2, 3]]
    assert inputs([[1], [2, 3]]) == [[1], [2, 3]]
    req = ea.parse_embedding({"model": "m", "input": "x"})
    assert (req.encoding_format, req.dimensions) == ("float", None)


@pytest.mark.parametrize(
    "body,field,says",
    [
        ({"input": "x"}, "model", "Field required"),
        ({"model": "m"}, "input", "Field required"),
        ({"model": "m", "input": ""}, "input", "not empty"),
        ({"model": "m", "input": [""]}, "input.0", "not empty"),
        ({"model": "m", "input": []}, "input", "at least one input"),
        ({"model": "m", "input": ["a", ""]}, "input.1", "not empty"),
        ({"model": "m", "input": ["a", [1]]}, "input.1", "every input of a list"),
        ({"model": "m", "input": [[1], "a"]}, "input.1", "every input of a list"),
        ({"model": "m", "input": [[1], []]}, "input.1", "at least one id"),
        ({"model": "m", "input": [1, -2]}, "input", "integers from 0"),
        ({"model": "m", "input": [1, 1 << 31]}, "input", "integers from 0"),
        ({"model": "m", "input": [[True]]}, "input.0", "integers from 0"),
        ({"model": "m", "input": [1.5]}, "input.0", "every input of a list"),
        ({"model": "m", "input": {"a": 1}}, "input", "must be a string"),
        ({"model": "m", "input": 7}, "input", "must be a string"),
        ({"model": "m", "input": ["a"] * (ea.MAX_INPUTS + 1)}, "input", "at most 2048 inputs"),
        ({"model": "m", "input": [0] * (ea.MAX_INPUT_IDS + 1)}, "input", "at most 131072 ids"),
        ({"model": "m", "input": "x", "encoding_format": "bytes"}, "encoding_format", "'float' or 'base64'"),
        ({"model": "m", "input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"model": "m", "input": "x", "dimensions": (1 << 16) + 1}, "dimensions", "less than or equal"),
        ({"model": "m", "input": "x", "dimensions": "4"}, "dimensions", "valid integer"),
        ({"model": "m", "input": "x", "user": "u" * 257}, "user", "at most 256"),
        ({"model": "m", "input": "x", "criticality": "urgent"}, "criticality", "critical"),
        ({"model": "m", "input": "x", "service_tier": "gold"}, "service_tier", "flex"),
        ({"model": "m", "input": "x", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens", "unknown field"),
        ({"model": "m" * 257, "input": "x"}, "model", "at most 256"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(body, field, says):
    with pytest.raises(BadRequest) as e:
        ea.parse_embedding(body)
    assert (e.value.status, e.value.field) == (400, field), e.value.message
    assert says in e.value.message and e.value.message.startswith(f"{field}: ")


def test_a_vector_is_numbers_or_its_little_endian_float32_bytes_base64ed():
    raw = vec(0.5, -1.25, 3.0)
    assert ea.vector(raw, "float") == [0.5, -1.25, 3.0]
    assert base64.b64decode(ea.vector(raw, "base64")) == raw  # the openai client's own decoding


# ------------------------------------------------------------------------ the route


def test_texts_are_one_call_of_their_byte_ids_and_the_answer_is_each_vector_by_index(router, handles):
    handles["embedder"].generate.script.append(vectors(vec(1, 0, 0, 0), vec(0, 0.5, 0, 0)))
    with routed(router) as c:
        r = embed(c, input=["héllo", "ab"])
    assert r.status_code == 200, r.text
    (call,) = handles["embedder"].generate.calls
    assert call.inputs == (tuple("héllo".encode()), (97, 98))
    assert call.pool == Pooling("last", True, None) and call.max_tokens == 0 and call.model == "embedder"
    assert call.tokenizer == "bytes" and call.input_tokens == 8
    body = r.json()
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [1.0, 0.0, 0.0, 0.0]},
            {"object": "embedding", "index": 1, "embedding": [0.0, 0.5, 0.0, 0.0]},
        ],
        "model": "embedder",
        "usage": {"prompt_tokens": 8, "total_tokens": 8},
    }
    assert r.headers["x-ballast-criticality"] == "critical" and r.headers["x-ballast-fallback"] == "none"


def test_base64_token_ids_and_dimensions_reach_the_call_and_the_answer(router, handles):
    handles["embedder"].generate.script.append(vectors(vec(0.25, 0.75, 0, 1)))
    with routed(router) as c:
        r = embed(c, input=[5, 6, 7], encoding_format="base64", dimensions=4)
    assert r.status_code == 200, r.text
    (call,) = handles["embedder"].generate.calls
    assert call.inputs == ((5, 6, 7),) and call.pool == Pooling("last", True, 4)
    (item,) = r.json()["data"]
    assert base64.b64decode(item["embedding"]) == vec(0.25, 0.75, 0, 1)
    assert r.json()["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def test_the_bounds_of_the_models_embed_settings_are_400s_naming_the_input(router, handles):
    with routed(router) as c:
        cases = [
            (embed(c, input=["a", "b", "c", "d"]), ("input", "INVALID_REQUEST"), "4 inputs"),
            (embed(c, input=["a", "x" * 33]), ("input.1", "INVALID_REQUEST"), "33 tokens; the most one input may"),
            (embed(c, input=["x" * 30, "y" * 11]), ("input", "INVALID_REQUEST"), "more than 40 tokens in all"),
            (embed(c, input=[[1], [256]]), ("input.1", "INVALID_REQUEST"), "256 is not a token id"),
            (embed(c, input=[300]), ("input", "INVALID_REQUEST"), "300 is not a token id"),
            (embed(c, input="a", dimensions=8), ("dimensions", "INVALID_REQUEST"), "its sizes: 4"),
            (embed(c, input="a", model="writer"), ("model", "INVALID_REQUEST"), "a generating model"),
            (embed(c, input="a", model="nope"), (None, "model_not_found"), "does not exist"),
        ]
        for r, (field, code), says in cases:
            assert refusal(r) == (404 if code == "model_not_found" else 400, field, code), r.text
            assert says in r.json()["error"]["message"], r.text
    assert handles["embedder"].generate.calls == []  # refused before any work


def test_an_input_past_the_context_is_context_length_exceeded():
    cfg = {**CFG, "models": [CFG["models"][0], {**CFG["models"][1], "embed": {"max_request_tokens": 1000}}]}
    handles = {"writer": FakeHandle(), "embedder": FakeHandle()}
    r = build_router(cfg, handles)
    at_level(r, 0)
    with routed(r) as c:
        several = embed(c, input=["a", "x" * 65])
        one = embed(c, input="x" * 65)
    assert refusal(several) == (400, "input.1", "CONTEXT_LENGTH_EXCEEDED")
    assert "context is 64 tokens and the input is 65" in several.json()["error"]["message"]
    assert refusal(one) == (400, "input", "CONTEXT_LENGTH_EXCEEDED")  # the only input: the whole field


def test_a_text_route_naming_an_embeddings_model_is_refused_naming_model(router, handles):
    with routed(router) as c:
        chat = c.post(
            "/v1/chat/completions",
            headers=GOLD,
            json={"model": "embedder", "messages": [{"role": "user", "content": "hi"}]},
        )
        completion = c.post("/v1/completions", headers=GOLD, json={"model": "embedder", "prompt": "hi"})
        native = c.post("/v1/generate", headers=GOLD, json={"model": "embedder", "prompt": "hi"})
        listed = [m["id"] for m in c.get("/v1/models", headers=GOLD).json()["data"]]
    assert refusal(chat) == refusal(completion) == (400, "model", "INVALID_REQUEST")
    assert "an embeddings model: it answers POST /v1/embeddings alone" in chat.json()["error"]["message"]
    assert native.status_code == 422 and native.json()["error"]["field"] == "model"  # the native front's status
    assert listed == ["writer", "embedder"]
    assert handles["embedder"].generate.calls == []


def test_the_quota_is_charged_the_inputs_tokens_at_the_models_cost(router, handles):
    bucket = router.pipeline.quotas.buckets["gold"]
    before = bucket.tokens
    handles["embedder"].generate.script.append(vectors(vec(1), vec(1)))
    with routed(router) as c:
        assert embed(c, input=["abcd", "efghij"]).status_code == 200
    assert before - bucket.tokens == pytest.approx(3.0 * 10, abs=1e-3)  # 10 tokens at 3 each, nothing generated


def test_an_embeddings_answer_is_not_kept_in_the_answer_cache(handles):
    r = build_router({**CFG, "resilience": {"cache": {"enabled": True}}}, handles)  # bounded in entries, not bytes
    at_level(r, 0)
    handles["embedder"].generate.script.append(vectors(vec(1)))
    handles["writer"].generate.script.append(FakeResponse(0, result=ModelResult("ok", 1, "stop")))
    with routed(r) as c:
        assert embed(c, input="a").status_code == 200
        assert c.post("/v1/completions", headers=GOLD, json={"model": "writer", "prompt": "a"}).status_code == 200
    assert len(r.pipeline.lanes["embedder"].caller.cache) == 0 and len(r.pipeline.lanes["writer"].caller.cache) == 1


def test_an_answer_of_another_count_of_vectors_is_no_answer(router, handles):
    handles["embedder"].generate.script.append(vectors(vec(1)))
    with routed(router) as c:
        r = embed(c, input=["a", "b"])
    assert r.status_code == 503 and r.json()["error"]["code"] == "MODEL_UNAVAILABLE"
    assert "1 vectors for 2 inputs" in r.json()["error"]["message"]


def test_a_batch_line_is_checked_and_answered_as_the_online_call(router, handles):
    handles["embedder"].generate.script.append(vectors(vec(2, 0)))
    caller = Caller("gold", Deadline.starting(time.monotonic(), 30.0))
    batches = router._batches
    assert batches.check_line({"model": "embedder", "input": "ab"}, "/v1/embeddings", caller) == "embedder"
    with pytest.raises(InvalidRequest) as e:
        batches.check_line({"model": "writer", "input": "ab"}, "/v1/embeddings", caller)
    assert e.value.field == "model"
    with pytest.raises(InvalidRequest) as e:
        batches.check_line({"model": "embedder", "prompt": "ab"}, "/v1/completions", caller)
    assert e.value.field == "model"

    body = asyncio.run(batches.run_line(caller, {"model": "embedder", "input": "ab"}, "/v1/embeddings", GateSlot(None)))
    assert body["data"] == [{"object": "embedding", "index": 0, "embedding": [2.0, 0.0]}]
    assert body["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    (call,) = handles["embedder"].generate.calls
    assert isinstance(call, ModelCall) and call.inputs == ((97, 98),) and call.priority > 0  # after interactive rows


# --------------------------------------------------------------- a Hugging Face tokenizer


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from ballast.model.demo import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("embed") / "tiny-llama")


def test_a_text_is_tokenized_with_the_models_special_tokens_as_vllm_does(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)
    model = {"name": "embedder", "kind": "embed", "backend": "transformers", "path": str(tiny_llama)}
    handle = FakeHandle(vectors(vec(1), vec(1)))
    r = build_router({**CFG, "models": [model]}, {"embedder": handle})
    at_level(r, 0)
    texts = ["The quick brown fox", "jumps"]
    with routed(r) as c:
        resp = embed(c, input=texts, dimensions=None)
    assert resp.status_code == 200, resp.text
    (call,) = handle.generate.calls
    expected = tuple(tuple(tok.encode(t)) for t in texts)  # add_special_tokens: the bos first
    assert call.inputs == expected and expected[0][0] == tok.bos_token_id
    assert call.tokenizer.startswith("hf:")
    assert resp.json()["usage"]["prompt_tokens"] == sum(len(ids) for ids in expected)


# ---------------------------------------------------------------------- the config


def test_an_embeddings_models_fallback_embeds_alike_or_the_config_is_refused():
    def fallback(**model: Any) -> dict[str, Any]:
        embed = {"name": "e", "kind": "embed", "fallback": {"model": {"name": "f", **model}}}
        return {"models": [{"name": "g"}, embed]}

    load_config(fallback(kind="embed"))  # the same builtin weights, pooling and sizes
    for model, says in (
        ({}, "kind 'generate', its model's is 'embed'"),
        ({"kind": "embed", "seed": 7}, "an embeddings model's fallback serves the same weights"),
        ({"kind": "embed", "embed": {"pooling": "mean"}}, "embed: dimensions, normalize, pooling as its model's"),
        ({"kind": "embed", "embed": {"dimensions": [8]}}, "embed: dimensions, normalize, pooling"),
    ):
        with pytest.raises(ValueError) as e:
            load_config(fallback(**model))
        assert "models[1].fallback.model: " + says in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:
        load_config({"models": [{"name": "e", "kind": "embed"}], "fallback": {"model": {"name": "f"}}})
    assert "fallback.model: kind 'generate', its model's is 'embed'" in str(e.value)
    with pytest.raises(ValueError) as e:
        load_config({"models": [{"name": "g"}], "fallback": {"model": {"name": "f", "kind": "embed"}}})
    assert "fallback.model: kind 'embed', its model's is 'generate'" in str(e.value)
