"""The OpenAI-compatible front, driven by the official ``openai`` Python client against
the real local stack: the SDK's own parsing, typed errors and retries are the contract."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from conftest import (
    ADMIN,
    BASE,
    GOLD,
    clear_chaos,
    flood,
    heal,
    level_raised,
    set_chaos,
    status,
    wait_quiet,
    wait_until,
)

from ballast.ops.status_text import model_view

pytestmark = pytest.mark.integration

MODEL = "tiny-decoder"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def sdk(key: str = "dev-key-gold", retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=retries, timeout=60)


def test_chat_completion_with_usage_and_headers(ballast):
    raw = sdk().chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    out = raw.parse()
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.created > 0
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    # The byte model's tokens are the templated prompt's bytes (openai_api.render_chat).
    assert out.usage.prompt_tokens == len(b"<|system|>\nBe brief.\n<|user|>\nHello\n<|assistant|>\n")
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert out.model == MODEL
    assert raw.headers["x-ballast-fallback"] == "none" and raw.headers["x-ballast-criticality"] == "critical"


def test_completion_streams_to_done_and_equals_the_unary_text(ballast):
    client = sdk()
    unary = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=10)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=10, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == unary.choices[0].text  # greedy: the same text either way
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len("Once upon")


def test_async_chat_stream(ballast):
    async def main() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="dev-key-gold", max_retries=0)
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            parts.append(delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        unary = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9)
        await client.close()
        return "".join(parts), finish, unary.choices[0].message.content

    streamed, finish, unary = asyncio.run(main())
    assert streamed == unary and finish == "length"


def test_stop_strings_end_the_answer(ballast):
    client = sdk()
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=24).choices[0].text
    stop = full[5:7]  # a piece of the greedy answer that is sure to come
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=24, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="abc", max_tokens=24, stop=stop, stream=True)
        if c.choices
    )
    assert streamed == cut.text


def test_models_lists_what_the_key_may_ask_for(ballast):
    # The fallback answers for its model; it is not asked for by name, so not listed.
    names = [m.id for m in sdk().models.list()]
    assert names == [MODEL] and ballast.fallback.model.name not in names


def test_typed_errors(ballast):
    with pytest.raises(openai.AuthenticationError) as e:
        sdk("not-a-key").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert e.value.code == "UNAUTHENTICATED"
    with pytest.raises(openai.NotFoundError) as e:
        sdk().chat.completions.create(model="gpt-none", messages=MESSAGES, max_tokens=4)
    assert "gpt-none" in e.value.message and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        sdk().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=9)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        sdk().chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert e.value.param == "tools"


def noisy_bucket_at_least(tokens: float) -> None:
    """The noisy tenant's bucket (300 tokens/s, burst 300: tests/integration/test_config.yaml)."""

    def full() -> bool:
        return httpx.get(f"{BASE}/v1/status", headers=ADMIN).json()["quotas"]["noisy"]["tokens"] >= tokens

    wait_until(full, 10, 0.25, f"noisy bucket at {tokens} tokens")


def test_over_quota_is_a_rate_limit_error_and_the_sdk_waits_as_told(ballast):
    noisy = "dev-key-noisy"
    # 290 tokens, nearly the whole burst, in a call of a few milliseconds (10 tokens to
    # generate), so the bucket barely refills while the requests below are made.
    body = dict(model=MODEL, prompt="x" * 280, max_tokens=10)
    noisy_bucket_at_least(295)
    sdk(noisy).completions.create(**body)  # the bucket holds ~10 tokens now, and refills in ~0.93 s
    with pytest.raises(openai.RateLimitError) as e:
        sdk(noisy).completions.create(**body)
    assert e.value.code == "QUOTA_EXCEEDED" and e.value.type == "rate_limit_error"
    assert int(e.value.response.headers["retry-after"]) == 1
    # Refused again at once; the SDK's own retry waits the Retry-After second and gets through.
    t0 = time.monotonic()
    out = sdk(noisy, retries=3).completions.create(**body)
    assert out.usage.completion_tokens == 10
    assert time.monotonic() - t0 >= 0.9


def test_criticality_header_or_body_and_a_lowered_claim(ballast):
    noisy_bucket_at_least(100)  # the quota test before this one empties it
    raw = sdk("dev-key-noisy").chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"criticality": "critical_plus"}
    )
    assert raw.headers["x-ballast-criticality"] == "sheddable_plus"
    assert "criticality_lowered" in raw.headers["x-ballast-degraded"]
    raw = sdk().chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"X-Ballast-Criticality": "sheddable"}
    )
    assert raw.headers["x-ballast-criticality"] == "sheddable"


