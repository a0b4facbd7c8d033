"""The stack serving a Hugging Face directory: a tiny random Llama built here, no download.

For this module the session's stack is replaced by one whose primary model is
``backend: transformers`` on that directory (the fallback stays the built-in
model), beside an embeddings model (``kind: embed``) on the same directory, and put
back after. Through the real HTTP endpoint and the official ``openai`` client: usage
in the model's tokens, its chat template, the context refused with a 400, greedy and
seeded answers reproducible, streams equal to unary answers, stop strings, shedding
under overload and a recycle under load; ``/v1/embeddings`` as the client calls it
(base64 by default, floats, token ids, ``dimensions``, usage, its 400s), online and in
a batch.
"""

from __future__ import annotations

import io
import json
import math

import conftest as integration
import httpx
import openai
import pytest
from conftest import ADMIN, BASE, GOLD, _deploy, _merge, wait_until

from ballast.model.demo import make_tiny_llama

pytestmark = pytest.mark.integration
# Deploys a stack of its own and leaves it running (conftest.py: the default comes back once).
OWN_STACK = True

MODEL = "tiny-llama"
EMBED = "tiny-llama-embed"  # the same directory as an embeddings model (last-token pooling, normalised)
EMBED_SIZES = [16]  # a shorter vector it may give (the model's own is its hidden size, 32)
EMBED_MAX_INPUTS = 4
KEY = GOLD["Authorization"].split()[1]


@pytest.fixture(scope="module")
def hf_stack(ballast, tmp_path_factory):
    from ballast.config import load_config

    ckpt = make_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    settings = _merge(integration.test_config_dict(), {"model": {"name": MODEL, "backend": "transformers"}})
    settings["model"]["path"] = str(ckpt)
    embed = {
        "name": EMBED,
        "kind": "embed",
        "backend": "transformers",
        "path": str(ckpt),
        "embed": {"dimensions": EMBED_SIZES, "max_inputs": EMBED_MAX_INPUTS},
        "deployment": {"min_replicas": 1, "max_replicas": 1},
    }
    settings["models"] = [settings["model"], embed]
    settings["batch"] = ballast.batch.model_dump(mode="json")  # the session's store: batches run here too
    _deploy(load_config(settings), EMBED)
    yield ckpt


@pytest.fixture(scope="module")
def tok(hf_stack):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_stack, local_files_only=True)


@pytest.fixture
def oai(hf_stack):
    with openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(hf_stack):
    with httpx.Client(base_url=BASE, timeout=60) as c:
        yield c


def test_models_lists_the_checkpoint_by_its_name(oai):
    assert MODEL in [m.id for m in oai.models.list().data]


def test_chat_usage_is_the_templated_prompt_in_the_models_tokens(oai, tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert r.usage.prompt_tokens < len(rendered.encode())  # tokens, not bytes
    choice = r.choices[0]
    assert 1 <= r.usage.completion_tokens <= 12
    assert choice.finish_reason == ("length" if r.usage.completion_tokens == 12 else "stop")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_completion_counts_its_bos_and_native_generate_answers(oai, http, tok):
    r = oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8)
    assert r.usage.prompt_tokens == len(tok.encode("The quick brown fox"))  # bos included
    n = http.post("/v1/generate", headers=GOLD, json={"prompt": "The quick brown fox", "max_tokens": 8})
    assert n.status_code == 200, n.text
    body = n.json()
    assert body["model"] == MODEL and 1 <= body["tokens_generated"] <= 8
    assert body["text"] == r.choices[0].text  # greedy: the same answer on both fronts


