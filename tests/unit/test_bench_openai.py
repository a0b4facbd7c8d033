"""loadtest.bench_openai's pure parts: percentiles and ratios, the reading of a server-sent
stream (chat chunks, Responses events) with its first-token clock, the two bodies, the
clients' plan, the embeddings inputs and vectors, and the line a script reads. The run
needs vLLM behind a Ray Serve stack (``make bench-openai``).

The streams here are written as Ballast's fronts write them (``responses._sse``: the event
type as ``event:``, the object as ``data:``; chat: ``data:`` chunks, then ``[DONE]``); the
fronts' own tests pin those shapes down. The clock is a list of ticks.
"""

from __future__ import annotations

import base64
import json
import math
import re
import statistics
import struct

import pytest

from ballast.router.responses_api import parse_responses
from ballast.router.responses_items import to_chat
from loadtest.bench_openai import (
    KINDS,
    MAX_FAULT_BYTES,
    PROMPT,
    BenchFault,
    ChatStream,
    Figures,
    ResponsesStream,
    Seen,
    SseEvent,
    chat_body,
    cosines,
    cpu_line,
    decode_embedding,
    embed_inputs,
    final_line,
    first_token_ms,
    pct,
    plan,
    ratio,
    responses_body,
    sse_events,
    ttft_table,
)


def ticks(*values: float):
    """A clock that reads ``values`` in turn."""
    it = iter(values)
    return lambda: next(it)


def responses_lines(*events: dict) -> list[str]:
    out: list[str] = []
    for e in events:
        out += [f"event: {e['type']}", f"data: {json.dumps(e, separators=(',', ':'))}", ""]
    return out


def chat_lines(*chunks: dict) -> list[str]:
    out: list[str] = []
    for c in chunks:
        out += [f"data: {json.dumps(c)}", ""]
    return out + ["data: [DONE]", ""]


CREATED = {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}}
ADDED = {"type": "response.output_item.added", "output_index": 0, "item": {"type": "message"}}
COMPLETED = {"type": "response.completed", "response": {"id": "resp_1", "status": "completed"}}


def delta(text: str) -> dict:
    return {"type": "response.output_text.delta", "output_index": 0, "content_index": 0, "delta": text}


# --- percentiles and ratios -------------------------------------------------------------------


def test_percentiles_interpolate_between_ranks_as_statistics_inclusive_does():
    values = [float(v) for v in (7, 1, 3, 9, 5, 2, 8, 4, 6, 10)]
    inclusive = statistics.quantiles(values, n=100, method="inclusive")
    for q in (1, 25, 50, 90, 99):
        assert pct(values, q) == pytest.approx(inclusive[q - 1])
    assert pct(values, 50) == 5.5 and pct(values, 0) == 1 and pct(values, 100) == 10
    assert pct([4.0], 99) == 4.0
    assert math.isnan(pct([], 50))


def test_p99_of_a_hundred_reads_the_tail_not_the_median():
    values = [10.0] * 98 + [100.0, 200.0]
    assert pct(values, 50) == 10.0
    assert pct(values, 99) == pytest.approx(100 + 0.01 * 100)  # between the two slowest


def test_ratio_is_nan_where_it_means_nothing():
    assert ratio(11.0, 10.0) == pytest.approx(1.1)
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(1.0, -1.0))
    assert math.isnan(ratio(math.nan, 1.0)) and math.isnan(ratio(1.0, math.nan))


# --- server-sent events -----------------------------------------------------------------------


def test_sse_events_split_at_blank_lines_with_their_names():
    lines = [
        ": a comment",
        "event: response.created",
        'data: {"a":1}',
        "",
        "data: x",
        "data: y",
        "",
        "",
        "data: [DONE]",
    ]
    assert list(sse_events(lines)) == [
        SseEvent("response.created", '{"a":1}'),
        SseEvent("", "x\ny"),
        SseEvent("", "[DONE]"),  # cut off at the end: still an event
    ]


def test_an_event_name_does_not_leak_into_the_next_event():
    lines = ["event: a", "data: 1", "", "data: 2", ""]
    assert [e.event for e in sse_events(lines)] == ["a", ""]


def test_responses_ttft_is_the_first_text_delta_and_the_stream_is_read_to_its_end():
    lines = responses_lines(CREATED, ADDED, delta(""), delta("Hi"), delta(" there"), COMPLETED)
    # The clock is read once, at the first delta with text; a second reading would raise.
    assert first_token_ms(lines, ResponsesStream(), 1.0, ticks(1.25)) == pytest.approx(250.0)


