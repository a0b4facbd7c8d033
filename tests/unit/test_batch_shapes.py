"""OpenAI's Batch API shapes, parsed by the official ``openai`` package's own types and client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch, FileObject

from ballast.batch.lines import LineError
from ballast.batch.records import MAX_LINE_TOKENS, TokenUsage
from ballast.batch.shapes import (
    BATCH_TIMES,
    batch_object,
    error_line,
    file_object,
    list_page,
    new_line_id,
    output_line,
    refused_line,
)
from ballast.router.openai_answers import Counts, Ident, chat_completion, completion

FILE = {
    "id": "file-0123456789abcdef01234567",
    "bytes": 1234,
    "created_at": 1_700_000_000.75,
    "expires_at": 1_702_592_000,
    "filename": "requests.jsonl",
    "purpose": "batch",
}
BATCH = {
    "id": "batch_0123456789abcdef01234567",
    "endpoint": "/v1/chat/completions",
    "input_file_id": FILE["id"],
    "completion_window": "24h",
    "status": "validating",
    "created_at": 1_700_000_100,
    "expires_at": 1_700_086_500,
}


def test_a_file_record_is_openais_file_object() -> None:
    shape = file_object(FILE)
    parsed = FileObject.model_validate(shape)
    assert (parsed.id, parsed.object, parsed.bytes, parsed.filename) == (FILE["id"], "file", 1234, "requests.jsonl")
    assert (parsed.created_at, parsed.expires_at) == (1_700_000_000, 1_702_592_000)  # whole seconds
    assert (parsed.purpose, parsed.status) == ("batch", "processed")  # the client requires a status
    assert FileObject.model_validate(file_object({**FILE, "expires_at": None, "status": "uploaded"})).expires_at is None
    assert set(shape) == set(FileObject.model_fields)
    assert json.loads(json.dumps(shape)) == shape


def test_a_new_batch_is_openais_batch_object_with_every_optional_field_null() -> None:
    shape = batch_object(BATCH)
    parsed = Batch.model_validate(shape)
    assert (parsed.id, parsed.object, parsed.status) == (BATCH["id"], "batch", "validating")
    assert parsed.created_at == 1_700_000_100
    assert parsed.expires_at == 1_700_086_500
    assert parsed.request_counts is not None and parsed.request_counts.total == 0
    assert parsed.errors is None and parsed.usage is None and parsed.model is None and parsed.metadata is None
    # the client's fields, each present (null where not yet known), none it does not read
    assert set(shape) == set(Batch.model_fields)
    assert all(shape[name] is None for name in BATCH_TIMES if name != "expires_at")


def test_a_completed_batch_carries_counts_usage_model_and_metadata() -> None:
    record = {
        **BATCH,
        "status": "completed",
        "in_progress_at": 1_700_000_101,
        "finalizing_at": 1_700_000_400,
        "completed_at": 1_700_000_401,
        "output_file_id": "file-out",
        "error_file_id": "file-err",
        "request_counts": {"total": 3, "completed": 2, "failed": 1},
        "metadata": {"job": "nightly"},
        "model": "tiny",
        "usage": {"input_tokens": 30, "output_tokens": 12, "cached_tokens": 8},
    }
    parsed = Batch.model_validate(batch_object(record))
    assert (parsed.output_file_id, parsed.error_file_id, parsed.model) == ("file-out", "file-err", "tiny")
    assert parsed.request_counts is not None
    assert (parsed.request_counts.total, parsed.request_counts.completed, parsed.request_counts.failed) == (3, 2, 1)
    assert parsed.metadata == {"job": "nightly"}
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (30, 12, 42)
    assert parsed.usage.input_tokens_details.cached_tokens == 8
    assert parsed.usage.output_tokens_details.reasoning_tokens == 0


def test_an_output_lines_usage_is_read_from_the_answer_the_dispatcher_writes() -> None:
    ident = Ident("chatcmpl-1", 1_700_000_000, "tiny")
    chat = chat_completion(ident, "hi", "stop", Counts(prompt_tokens=12, completion_tokens=5, cached_tokens=8))
    text = completion(ident, "hi", "length", Counts(prompt_tokens=3, completion_tokens=9))
    for body, want in ((chat, TokenUsage(12, 8, 5, 0)), (text, TokenUsage(3, 0, 9, 0))):
        line = json.dumps(output_line(new_line_id(), "req-1", 200, body["id"], body))
        assert TokenUsage.of_output_line(line) == want
    reasoning = {**chat, "usage": {**chat["usage"], "completion_tokens_details": {"reasoning_tokens": 2}}}
    assert TokenUsage.of_output_line(json.dumps(output_line("x", "r", 200, "q", reasoning))).reasoning_tokens == 2
    usage = Batch.model_validate(batch_object({**BATCH, "usage": TokenUsage(12, 8, 5, 2).to_dict()})).usage
    assert usage is not None and (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (12, 5, 17)
    assert (usage.input_tokens_details.cached_tokens, usage.output_tokens_details.reasoning_tokens) == (8, 2)


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": -1, "completion_tokens": True},
        {"prompt_tokens": "12", "completion_tokens": 2.0},
        {"prompt_tokens": MAX_LINE_TOKENS + 1, "completion_tokens": None},
        {"prompt_tokens_details": [8], "completion_tokens_details": "x"},
    ],
)
def test_a_usage_no_engine_reports_counts_nothing_and_keeps_the_line(usage: dict[str, Any]) -> None:
    assert TokenUsage.of_output_line(json.dumps(output_line("x", "r", 200, "q", {"usage": usage}))) == TokenUsage()
    for line in ("not json", "[]", '{"response": null}', '{"response": {"body": "text"}}'):
        assert TokenUsage.of_output_line(line) == TokenUsage()


def test_a_failed_batch_reports_its_files_errors_data() -> None:
    entries = [
        {"code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "param": None, "line": 2},
        {"code": "duplicate_custom_id", "message": "dup", "param": "custom_id", "line": 5},
    ]
    for stored in (entries, {"object": "list", "data": entries}):
        parsed = Batch.model_validate(batch_object({**BATCH, "status": "failed", "failed_at": 1, "errors": stored}))
        assert parsed.errors is not None and parsed.errors.object == "list"
        assert parsed.errors.data is not None
        assert [(e.code, e.line, e.param) for e in parsed.errors.data] == [
            ("invalid_json_line", 2, None),
            ("duplicate_custom_id", 5, "custom_id"),
        ]


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({k: v for k, v in BATCH.items() if k != "input_file_id"}, "input_file_id"),
        ({**BATCH, "status": "running"}, "status"),
        ({**BATCH, "created_at": True}, "created_at"),
        ({**BATCH, "created_at": "1700000000"}, "created_at"),
        ({**BATCH, "request_counts": {"total": 1, "completed": -1, "failed": 0}}, "completed"),
        ({**BATCH, "metadata": {"n": 1}}, "metadata"),
        ({**BATCH, "errors": "bad"}, "errors"),
        ({**BATCH, "usage": {"input_tokens": 1}}, "output_tokens"),
        ({**BATCH, "output_file_id": ""}, "output_file_id"),
    ],
)
def test_a_record_the_client_could_not_parse_is_refused_where_it_is_built(record: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        batch_object(record)


def test_a_file_of_another_purpose_is_refused() -> None:
    with pytest.raises(ValueError, match="^purpose:"):
        file_object({**FILE, "purpose": "fine-tune"})
    assert FileObject.model_validate(file_object({**FILE, "purpose": "batch_output"})).purpose == "batch_output"


def _fake_openai_server(pages: dict[str | None, dict[str, Any]], seen: list[dict[str, str]]) -> openai.OpenAI:
    """The official client against a fake server that answers from ``pages`` (keyed by the
    ``after`` the client sends): what runs is the client's own parsing and paging."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.url.params))
        if request.url.path.endswith(f"/batches/{BATCH['id']}"):
            return httpx.Response(200, json=batch_object(BATCH))
        if request.url.path.endswith(f"/files/{FILE['id']}"):
            return httpx.Response(200, json=file_object(FILE))
        return httpx.Response(200, json=pages[request.url.params.get("after")])

    http = httpx.Client(transport=httpx.MockTransport(handle))
    return openai.OpenAI(api_key="key", base_url="http://ballast.test/v1", http_client=http, max_retries=0)