def test_prompt_and_max_tokens_past_the_context_are_refused_with_400_before_any_work(oai, http):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=126)
    assert e.value.status_code == 400 and e.value.code == "CONTEXT_LENGTH_EXCEEDED"
    assert "context is 128 tokens" in e.value.message
    r = http.post("/v1/generate", headers=GOLD, json={"prompt": "word " * 200, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "CONTEXT_LENGTH_EXCEEDED"


def test_a_stream_is_the_unary_answer_and_ends_with_usage(oai):
    kw = dict(model=MODEL, prompt="A replica serves requests", max_tokens=20)
    unary = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == unary.choices[0].text
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == unary.choices[0].finish_reason


def test_the_same_seed_gives_the_same_text_and_another_seed_another(oai):
    kw = dict(model=MODEL, prompt="Hello!", max_tokens=24, temperature=1.0, top_p=0.95)
    a = oai.completions.create(**kw, seed=5).choices[0].text
    assert oai.completions.create(**kw, seed=5).choices[0].text == a
    others = {oai.completions.create(**kw, seed=s).choices[0].text for s in (6, 7, 8)}
    assert others != {a}


def test_a_stop_string_ends_the_answer_where_it_starts(oai):
    kw = dict(model=MODEL, prompt="Tokens per second", max_tokens=30)
    full = oai.completions.create(**kw)
    text = full.choices[0].text
    if len(text) < 6:
        pytest.skip(f"greedy text too short to cut: {text!r}")
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = oai.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens  # the model stopped there


def test_the_replica_reports_its_kv_reservation(hf_stack):
    from ray import serve

    report = serve.get_deployment_handle("BallastModel", "ballast").stats.remote().result()
    assert report["kv_tokens_budget"] == 32 * 128  # max_batch_size x the context
    assert report["kv_tokens_reserved"] == 0 and report["kv_util_pct"] == 0  # nothing in flight
    # ... and the operator sees it per replica.
    rows = httpx.get(f"{BASE}/admin/replicas", headers=ADMIN, timeout=10).json()["replicas"]
    mine = [r for r in rows if r["deployment"] == "BallastModel"]
    assert mine and all(r["kv_tokens_budget"] == 32 * 128 and r["kv_util_pct"] is not None for r in mine), mine


def test_overload_sheds_sheddable_and_critical_keeps_succeeding(hf_stack):
    from test_overload import run_load

    result = run_load({"critical": 12, "sheddable": 12}, duration_s=10, max_tokens=24)
    critical, sheddable = result.by("critical"), result.by("sheddable")
    assert set(critical) == {(200, "OK")}, critical
    assert sheddable[(503, "OVERLOADED")] > 0, sheddable


def test_recycling_the_hf_replica_under_load_fails_no_request(http):
    from test_recycling import recycle_under_load

    recycle_under_load(http, "HF", 120, MODEL)  # the stack serves an embeddings model beside it


def test_log_probabilities_and_choices_are_the_models_own(oai, tok, hf_stack):
    from logprob_reference import check_served_logprobs

    check_served_logprobs(oai, MODEL, tok, hf_stack)


# ------------------------------------------------------------------ /v1/embeddings


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_embeddings_answer_every_input_as_the_openai_client_asks(oai, tok):
    texts = ["The quick brown fox", "jumps over the lazy dog", "A replica serves requests"]
    b64 = oai.embeddings.create(model=EMBED, input=texts)  # the client asks base64 and decodes it
    floats = oai.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    assert b64.model == floats.model == EMBED
    assert [d.index for d in b64.data] == [d.index for d in floats.data] == [0, 1, 2]
    for a, b in zip(b64.data, floats.data):
        assert len(a.embedding) == 32 and a.embedding == pytest.approx(b.embedding, abs=1e-6)
        assert norm(a.embedding) == pytest.approx(1.0, abs=1e-4)  # normalised
    assert floats.data[0].embedding != pytest.approx(floats.data[1].embedding, abs=1e-3)  # inputs differ
    tokens = sum(len(tok.encode(t)) for t in texts)  # the model's tokens, its bos included
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (tokens, tokens)

    ids = oai.embeddings.create(model=EMBED, input=[tok.encode(t) for t in texts], encoding_format="float")
    one = oai.embeddings.create(model=EMBED, input=texts[0], encoding_format="float")
    for a, b in zip(ids.data, floats.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-5)  # the same ids as the text's
    assert one.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-5)  # alone or beside others


def test_dimensions_give_the_first_of_the_vector_normalised(oai):
    full = oai.embeddings.create(model=EMBED, input="The quick brown fox", encoding_format="float").data[0].embedding
    short = oai.embeddings.create(model=EMBED, input="The quick brown fox", dimensions=16).data[0].embedding
    head = full[:16]
    assert len(short) == 16 and short == pytest.approx([x / norm(head) for x in head], abs=1e-5)


def test_embeddings_refusals_are_400s_naming_the_field(oai):
    cases = [
        (dict(model=EMBED, input="x", dimensions=8), "dimensions", "INVALID_REQUEST"),
        (dict(model=EMBED, input=["x"] * (EMBED_MAX_INPUTS + 1)), "input", "INVALID_REQUEST"),
        (dict(model=EMBED, input="word " * 200), "input", "CONTEXT_LENGTH_EXCEEDED"),
        (dict(model=EMBED, input=[[1], [10**6]]), "input.1", "INVALID_REQUEST"),
        (dict(model=EMBED, input=""), "input", "INVALID_REQUEST"),
        (dict(model=MODEL, input="x"), "model", "INVALID_REQUEST"),  # a generating model
    ]
    for kw, param, code in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.embeddings.create(**kw)
        assert (e.value.status_code, e.value.code, e.value.param) == (400, code, param), (kw, e.value.message)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert (e.value.code, e.value.param) == ("INVALID_REQUEST", "model")
    assert EMBED in [m.id for m in oai.models.list().data]


def test_a_batch_of_embeddings_lines_answers_each_as_online(oai):
    texts = ["batch embeddings one", "batch embeddings two"]
    lines = [
        {"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": EMBED, "input": t}}
        for i, t in enumerate(texts)
    ]
    lines.append(
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "x"}}
    )
    data = "\n".join(json.dumps(x) for x in lines).encode() + b"\n"
    file_id = oai.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    done = wait_until(
        lambda: (b := oai.batches.retrieve(batch.id)).status in ("completed", "failed") and b, 90, 0.5, "the batch"
    )
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = [json.loads(x) for x in oai.files.content(done.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in oai.files.content(done.error_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["e-0", "e-1"] and [x["custom_id"] for x in err] == ["bad"]
    online = oai.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    for x, want in zip(out, online.data):
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["model"] == EMBED
        assert body["data"][0]["embedding"] == pytest.approx(want.embedding, abs=1e-5)
