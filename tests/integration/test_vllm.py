"""The stack serving a Hugging Face directory with vLLM (its CPU build), no download.

For this module the session's stack is replaced by one whose primary model is
``backend: vllm`` on a tiny random Llama built here (a head size vLLM's CPU attention
serves), and put back after. vLLM starts once, for the module. Through the real HTTP
endpoint and the official ``openai`` client: usage in the model's tokens through its
chat template, unary and streamed answers, stop strings, seeded answers that repeat,
a 400 past the context, vLLM's own sampling extensions, JSON that follows a
``response_format`` schema (and a schema vLLM refuses: a 400 that costs the model
nothing), tool calls read by vLLM's hermes parser (a named function and "required" in
the model's own format by a structural tag, streamed in pieces as the unary answer, a
schema with $defs, "auto", the parser's id and a tool's result sent back), a client that leaves
freeing the engine's slot, shedding under overload with critical whole, a stalled
replica killed with its engine's processes, and a recycle under load.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("vllm")

import conftest as integration  # noqa: E402
from conftest import ADMIN, BASE, FREE, GOLD, _deploy, _merge, model_status, wait_until  # noqa: E402

from ballast.model.demo import VLLM_GEOMETRY, make_llama  # noqa: E402
from ballast.ops.status_text import model_view  # noqa: E402

pytestmark = pytest.mark.integration
# Deploys a stack of its own and leaves it running (conftest.py: the default comes back once).
OWN_STACK = True

MODEL = "tiny-vllm"
KEY = GOLD["Authorization"].split()[1]
NOISY = {"Authorization": "Bearer dev-key-noisy"}


def vllm_overrides(ckpt) -> dict:
    # One engine at a time (the autoscaler would start a second on these 2 cores).
    # The watchdog's memory limit fits a vLLM replica: three processes (the replica,
    # vLLM's engine core and its worker) over 2 GB together, where the suite's limit is
    # sized for one process of the built-in engine.
    return {
        "deployments": {"model": {"max_replicas": 1}},
        "watchdog": {"rss_limit_mb": 6000},
        # Prefix caches by group: gold alone (its own, the default), free and noisy in one.
        "tenants": {
            "free": {"cache_group": "team"},
            "noisy": {"cache_group": "team", "rate_tokens_per_s": None, "burst_tokens": None},
        },
        "model": {
            "name": MODEL,
            "backend": "vllm",
            "path": str(ckpt),
            "max_batch_size": 8,
            "tool_parser": "hermes",
            # the KV cache: Ballast's CPU default; compact guided JSON, so that random weights end it
            "engine_kwargs": {
                "dtype": "float32",
                "enforce_eager": True,
                "max_model_len": 512,
                "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
            },
        },
    }


@pytest.fixture(scope="module")
def vllm_stack(ballast, tmp_path_factory):
    from ballast.config import load_config

    ckpt = make_llama(tmp_path_factory.mktemp("vllm") / MODEL, **VLLM_GEOMETRY)
    settings = _merge(integration.test_config_dict(), vllm_overrides(ckpt))
    settings["batch"] = ballast.batch.model_dump(mode="json")  # the session's store: stored responses
    _deploy(load_config(settings), MODEL)
    yield ckpt


@pytest.fixture(scope="module")
def tok(vllm_stack):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_stack, local_files_only=True)


@pytest.fixture
def oai(vllm_stack):
    with openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(vllm_stack):
    with httpx.Client(base_url=BASE, timeout=60) as c:
        yield c


def replica(http) -> dict:
    """The primary replica's last report, as the controller has it."""
    rows = http.get("/admin/replicas", headers=ADMIN).json()["replicas"]
    return next(r for r in rows if r["deployment"] == "BallastModel")


def test_chat_usage_is_the_templated_prompt_in_the_models_tokens(oai, tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 12 else "stop")


def test_a_stream_is_the_unary_answer_and_ends_with_usage(oai):
    kw = dict(model=MODEL, prompt="A replica serves requests", max_tokens=20)
    unary = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unary.choices[0].text
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens


def cached_tokens(http, headers: dict, prompt: str, stream: bool = False) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of one answer to ``prompt`` (streamed with
    the usage in a last event, or unary)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    r = http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prefix_is_shared_within_a_cache_group_and_never_across(http):
    # The prefix-cache side channel, probed as an attacker would, on one replica (every probe
    # meets the victim's KV): the victim (gold) sends a prompt; the attacker (free, another
    # group) sends the same prompt and reads how much came from the cache: vLLM's own count
    # says nothing did, where a hit would have skipped the prefill. Within one group (free
    # and noisy) the prefix is shared, unary and streamed.
    secret = "Victim's templated prompt, account 4417-2208, balance and notes follow. " * 6
    got = [
        cached_tokens(http, GOLD, secret),  # new
        cached_tokens(http, GOLD, secret),  # its own group's blocks
        cached_tokens(http, FREE, secret),  # another group's: none
        cached_tokens(http, FREE, secret + " again", stream=True),  # its own, streamed
        cached_tokens(http, NOISY, secret, stream=True),  # its group-mate's
        cached_tokens(http, GOLD, secret),  # and the victim's are still its own
    ]
    assert got[0] == 0 and got[1] > 0 and got[2] == 0, got
    assert got[3] > 0 and got[4] > 0 and got[5] == got[1], got


def test_the_same_seed_gives_the_same_text(oai):
    kw = dict(model=MODEL, prompt="Hello!", max_tokens=24, temperature=1.0, top_p=0.95)
    a = oai.completions.create(**kw, seed=5).choices[0].text
    assert oai.completions.create(**kw, seed=5).choices[0].text == a
    assert {oai.completions.create(**kw, seed=s).choices[0].text for s in (6, 7, 8)} != {a}


