"""A batch's input file read line by line: which lines run, which go to the error file, which
fail the file (OpenAI's errors.data), and the bounds on the work a file causes."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from ballast.batch.lines import MAX_CUSTOM_ID_CHARS, MAX_FILE_ERRORS, GoodLine, LineError, parse_batch_file
from ballast.errors import BatchFileInvalid, InvalidRequest, ModelNotFound, Overloaded
from ballast.router.openai_api import parse_chat

CHAT = "/v1/chat/completions"
GRANTED = ("tiny", "small")  # the models the tenant's key may use (the router's catalog decides this)


def check_body(body: dict[str, Any]) -> str:
    """The OpenAI front's own validation of a chat body, then the tenant's grant."""
    req = parse_chat(body)
    if req.model not in GRANTED:
        raise ModelNotFound.named(req.model, list(GRANTED))
    return req.model


def request(custom_id: Any, model: str = "tiny", **over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": [{"role": "user", "content": f"hello {custom_id}"}], "max_tokens": 8},
    }
    line.update(over)
    return line


def jsonl(*lines: Any) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def parse(data: bytes, max_lines: int = 100, **kw: Any) -> Any:
    return parse_batch_file(data, CHAT, max_lines, check_body, **kw)


def fatal_codes(data: bytes, **kw: Any) -> list[tuple[int | None, str]]:
    with pytest.raises(BatchFileInvalid) as info:
        parse(data, **kw)
    return [(e["line"], e["code"]) for e in info.value.errors]


# ------------------------------------------------------------------ good lines


def test_good_lines_keep_their_number_custom_id_model_and_body() -> None:
    first, second = request("a"), request("b")
    parsed = parse(jsonl(first, second))
    assert parsed.errors == []
    assert parsed.model == "tiny"
    assert [(g.line, g.custom_id, g.model) for g in parsed.lines] == [(1, "a", "tiny"), (2, "b", "tiny")]
    assert parsed.lines[0].body() == first["body"]
    assert parsed.lines[1].body_json == json.dumps(second["body"], separators=(",", ":"))


def test_blank_lines_are_skipped_but_counted_a_bom_and_crlf_are_read() -> None:
    data = b"\xef\xbb\xbf" + json.dumps(request("a")).encode() + b"\r\n\r\n   \n" + json.dumps(request("b")).encode()
    parsed = parse(data)
    assert [(g.line, g.custom_id) for g in parsed.lines] == [(1, "a"), (4, "b")]


# ------------------------------------------------------------------ lines refused on their own


def test_a_bad_request_goes_to_the_error_file_with_its_number_and_the_rest_runs() -> None:
    data = jsonl(
        request("ok-1"),
        request("get", method="GET"),
        request("url", url="/v1/completions"),
        request("nobody", body="hello"),
        request("stream", body={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}),
        request("grant", model="secret"),
        request("invalid", body={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 9}),
        request("ok-2"),
    )
    parsed = parse(data)
    assert [(g.line, g.custom_id) for g in parsed.lines] == [(1, "ok-1"), (8, "ok-2")]
    got = [(e.line, e.custom_id, e.code, e.param, e.status) for e in parsed.errors]
    assert got == [
        (2, "get", "invalid_method", "method", 400),
        (3, "url", "invalid_url", "url", 400),
        (4, "nobody", "invalid_body", "body", 400),
        (5, "stream", "stream_not_supported", "stream", 400),
        (6, "grant", "model_not_found", None, 404),
        (7, "invalid", "INVALID_REQUEST", "temperature", 400),
    ]
    assert "does not match the batch endpoint" in parsed.errors[1].message
    assert "'secret' does not exist" in parsed.errors[4].message


def test_a_body_past_the_online_size_is_refused_as_the_online_call_would_be() -> None:
    big = request("big", body={"model": "tiny", "messages": [{"role": "user", "content": "x" * 300}]})
    parsed = parse(jsonl(request("a"), big), max_body_bytes=256)
    assert [g.custom_id for g in parsed.lines] == ["a"]
    (err,) = parsed.errors
    assert (err.line, err.code, err.status, err.param) == (2, "PAYLOAD_TOO_LARGE", 413, "body")
    assert "the limit is 256" in err.message


def test_a_clients_value_is_quoted_cut_short() -> None:
    parsed = parse(jsonl(request("m", method=["x" * 10_000]), request("u", url="/" * 10_000)))
    assert [e.code for e in parsed.errors] == ["invalid_method", "invalid_url"]
    assert all(len(e.message) < 200 for e in parsed.errors)


def test_a_lone_surrogate_is_refused_not_a_crash() -> None:
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'
    line = f'{{"custom_id": "s", "method": "POST", "url": "{CHAT}", "body": {body}}}'
    parsed = parse(jsonl(request("a"), line))
    (err,) = parsed.errors
    assert (err.line, err.custom_id, err.code, err.param) == (2, "s", "INVALID_REQUEST", "body")
    assert "lone UTF-16 surrogate" in err.message
    assert fatal_codes(jsonl('{"custom_id": "\\udc00"}')) == [(1, "invalid_custom_id")]


def test_a_file_whose_lines_are_all_refused_still_runs_with_no_model() -> None:
    parsed = parse(jsonl(request("a", method="PUT")))
    assert parsed.lines == [] and parsed.model is None
    assert parsed.errors == [LineError(1, "a", "invalid_method", "method must be 'POST', got 'PUT'.", "method")]


def test_a_capacity_refusal_is_not_the_lines_fault_and_propagates() -> None:
    def overloaded(body: dict[str, Any]) -> str:
        raise Overloaded("no capacity now", retry_after_s=1.0)

    with pytest.raises(Overloaded):
        parse_batch_file(jsonl(request("a")), CHAT, 10, overloaded)


def test_check_body_must_name_a_model() -> None:
    with pytest.raises(TypeError, match="model's name"):
        parse_batch_file(jsonl(request("a")), CHAT, 10, lambda body: "")


# ------------------------------------------------------------------ lines that fail the file


def test_lines_that_cannot_be_keyed_fail_the_file_with_every_such_line() -> None:
    data = jsonl(
        request("a"),
        "{not json",
        "[1, 2]",
        request(""),
        request(7),
        request("x" * (MAX_CUSTOM_ID_CHARS + 1)),
        {"method": "POST"},
        request("a"),
        '{"custom_id": "n", "x": NaN}',
    )
    assert fatal_codes(data) == [
        (2, "invalid_json_line"),
        (3, "invalid_json_line"),
        (4, "invalid_custom_id"),
        (5, "invalid_custom_id"),
        (6, "invalid_custom_id"),
        (7, "invalid_custom_id"),
        (8, "duplicate_custom_id"),
        (9, "invalid_json_line"),
    ]


def test_the_errors_are_openais_errors_data_entries() -> None:
    with pytest.raises(BatchFileInvalid) as info:
        parse(jsonl(request("a"), request("a")))
    err = info.value
    assert err.status == 400 and err.code == "INVALID_BATCH_FILE"
    assert err.errors == [
        {
            "code": "duplicate_custom_id",
            "message": "The custom_id 'a' for this request is a duplicate of another request. "
            "The custom_id parameter must be unique for each request in a batch.",
            "param": "custom_id",
            "line": 2,
        }
    ]
    assert err.body()["error"]["data"] == err.errors
    again = pickle.loads(pickle.dumps(err))  # it crosses Ray process boundaries intact
    assert (type(again), again.message, again.errors) == (BatchFileInvalid, err.message, err.errors)


def test_a_duplicate_of_a_refused_line_fails_the_file_too() -> None:
    # the error file is keyed by custom_id as well: a repeat cannot be written once
    assert fatal_codes(jsonl(request("a", method="GET"), request("a"))) == [(2, "duplicate_custom_id")]


def test_lines_for_another_model_fail_the_file() -> None:
    data = jsonl(request("a", model="secret"), request("b"), request("c", model="small"), request("d"))
    with pytest.raises(BatchFileInvalid) as info:
        parse(data)
    (entry,) = info.value.errors
    assert (entry["line"], entry["code"], entry["param"]) == (3, "mismatched_model", "model")
    assert "The model 'small' for this request does not match the rest of the batch" in entry["message"]


def test_empty_files_fail() -> None:
    for data in (b"", b"\n\n  \n", b"\xef\xbb\xbf"):
        assert fatal_codes(data) == [(None, "empty_file")]


def test_not_utf8_fails_the_file_naming_the_line() -> None:
    with pytest.raises(BatchFileInvalid) as info:
        parse(jsonl(request("a")) + b'{"custom_id": "\xff"}\n')
    (entry,) = info.value.errors
    assert (entry["line"], entry["code"]) == (2, "invalid_json_line")
    assert "not UTF-8" in entry["message"]


# ------------------------------------------------------------------ bounded work


def test_the_scan_stops_at_the_line_past_max_lines() -> None:
    calls: list[str] = []

    def counting(body: dict[str, Any]) -> str:
        calls.append(body["messages"][0]["content"])
        return check_body(body)

    data = jsonl(*(request(str(i)) for i in range(5)))
    with pytest.raises(BatchFileInvalid) as info:
        parse_batch_file(data, CHAT, 3, counting)
    assert [(e["line"], e["code"]) for e in info.value.errors] == [(4, "too_many_tasks")]
    assert len(calls) == 3  # the fifth line was never read
    assert len(parse_batch_file(data, CHAT, 5, counting).lines) == 5


def test_once_the_file_has_failed_no_line_is_checked_and_errors_stop_at_the_bound() -> None:
    calls = 0

    def counting(body: dict[str, Any]) -> str:
        nonlocal calls
        calls += 1
        return check_body(body)

    data = jsonl(request("a"), "oops", request("b"), *(["oops"] * (MAX_FILE_ERRORS + 50)))
    with pytest.raises(BatchFileInvalid) as info:
        parse_batch_file(data, CHAT, 1000, counting)
    assert calls == 1  # line 3 is framed (its custom_id noted) and not checked
    assert len(info.value.errors) == MAX_FILE_ERRORS
    assert info.value.errors[-1]["line"] == MAX_FILE_ERRORS + 2


def test_nesting_is_measured_before_the_parse() -> None:
    deep = '{"custom_id": "d", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"  # json.loads would recurse
    with pytest.raises(BatchFileInvalid) as info:
        parse(jsonl(request("a"), deep))
    (entry,) = info.value.errors
    assert (entry["line"], entry["code"]) == (2, "invalid_json_line")
    assert "100001 deep; the limit is 64" in entry["message"]
    nested = request("n", body={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "x": [[[[1]]]]})
    assert fatal_codes(jsonl(nested), max_depth=4) == [(1, "invalid_json_line")]


def test_a_bad_endpoint_or_bound_is_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_batch_file(jsonl(request("a")), "/v1/admin", 10, check_body)
    assert info.value.field == "endpoint"
    with pytest.raises(ValueError, match="max_lines"):
        parse_batch_file(jsonl(request("a")), CHAT, 0, check_body)


def test_good_lines_are_frozen() -> None:
    line = GoodLine(1, "a", "tiny", "{}")
    with pytest.raises(AttributeError):
        line.model = "other"  # type: ignore[misc]
