"""The OpenAI front's answers of several choices and log-probabilities, on a real Router
object without Ray (routerkit) whose model handle is scripted: each choice apart (its own
finish, its text offsets), the echo first, and a stream read to its end settled as answered."""

from __future__ import annotations

import json

from routerkit import at_level, build_router, only_lane, routed
from test_resilient_caller import FakeHandle, FakeResponse, FakeStream

from ballast.model.protocol import ModelChunk, ModelResult, TokenLogprob

KEY = {"authorization": "Bearer dev-key-gold"}
CFG = {"tenants": {"gold": {}}, "auth": {"demo_keys": {"dev-key-gold": "gold"}}}
MODEL = "tiny-decoder"


def lp(token: str, value: float) -> TokenLogprob:
    return TokenLogprob(token, value, ((token, value), ("z", value - 1.0)))


def piece(index: int, text: str, finish: str | None = None, **kw) -> FakeResponse:
    logprobs = tuple(lp(ch, -0.5) for ch in text)
    return FakeResponse(0, result=ModelChunk(text, tuple(map(ord, text)), finish, index=index, logprobs=logprobs, **kw))


def events(body: bytes) -> list[dict]:
    lines = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def serve(stream: FakeStream | None = None, unary: FakeResponse | None = None):
    handle = FakeHandle(*([unary] if unary else []), streams=(stream,) if stream else ())
    router = build_router(CFG, handle)
    at_level(router, 0)
    codes: list[str] = []
    accounts = only_lane(router).accounts
    counted = accounts.refused

    def record(tenant: str, criticality: str, code: str) -> None:
        codes.append(code)
        counted(tenant, criticality, code)

    accounts.refused = record
    return router, handle, codes


def test_a_streamed_completion_of_two_choices_echoes_each_with_its_offsets_and_ends_answered():
    prompt = (TokenLogprob("H", None), TokenLogprob("i", -1.0, (("i", -1.0),)))
    stream = FakeStream(
        piece(0, "ab", queue_wait_ms=1.0, max_tokens=3, prompt_logprobs=prompt),
        piece(1, "xy", prompt_logprobs=prompt),
        piece(0, "c", "length"),
        piece(1, "z", "stop"),
    )
    router, handle, codes = serve(stream)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2, "logprobs": 1, "echo": True, "stream": True}
    with routed(router) as client:
        r = client.post("/v1/completions", headers=KEY, json=body)
    assert r.status_code == 200, r.text
    (call,) = handle.generate_stream.calls
    assert (call.n, call.logprobs, call.prompt_logprobs) == (2, 1, 1)
    by_choice: dict[int, list[dict]] = {0: [], 1: []}
    for e in events(r.content):
        for c in e["choices"]:
            by_choice[c["index"]].append(c)
    for i, text in ((0, "Hiabc"), (1, "Hixyz")):
        mine = by_choice[i]
        assert "".join(c["text"] for c in mine) == text
        assert [c["finish_reason"] for c in mine][-1] == ("length" if i == 0 else "stop")
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert offsets == [0, 1, 2, 3, 4]  # the echoed prompt's, then each piece's, continued
        first = mine[0]["logprobs"]
        assert first["tokens"][:2] == ["H", "i"] and first["token_logprobs"][0] is None
    assert codes == ["OK"]  # read to its end: answered, not cancelled


def test_a_unary_chat_of_three_choices_counts_every_choices_tokens():
    from ballast.model.protocol import ChoiceResult

    choices = tuple(ChoiceResult(i, t, len(t), "length", tuple(lp(ch, -0.25) for ch in t)) for i, t in enumerate("abc"))
    result = ModelResult("a", 3, "length", max_tokens=1, choices=choices, logprobs=choices[0].logprobs)
    router, handle, codes = serve(unary=FakeResponse(0, result=result))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 3}
    with routed(router) as client:
        r = client.post("/v1/chat/completions", headers=KEY, json={**body, "logprobs": True, "top_logprobs": 1})
    out = r.json()
    assert r.status_code == 200 and out["usage"]["completion_tokens"] == 3
    assert [c["message"]["content"] for c in out["choices"]] == ["a", "b", "c"]
    assert [c["logprobs"]["content"][0]["top_logprobs"] for c in out["choices"]][1] == [
        {"token": "b", "logprob": -0.25, "bytes": [98]}
    ]
    assert codes == ["OK"]