def test_a_stop_string_ends_the_answer_where_it_starts(oai):
    kw = dict(model=MODEL, prompt="Tokens per second", max_tokens=30, extra_body={"ignore_eos": True})
    text = oai.completions.create(**kw).choices[0].text
    assert len(text) >= 6, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = oai.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_vllms_extensions_are_honoured(oai):
    # ignore_eos: every token asked for; repetition_penalty is vLLM's to honour.
    r = oai.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=16,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "top_k": 5, "min_tokens": 4},
    )
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_penalties_and_logit_bias_reach_vllms_sampling(oai, tok):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias are vLLM's to honour: a
    bias of 100 on one token makes a greedy answer that token, every time."""
    token = tok.encode(" the", add_special_tokens=False)[-1]
    r = oai.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tok.decode([token] * 6)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logit_bias={str(len(tok) + 5): 1})
    assert e.value.code == "INVALID_REQUEST" and "logit_bias" in e.value.message


def test_past_the_context_is_a_400_before_any_work(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=511)
    assert e.value.code == "CONTEXT_LENGTH_EXCEEDED" and "context is 512 tokens" in e.value.message


VERDICT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_response_format_gives_json_that_follows_it(oai, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
    messages = [{"role": "user", "content": "Is the sky green? Answer in JSON."}]
    if stream:
        chunks = oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, response_format=fmt, temperature=1.0, seed=3, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, response_format=fmt, temperature=1.0, seed=3
        )
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"  # the grammar ended it, not max_tokens
    value = json.loads(text)
    assert set(value) == {"ok", "colour"} and isinstance(value["ok"], bool) and value["colour"] in ("red", "green")


def test_a_schema_the_engine_refuses_is_a_400_that_costs_the_model_nothing(oai, http):
    def model_failures() -> dict:
        return model_status(http)["breakers"]["primary"]["failed_attempts"]

    before = model_failures()
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "either", "schema": {"allOf": [{"type": "string"}, {"enum": ["a", "b"]}]}},
    }
    for stream in (False, True):
        # unary: a 400; a stream has begun (200) and carries it as its error event
        with pytest.raises(openai.APIError) as e:
            r = oai.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
                response_format=fmt,
                stream=stream,
            )
            list(r) if stream else None
        assert isinstance(e.value, openai.BadRequestError) != stream
        assert e.value.code == "ENGINE_REFUSED" and "response_format" in e.value.message
    assert model_failures() == before  # no retry, no breaker failure: the request, not the model
    ok = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert ok.usage.completion_tokens >= 1


# Small (the test tokenizer spends a token on most JSON characters: two tools make a
# prompt of 438 tokens of the 512), with values from enums and a boolean, so that random
# weights end the arguments within max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
            "required": ["city", "metric"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _weather_args(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "metric"} and value["city"] in ("Paris", "Oslo") and isinstance(value["metric"], bool)


def _reassembled(chunks) -> list[dict]:
    """A streamed answer's calls as the client reassembles them: by index, id and name
    from the first delta, the argument fragments joined."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def test_a_named_tool_is_called_with_arguments_that_follow_its_schema_streamed_as_unary(oai):
    # The call is written in the model's own format (hermes: <tool_call>{"name": ..., "arguments":
    # ...}</tool_call>, ~80 tokens of the test tokenizer): one tool leaves it room in the context.
    asked = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=160,
        temperature=1.0,
        seed=2,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    r = oai.chat.completions.create(**asked)
    message = r.choices[0].message
    assert not message.content and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    _weather_args(call.function.arguments)
    assert r.choices[0].finish_reason == "stop"  # OpenAI's finish for a forced call
    # Streamed: the call in pieces (id and name first, then argument fragments), the same call.
    chunks = list(oai.chat.completions.create(**asked, stream=True))
    streamed = _reassembled(chunks)
    # The same call; its JSON the same value (vLLM's hermes parser streams the model's text and
    # writes the unary arguments out again with json.dumps, as `vllm serve` does).
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        ("weather", json.loads(call.function.arguments))
    ]
    fragments = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert len(fragments) > 2 and fragments[0].id is not None and all(d.id is None for d in fragments[1:])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_responses_function_call_is_answered_on_the_next_turn_streamed_in_order(oai):
    # The Responses API on the chat path: a forced call as a function_call item, its result
    # sent back by previous_response_id, the model's answer a message; streamed, the call's
    # arguments in pieces between its item's added and done events.
    tool = {"type": "function", "name": "weather", "parameters": WEATHER["function"]["parameters"]}
    asked = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=160,
        temperature=1.0,
    )
    first = oai.responses.create(**asked)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "weather" and first.status == "completed"
    _weather_args(call.arguments)
    answer = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "20 degrees"}],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert [item.type for item in answer.output] == ["message"] and answer.previous_response_id == first.id
    # The stored turns prefilled again: the call and its result are in this prompt.
    assert answer.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    events = list(oai.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    pieces = [i for i, k in enumerate(kinds) if k == "response.function_call_arguments.delta"]
    done = kinds.index("response.function_call_arguments.done")
    assert pieces and added < pieces[0] and pieces[-1] < done < kinds.index("response.output_item.done")
    arguments = "".join(events[i].delta for i in pieces)
    assert json.loads(arguments) == json.loads(events[done].arguments)
    _weather_args(arguments)


def test_required_tool_calls_stream_in_pieces_and_end_with_tool_calls(oai):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=160,
            temperature=1.0,
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    calls = _reassembled(chunks)
    assert len(calls) == 1 and calls[0]["name"] == "time"
    assert json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens >= 1


def test_a_schema_with_defs_is_followed_under_required(oai):
    """A pydantic-made schema refers to its own $defs: each call's arguments follow it."""
    book = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {"room": {"$ref": "#/$defs/Room"}},
                "required": ["room"],
                "additionalProperties": False,
                "$defs": {"Room": {"enum": ["red", "blue"]}},
            },
        },
    }
    r = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[book],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=1.0,
        seed=3,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "book" and json.loads(call.function.arguments)["room"] in ("red", "blue")
    assert r.choices[0].finish_reason == "tool_calls"


def test_the_parsers_call_id_is_taken_back_on_the_next_turn(oai):
    first = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=160,
        temperature=1.0,
        seed=2,
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    (call,) = first.choices[0].message.tool_calls
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "20 degrees and sunny"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_tools_result_goes_back_to_the_model_and_auto_answers_through_the_parser(oai, tok):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris", "metric": true}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "20 degrees and sunny"},
    ]
    # tool_choice auto (the default): vLLM's hermes parser reads the answer; random
    # weights write no call, so the answer is its text.
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    turns = copy.deepcopy(messages)
    turns[1]["tool_calls"][0]["function"]["arguments"] = {
        "city": "Paris",
        "metric": True,
    }  # as vLLM hands them to templates
    rendered = tok.apply_chat_template(turns, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))  # the template saw it all