def test_chat_ttft_is_the_first_delta_with_content():
    lines = chat_lines(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"completion_tokens": 2}},
    )
    assert first_token_ms(lines, ChatStream(), 2.0, ticks(2.04)) == pytest.approx(40.0)


def test_a_response_cut_at_max_output_tokens_ends_incomplete_as_chat_ends_at_length():
    incomplete = {
        "type": "response.incomplete",
        "response": {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}},
    }
    lines = responses_lines(CREATED, delta("Hi"), incomplete)
    assert first_token_ms(lines, ResponsesStream(), 0.0, ticks(0.5)) == pytest.approx(500.0)
    filtered = {**incomplete, "response": {"incomplete_details": {"reason": "content_filter"}}}
    with pytest.raises(BenchFault, match="content_filter"):
        first_token_ms(responses_lines(CREATED, delta("Hi"), filtered), ResponsesStream(), 0.0, ticks(0.5))


def test_reasoning_or_tool_events_are_not_a_first_token():
    reasoning = {"type": "response.reasoning_text.delta", "delta": "hmm"}
    args = {"type": "response.function_call_arguments.delta", "delta": "{"}
    lines = responses_lines(CREATED, reasoning, args, delta("x"), COMPLETED)
    assert first_token_ms(lines, ResponsesStream(), 0.0, ticks(3.0)) == pytest.approx(3000.0)


@pytest.mark.parametrize(
    ("events", "said"),
    [
        ((ADDED, delta("x"), COMPLETED), "not response.created"),
        ((CREATED, delta("x")), "not response.completed"),
        ((CREATED, delta("x"), {"type": "response.failed", "response": {"error": "boom"}}), "response.failed"),
        ((CREATED, {"type": "error", "code": "x"}), "error"),
        ((CREATED, COMPLETED), "no text"),
    ],
)
def test_a_responses_stream_out_of_order_or_failed_is_a_fault(events, said):
    with pytest.raises(BenchFault, match=re.escape(said)):
        first_token_ms(responses_lines(*events), ResponsesStream(), 0.0, ticks(1.0))


def test_an_event_named_otherwise_than_its_type_is_a_fault():
    lines = ["event: response.completed", f"data: {json.dumps(CREATED)}", ""]
    with pytest.raises(BenchFault, match="carries an object of type 'response.created'"):
        first_token_ms(lines, ResponsesStream(), 0.0, ticks(1.0))


def test_a_chat_stream_without_done_or_with_an_error_is_a_fault():
    cut = chat_lines({"choices": [{"delta": {"content": "Hi"}}]})[:-2]
    with pytest.raises(BenchFault, match="without \\[DONE\\]"):
        first_token_ms(cut, ChatStream(), 0.0, ticks(1.0))
    failed = chat_lines({"error": {"message": "replica gone", "code": "MODEL_UNAVAILABLE"}})
    with pytest.raises(BenchFault, match="an error in the stream"):
        first_token_ms(failed, ChatStream(), 0.0, ticks(1.0))
    with pytest.raises(BenchFault, match="not JSON"):
        first_token_ms(["data: {oops", ""], ChatStream(), 0.0, ticks(1.0))


def test_a_long_responses_stream_keeps_a_bounded_record_and_still_checks_its_ends():
    stream = ResponsesStream()
    events = responses_lines(CREATED, *[delta("x")] * 5000, COMPLETED)
    first_token_ms(events, stream, 0.0, ticks(1.0))
    assert len(stream.types) == 4096 and stream.types[0] == "response.created"
    assert stream.types[-1] == "response.completed"


# --- the two bodies ---------------------------------------------------------------------------


def test_the_responses_body_is_the_chat_body_of_the_same_prompt():
    chat, resp = chat_body("m", 16), responses_body("m", 16)
    assert (chat["stream"], resp["stream"], chat["temperature"], resp["temperature"]) == (True, True, 0, 0)
    assert resp["store"] is False  # chat keeps nothing either
    # Ballast's own translation: the Responses body means the chat body's conversation and limit.
    translated = to_chat(parse_responses(resp))
    assert translated["messages"] == chat["messages"] == [{"role": "user", "content": PROMPT}]
    assert translated["max_tokens"] == chat["max_tokens"] == 16


