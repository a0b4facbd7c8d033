"""loadtest.bench_tools' pure parts: the three request forms, the first-token clock's
reading of an OpenAI stream, and the line a script reads. The run needs vLLM behind a
Ray Serve stack (``make bench-tools``).

``FakeStream`` stands in for Ballast's streamed answer (httpx's own ``MockTransport``):
what is read from it is the stream's shape, which the OpenAI front's tests pin down.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from loadtest.bench_tools import FORMS, TOOLS, body, first_token_ms, pct, report


def test_plain_has_no_tools_and_the_others_name_their_choice():
    plain = body("m", "plain", 3, 48)
    assert "tools" not in plain and "tool_choice" not in plain
    assert plain["messages"][1]["content"].startswith("Question 3:")
    assert (plain["stream"], plain["ignore_eos"], plain["temperature"], plain["max_tokens"]) == (True, True, 0, 48)
    for form in ("auto", "required"):
        b = body("m", form, 3, 48)
        assert b["tools"] == TOOLS and b["tool_choice"] == form
        assert b["messages"] == plain["messages"]  # the same conversation in every form


def _sse(*chunks: dict) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def FakeStream(status: int, content: bytes) -> httpx.Client:
    """A client whose every POST is answered ``status`` with ``content``: the fake server."""
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(status, content=content)))


def test_the_first_token_is_the_first_chunk_with_content_or_a_call():
    role_only = {"choices": [{"delta": {"role": "assistant"}}]}
    call = {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1"}]}}]}
    with FakeStream(200, _sse(role_only, call)) as client:
        assert first_token_ms(client, "http://x/v1/chat/completions", "k", body("m", "required", 0, 8)) > 0
    with FakeStream(200, _sse(role_only, {"choices": [{"delta": {"content": "Hi"}}]})) as client:
        assert first_token_ms(client, "http://x/v1/chat/completions", "k", body("m", "plain", 0, 8)) > 0


def test_an_answer_without_a_token_or_an_error_fails_the_round():
    with FakeStream(200, _sse({"choices": [{"delta": {"role": "assistant"}}]})) as client:
        with pytest.raises(RuntimeError, match="auto: no content and no call"):
            first_token_ms(client, "http://x", "k", body("m", "auto", 0, 8))
    with FakeStream(503, b'{"error": {"code": "OVERLOADED"}}') as client:
        with pytest.raises(RuntimeError, match="plain: 503"):
            first_token_ms(client, "http://x", "k", body("m", "plain", 0, 8))


def test_the_report_line_carries_each_forms_median_and_the_ratios(capsys):
    times = {"plain": [10.0, 12.0, 11.0], "auto": [22.0, 20.0, 21.0], "required": [15.0, 16.5, 16.0]}
    line = report(times)
    assert line == (
        "tools-ttft: plain_p50_ms=11.0 auto_p50_ms=21.0 required_p50_ms=16.0 "
        "auto_over_plain=1.909 required_over_plain=1.455"
    )
    assert capsys.readouterr().out.splitlines()[-1] == line
    fields = dict(kv.split("=") for kv in re.sub(r"^tools-ttft: ", "", line).split())
    assert set(fields) == {f"{f}_p50_ms" for f in FORMS} | {"auto_over_plain", "required_over_plain"}


def test_pct_of_one_value_is_that_value():
    assert pct([5.0], 90) == 5.0
    assert pct([float(v) for v in range(1, 101)], 90) == pytest.approx(90.1)
