"""The stack serving a Hugging Face directory: a tiny random Llama built here, no download.

For this module the session's stack is replaced by one whose primary model is
``backend: transformers`` on that directory (the fallback stays the built-in
model), and put back after. Through the real HTTP endpoint and the official
``openai`` client: usage in the model's tokens, its chat template, the context
refused with a 400, greedy and seeded answers reproducible, streams equal to
unary answers, stop strings, shedding under overload and a recycle under load.
"""

from __future__ import annotations

import conftest as integration
import httpx
import openai
import pytest
from conftest import ADMIN, BASE, GOLD, _deploy, _merge

from ballast.model.demo import make_tiny_llama

pytestmark = pytest.mark.integration
# Deploys a stack of its own and leaves it running (conftest.py: the default comes back once).
OWN_STACK = True

MODEL = "tiny-llama"
KEY = GOLD["Authorization"].split()[1]


@pytest.fixture(scope="module")
def hf_stack(ballast, tmp_path_factory):
    from ballast.config import load_config

    ckpt = make_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    over = {"model": {"name": MODEL, "backend": "transformers", "path": str(ckpt)}}
    _deploy(load_config(_merge(integration.test_config_dict(), over)), MODEL)
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

    recycle_under_load(http, "HF", 120)


def test_log_probabilities_and_choices_are_the_models_own(oai, tok, hf_stack):
    from logprob_reference import check_served_logprobs

    check_served_logprobs(oai, MODEL, tok, hf_stack)