# --- the plan ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("requests", "conc"), [(100, 1), (100, 4), (10, 3), (1, 1)])
def test_each_client_alternates_and_the_kinds_are_sent_alike(requests, conc):
    clients = plan(requests, conc)
    assert len(clients) == conc
    for w, kinds in enumerate(clients):
        assert kinds[0] == KINDS[w % 2]
        assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))  # alternating
    sent = [k for kinds in clients for k in kinds]
    assert sent.count("chat") == sent.count("responses") >= requests
    assert sent.count("chat") < requests + conc  # no more than the rounding up


def test_at_four_clients_half_start_with_each_kind():
    assert [kinds[0] for kinds in plan(8, 4)] == ["chat", "responses", "chat", "responses"]


# --- embeddings -------------------------------------------------------------------------------


def test_embeddings_inputs_are_distinct_and_of_one_shape():
    texts = embed_inputs(1024, 5)
    assert len(set(texts)) == 1024
    assert {len(t.split(": ", 1)[1].split()) for t in texts} == {5}
    assert embed_inputs(3, 5) == texts[:3]  # the same inputs on every side and every run


def test_a_base64_vector_and_a_float_vector_decode_alike():
    vec = [0.5, -1.25, 3.0]
    b64 = base64.b64encode(struct.pack("<3f", *vec)).decode()
    assert decode_embedding({"embedding": b64}) == vec
    assert decode_embedding({"embedding": vec}, dims=3) == vec
    with pytest.raises(BenchFault, match="2 numbers, the others have 3"):
        decode_embedding({"embedding": [1.0, 2.0]}, dims=3)
    with pytest.raises(BenchFault, match="without a vector"):
        decode_embedding({"index": 0})


def test_cosines_input_by_input():
    got = cosines([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [2.0, 0.0]], [[2.0, 0.0], [1.0, -1.0], [1.0, 0.0], [-1.0, 0.0]])
    assert got == pytest.approx([1.0, 0.0, 0.0, -1.0])
    with pytest.raises(ValueError, match="2 vectors against 1"):
        cosines([[1.0], [1.0]], [[1.0]])
    with pytest.raises(ValueError, match="shape"):
        cosines([[1.0, 2.0]], [[1.0]])


# --- the report -------------------------------------------------------------------------------


def test_the_table_gives_each_concurrency_and_the_line_the_first():
    times = {
        1: {"chat": [10.0, 20.0, 30.0], "responses": [11.0, 22.0, 33.0]},
        4: {"chat": [40.0, 40.0], "responses": [80.0, 80.0]},
    }
    lines, (r50, r99) = ttft_table(times)
    assert (r50, r99) == (pytest.approx(1.1), pytest.approx(1.1))  # concurrency 1, not 4
    assert any(re.match(r"\s+4\s+responses/chat\s+p50 2\.000\s+p99 2\.000", line) for line in lines)
    assert any(re.match(r"\s+1\s+chat\s+3\s+20\.0\s+29\.8$", line) for line in lines)


def test_the_final_line_reads_back_as_numbers_and_says_nan_for_a_section_not_run():
    line = final_line(Figures(1.0412, 1.2, 0.93456, 0.99999123))
    assert line == (
        "openai: responses_ttft_p50_ratio=1.041 responses_ttft_p99_ratio=1.200 "
        "embed_throughput_ratio=0.935 embed_min_cosine=0.999991"
    )
    fields = dict(kv.split("=") for kv in final_line(Figures(1.0, 1.0)).split(": ", 1)[1].split())
    assert list(fields) == [
        "responses_ttft_p50_ratio",
        "responses_ttft_p99_ratio",
        "embed_throughput_ratio",
        "embed_min_cosine",
    ]
    assert math.isnan(float(fields["embed_throughput_ratio"])) and float(fields["responses_ttft_p50_ratio"]) == 1.0


def test_the_cpu_line_names_the_roles_that_worked_and_the_engine_wait():
    span = {"engine": 6.134, "front": 0.84, "router": 0.0, "engine wait": 1.5}
    line = cpu_line(span)
    assert "engine 6.13" in line and "front 0.84" in line and "router" not in line
    assert line.endswith("engine waited 1.50 s for a core")


def test_the_lines_a_fault_saw_are_counted_and_their_start_kept():
    seen = Seen(iter(["event: response.created", "data: {}", "", *["x" * 100] * 5]))
    assert list(seen) and seen.count == 8
    assert seen.first.startswith("event: response.created\ndata: {}\n\n") and len(seen.first) == MAX_FAULT_BYTES
    empty = Seen(iter([]))
    assert list(empty) == [] and (empty.count, empty.first) == (0, "")