AGENTS_PYTHON = Path(__file__).resolve().parents[2] / ".venv-agents" / "bin" / "python"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_real_agent_calls_a_local_tool_and_finishes(vllm_stack, api):
    """The openai-agents SDK (its own environment, tests/integration/agent_client.py), unary
    and streamed, on chat completions and on its default model class (the Responses API):
    the agent's tool call reaches its Python function and the run finishes."""
    import subprocess

    if not AGENTS_PYTHON.exists():
        pytest.fail(f"{AGENTS_PYTHON} is missing: `make test` installs it (requirements/agents.txt)")
    run = subprocess.run(
        [str(AGENTS_PYTHON), str(Path(__file__).with_name("agent_client.py")), BASE, KEY, MODEL, api],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for mode in ("unary", "streamed"):
        calls, final = out[mode]["calls"], out[mode]["final"]
        assert len(calls) == 1 and calls[0] in ("Paris", "Oslo"), out
        assert final == f"20 degrees and sunny in {calls[0]}", out


def test_vllms_own_ttft_and_itl_reach_rays_metrics_export(oai):
    """vLLM's engine metrics, as ray.serve.llm exports them, labelled with the model's name:
    what Prometheus scrapes beside Ballast's own (the overview dashboard's vLLM panels). The
    preemptions counter has a series once vLLM preempts a request (none does here)."""
    oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4)

    def exported() -> str:
        targets = json.loads(Path("/tmp/ray/prom_metrics_service_discovery.json").read_text())
        texts = []
        for url in (f"http://{t}/metrics" for group in targets for t in group["targets"]):
            try:
                texts.append(httpx.get(url, timeout=5).text)
            except httpx.HTTPError:  # a node's agent not (or no longer) listening
                pass
        return "\n".join(texts)

    wanted = ("ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_inter_token_latency_seconds_bucket")
    wait_until(lambda: all(f"{w}{{" in exported() for w in wanted), 45, 1, "vLLM's metrics exported")
    text = exported()
    line = next(x for x in text.splitlines() if x.startswith("ray_vllm_time_to_first_token_seconds_count"))
    assert f'model_name="{MODEL}"' in line


def test_a_client_that_leaves_frees_its_slot_in_the_engine(http):
    body = {"prompt": "Hello", "max_tokens": 200, "stream": True}
    with http.stream("POST", "/v1/generate", headers=GOLD, json={**body, "max_tokens": 200}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: token"):
                break  # the first token came: the row is in the engine; leave
    # The router aborts the call, the replica aborts the row in vLLM: nothing runs there.
    wait_until(lambda: replica(http)["running"] == 0, 30, 0.5, "the replica's rows back to 0")
    assert replica(http)["engine_waiting"] == 0


def test_the_replica_reports_the_engines_own_kv_and_prefix_cache(http, oai):
    prompt = "The same long prompt, again and again, " * 8
    for _ in range(3):
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    time.sleep(1.5)  # a report interval
    row = replica(http)
    assert row["kv_tokens_budget"] is None  # vLLM's own KV cache, not Ballast's budget
    assert row["prefix_cache_hit_pct"] > 0


def test_overload_sheds_sheddable_and_keeps_critical_whole_on_vllm(http):
    # The engine must be the bottleneck, not the router's HTTP on these two cores: rows of
    # 96 tokens, at most 4 in the engine at a time (the level's batch limit), 24 clients
    # where the replica takes 16, so Ballast's line in front of the engine passes the
    # level's thresholds (6, then 12) and the level sheds sheddable at the gate.
    from test_overload import run_load

    wait_until(lambda: model_status(http)["level"] == 0, 30, 0.5, "level back to 0")
    levels: list[int] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=BASE, timeout=10) as c:
            while not done.is_set():
                levels.append(model_view(c.get("/v1/status", headers=ADMIN).json(), MODEL)["level"])
                time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_load({"critical": 12, "sheddable": 12}, duration_s=12, max_tokens=96)
    finally:
        done.set()
        watcher.join(timeout=5)
    critical, sheddable = result.by("critical"), result.by("sheddable")
    seen = f"levels seen {sorted(set(levels))}; critical {dict(critical)}; sheddable {dict(sheddable)}"
    print(seen)
    assert max(levels) >= 1, seen
    assert set(critical) == {(200, "OK")} and critical[(200, "OK")] >= 10, seen
    assert sheddable[(503, "OVERLOADED")] > 0 and set(sheddable) <= {(200, "OK"), (503, "OVERLOADED")}, seen
    wait_until(lambda: model_status(http)["level"] == 0, 30, 0.5, "level back to 0")