def test_the_official_client_pages_through_list_pages_by_last_id() -> None:
    batches = [batch_object({**BATCH, "id": f"batch_{i:024x}"}) for i in range(5)]
    pages = {
        None: list_page(batches[:2], has_more=True),
        batches[1]["id"]: list_page(batches[2:4], has_more=True),
        batches[3]["id"]: list_page(batches[4:], has_more=False),
    }
    seen: list[dict[str, str]] = []
    client = _fake_openai_server(pages, seen)
    listed = [b.id for b in client.batches.list(limit=2)]
    assert listed == [b["id"] for b in batches]
    assert [s.get("after") for s in seen] == [None, batches[1]["id"], batches[3]["id"]]
    assert pages[None]["first_id"] == batches[0]["id"] and pages[None]["last_id"] == batches[1]["id"]
    assert client.batches.retrieve(BATCH["id"]).status == "validating"
    assert client.files.retrieve(FILE["id"]).filename == "requests.jsonl"


def test_an_empty_page() -> None:
    assert list_page([], has_more=False) == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


def test_output_and_error_lines() -> None:
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "choices": []}
    assert output_line("batch_req_1", "a", 200, "req-1", answer) == {
        "id": "batch_req_1",
        "custom_id": "a",
        "response": {"status_code": 200, "request_id": "req-1", "body": answer},
        "error": None,
    }
    assert error_line("batch_req_2", "b", "batch_expired", "not run within the completion window") == {
        "id": "batch_req_2",
        "custom_id": "b",
        "response": None,
        "error": {"code": "batch_expired", "message": "not run within the completion window"},
    }
    failed = error_line("batch_req_3", "c", "MODEL_UNAVAILABLE", "gone", 503, "req-3", {"error": {"code": "x"}})
    assert failed["response"] == {"status_code": 503, "request_id": "req-3", "body": {"error": {"code": "x"}}}


def test_a_line_refused_at_create_is_its_4xx_in_openais_error_shape() -> None:
    refused = LineError(4, "d", "invalid_url", "does not match the batch endpoint", "url", 400)
    line = refused_line("batch_req_4", refused)
    assert line == {
        "id": "batch_req_4",
        "custom_id": "d",
        "response": {
            "status_code": 400,
            "request_id": None,
            "body": {
                "error": {
                    "message": "does not match the batch endpoint",
                    "type": "invalid_request_error",
                    "param": "url",
                    "code": "invalid_url",
                }
            },
        },
        "error": {"code": "invalid_url", "message": "does not match the batch endpoint"},
    }


def test_line_ids() -> None:
    assert new_line_id(lambda n: "ab" * n) == "batch_req_" + "ab" * 12
    made = {new_line_id() for _ in range(100)}
    assert len(made) == 100 and all(len(i) == len("batch_req_") + 24 for i in made)