def test_kill_switch_and_a_raised_level_refuse_with_typed_errors(client, ballast):
    r = client.post(
        "/admin/kill-switch",
        headers=ADMIN,
        json={"scope": "criticality", "value": "sheddable", "reason": "openai test", "expires_in_s": 60},
    )
    assert r.status_code == 201, r.text
    try:
        with pytest.raises(openai.InternalServerError) as e:
            sdk().chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, extra_body={"criticality": "sheddable"}
            )
        assert e.value.status_code == 503 and e.value.code == "KILL_SWITCH"
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        client.delete(f"/admin/kill-switch/{r.json()['id']}", headers=ADMIN)

    # Raise the level with critical load (queue thresholds 6/12 in the test config):
    # sheddable traffic through the OpenAI front is refused at the door.
    async def main() -> openai.APIStatusError:
        stop = asyncio.Event()
        task = asyncio.ensure_future(flood(stop))
        try:
            await level_raised(client)
            client_ = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="dev-key-gold", max_retries=0)
            try:
                await client_.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"X-Ballast-Criticality": "sheddable"}
                )
            except openai.APIStatusError as err:
                return err
            finally:
                await client_.close()
            raise AssertionError("sheddable was admitted at a raised level")
        finally:
            stop.set()
            await task

    err = asyncio.run(main())
    assert err.status_code == 503 and err.code == "OVERLOADED"
    wait_quiet(client)


def test_a_fallback_answer_names_its_model(client, ballast):
    set_chaos(client, "primary", error_ratio=1.0)
    try:
        raw = sdk().chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        out = raw.parse()
        assert out.model == ballast.fallback.model.name
        assert raw.headers["x-ballast-fallback"] == "fallback_model"
    finally:
        clear_chaos(client)
        heal(client)  # the primary's breaker closed again for the tests after this one


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True}),
        ("/v1/generate", {"prompt": "Hello", "max_tokens": 200, "stream": True}),
    ],
    ids=["openai", "native"],
)
def test_a_client_leaving_mid_stream_frees_its_place_at_once(client, ballast, path, body):
    def held() -> tuple[int, int]:
        s = status(client)
        return model_view(s, MODEL)["gate"]["in_flight"], s["tenant_inflight"].get("gold", 0)

    wait_until(lambda: held() == (0, 0), 30, 0.25, "an idle router")
    # The primary waits 1.5 s before it starts any request, so the stream is surely open
    # and admitted when the test looks (the response's headers come before its first
    # event). Through HAProxy the router learns that the client left when it next has
    # an event to send (HAProxy closes the upstream connection then): the ticket is
    # settled there, not when the 200 tokens would have ended. That a closed stream
    # settles its ticket at once is tests/unit/test_pipeline.py's; this checks the
    # whole stack gives the place back.
    set_chaos(client, "primary", latency_ms=1500)
    try:
        with httpx.Client(base_url=BASE, timeout=60) as c:
            with c.stream("POST", path, headers=GOLD, json=body) as r:
                assert r.status_code == 200
                assert held() == (1, 1)
        wait_until(lambda: held() == (0, 0), 10, 0.1, "the stream's place back")
    finally:
        clear_chaos(client)


def test_log_probabilities_echo_and_choices_on_the_builtin_engine(ballast):
    client = sdk()
    prompt = "Once upon"
    ask = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "logprobs": 3}
    unary = client.completions.create(**ask, echo=True)
    (choice,) = unary.choices
    lp = choice.logprobs
    # Bytes are the built-in model's tokens: the prompt's 9, then the answer's.
    assert lp.tokens[:9] == list(prompt) and lp.token_logprobs[0] is None and len(lp.tokens) == 9 + 6
    assert choice.text == prompt + "".join(lp.tokens[9:]) and lp.text_offset == list(range(15))
    assert all(v <= 0 and len(top) <= 4 for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True))
    streamed = [c for chunk in client.completions.create(**ask, stream=True) for c in chunk.choices]
    values = [v for c in streamed if c.logprobs is not None for v in c.logprobs.token_logprobs]
    assert values == pytest.approx(lp.token_logprobs[9:], abs=1e-3)  # greedy: the same tokens, the same values

    alone = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=0, echo=True, logprobs=0)
    assert (alone.choices[0].text, alone.usage.prompt_tokens, alone.usage.completion_tokens) == ("Hi", 2, 0)
    assert len(alone.choices[0].logprobs.token_logprobs) == 2

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, n=3, logprobs=True, top_logprobs=2
    )
    assert sorted(c.index for c in chat.choices) == [0, 1, 2] and chat.usage.completion_tokens == 15
    for c in chat.choices:
        assert len(c.logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
    events = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=2, stream=True))
    finished = [c.index for e in events for c in e.choices if c.finish_reason is not None]
    assert sorted(finished) == [0, 1]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=9)
    assert e.value.param == "n" and "at most 8" in e.value.message