def engine_processes() -> dict[int, list[int]]:
    """The vLLM replica's process (Ray titles it) and the engine processes under it."""
    import psutil

    out = {}
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [""])[0].startswith("ray::ServeReplica:ballast:BallastModel"):
            try:
                out[p.pid] = [c.pid for c in p.children(recursive=True)]
            except psutil.Error:
                continue
    return out


def test_a_stalled_vllm_replica_is_killed_and_leaves_no_engine_process(http, oai):
    # Chaos works on a vLLM replica as on any: its work loop stalls with work in flight,
    # the watchdog (watching the engine's processes with it) says so, the controller
    # kills it, and vLLM's engine core and worker go with it.
    import psutil
    from test_recycling import events, ids

    (rid,) = ids(http, "BallastModel")
    (engine,) = engine_processes().values()
    assert len(engine) >= 2  # vLLM's engine core and, on CPU, its worker
    r = http.post("/admin/chaos", headers=ADMIN, json={"target": "primary", "stall": True})
    assert r.status_code == 200, r.text
    try:
        integration.wait_chaos(http, "primary", {"stall": True})
        stuck = [
            threading.Thread(
                target=lambda: httpx.post(
                    f"{BASE}/v1/generate",
                    headers={**GOLD, "X-Request-Timeout-Ms": "15000"},
                    json={"prompt": "stall", "max_tokens": 8},
                    timeout=30,
                ),
                daemon=True,
            )
        ]
        stuck[0].start()
        (killed,) = wait_until(
            lambda: [e for e in events(http, "killed_hung") if e["replica_id"] == rid],
            30,
            0.3,
            "the stalled vLLM replica killed",
        )
    finally:
        http.delete("/admin/chaos", headers=ADMIN)
    assert killed["reason"] == "stalled", killed
    wait_until(lambda: not any(psutil.pid_exists(p) for p in engine), 30, 0.5, "the engine's processes gone with it")
    wait_until(lambda: ids(http, "BallastModel") - {rid}, 120, 1.0, "a replacement replica")

    def vllm_answers() -> bool:  # not the fallback model, which answers meanwhile
        try:
            return oai.completions.create(model=MODEL, prompt="Hello", max_tokens=2).model == MODEL
        except openai.APIError:
            return False

    wait_until(vllm_answers, 120, 1.0, "the replacement vLLM replica serving")
    stuck[0].join(timeout=30)


def test_recycling_the_vllm_replica_under_load_fails_no_request(vllm_stack, http):
    # Recycled as production recycles (recycle.surge on, min_available 1, the default
    # recycle_timeout_s): a surge replica starts its own engine and serves while the
    # recycled one drains, and its replacement starts beside it. The suite's own settings
    # (no surge, min_available 0) let the only replica go before its replacement serves;
    # a vLLM replica takes 20-55 s to start here, as long as a request's deadline, so
    # requests would wait out their deadline. The autoscaler keeps to one replica (a
    # target no test load reaches): the second place under max_replicas is the surge's.
    from test_recycling import recycle_under_load

    from ballast.config import RecycleSettings, load_config

    production = RecycleSettings()
    surge = {
        "recycle": {
            "surge": production.surge,
            "min_available": production.min_available,
            "recycle_timeout_s": production.recycle_timeout_s,
        },
        "autoscale": {"target_ongoing_requests": 1000},
        "deployments": {"model": {"max_replicas": 2}},
    }
    _deploy(load_config(_merge(_merge(integration.test_config_dict(), vllm_overrides(vllm_stack)), surge)), MODEL)
    recycle_under_load(http, "vLLM", 240)


def test_log_probabilities_and_choices_are_the_models_own(oai, tok, vllm_stack):
    from logprob_reference import check_served_logprobs

    check_served_logprobs(oai, MODEL, tok, vllm_stack)
