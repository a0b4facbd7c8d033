"""``POST /v1/files`` read as it streams: real multipart bodies (httpx's encoder, the official
client's own request, and by hand) in odd chunk sizes, refused at the first cap they pass."""

from __future__ import annotations

import codecs
import pickle
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from ballast.batch.upload import (
    FORM_OVERHEAD_BYTES,
    MAX_FILENAME_CHARS,
    ExpiresAfter,
    Upload,
    read_upload,
)
from ballast.errors import FileTooLarge, InvalidRequest, PayloadTooLarge

JSONL = b'{"custom_id": "a", "method": "POST"}\n{"custom_id": "b", "method": "POST"}\n'
EXPIRES = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}
BOUNDARY = "b0undary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def encoded(data: dict[str, str], file: tuple[str, bytes] | None = (("in.jsonl", JSONL))) -> tuple[str, bytes]:
    """(Content-Type, body) as httpx encodes a form."""
    files = {"file": (file[0], file[1], "application/jsonl")} if file else None
    req = httpx.Request("POST", "http://ballast.test/v1/files", data=data, files=files)
    return req.headers["content-type"], req.read()


def by_hand(*parts: tuple[str, str | None, bytes], epilogue: bytes = b"", close: bool = True) -> bytes:
    """A body from (name, filename, value) parts, with what follows its closing boundary."""
    out = b""
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    return out + (f"--{BOUNDARY}--\r\n".encode() if close else b"") + epilogue


class Chunks:
    """``body`` as an async stream of ``size``-byte chunks, counting those read."""

    def __init__(self, body: bytes, size: int) -> None:
        self.body, self.size, self.read = body, size, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start in range(0, len(self.body), self.size):
            self.read += 1
            yield self.body[start : start + self.size]
        yield b""  # Starlette's request.stream() ends with an empty chunk


async def upload(
    body: bytes, content_type: str | None = CONTENT_TYPE, size: int = 7, max_bytes: int = 1 << 20, max_lines: int = 100
) -> Upload:
    return await read_upload(Chunks(body, size), content_type, max_bytes, max_lines)


async def refused(body: bytes, content_type: str | None = CONTENT_TYPE, **caps: int) -> Any:
    with pytest.raises((InvalidRequest, PayloadTooLarge)) as info:
        await upload(body, content_type, **caps)
    return info.value


# ------------------------------------------------------------------ what a form holds


@pytest.mark.parametrize("size", [1, 2, 7, 13, 64, 1000, 1 << 20])
async def test_an_httpx_form_reads_the_same_in_any_chunk_size(size: int) -> None:
    content_type, body = encoded({"purpose": "batch", **EXPIRES})
    got = await upload(body, content_type, size)
    assert got == Upload("batch", "in.jsonl", JSONL, ExpiresAfter("created_at", 7200))
    purpose, filename, data, expires_after = got  # also a tuple, in that order
    assert (purpose, filename, data, expires_after) == ("batch", "in.jsonl", JSONL, ExpiresAfter("created_at", 7200))


async def test_the_official_clients_own_upload_is_read() -> None:
    sent: list[httpx.Request] = []

    def fake_server(request: httpx.Request) -> httpx.Response:  # records the request the client built
        request.read()
        sent.append(request)
        return httpx.Response(
            200,
            json={"id": "file-1", "object": "file", "bytes": 1, "created_at": 1, "filename": "x", "purpose": "batch"}
            | {"status": "processed"},
        )

    http = httpx.Client(transport=httpx.MockTransport(fake_server))
    client = openai.OpenAI(api_key="key", base_url="http://ballast.test/v1", http_client=http, max_retries=0)
    client.files.create(
        file=("requests.jsonl", JSONL), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    (req,) = sent
    got = await upload(req.content, req.headers["content-type"], 5)
    assert got == Upload("batch", "requests.jsonl", JSONL, ExpiresAfter("created_at", 3600))


async def test_expiry_is_optional_and_the_file_may_be_empty_or_unterminated() -> None:
    content_type, body = encoded({"purpose": "batch"}, ("a.jsonl", b""))
    assert await upload(body, content_type) == Upload("batch", "a.jsonl", b"", None)
    content_type, body = encoded({"purpose": "batch"}, ("a.jsonl", b"x\ny"))
    assert (await upload(body, content_type, max_lines=2)).data == b"x\ny"


async def test_the_filename_is_its_last_path_component_in_utf8() -> None:
    content_type, body = encoded({"purpose": "batch"}, ("naïve résumé.jsonl", JSONL))
    assert (await upload(body, content_type)).filename == "naïve résumé.jsonl"
    body = by_hand(("purpose", None, b"batch"), ("file", "C:\\Users\\me\\in.jsonl", JSONL))
    assert (await upload(body)).filename == "in.jsonl"
    body = by_hand(("purpose", None, b"batch"), ("file", "../../etc/in.jsonl", JSONL))
    assert (await upload(body)).filename == "in.jsonl"


# ------------------------------------------------------------------ caps, refused as the stream passes them


async def test_a_file_past_max_bytes_is_refused_before_the_rest_is_read() -> None:
    content_type, body = encoded({"purpose": "batch"}, ("big.jsonl", b"x" * 100_000))
    stream = Chunks(body, 1000)
    with pytest.raises(FileTooLarge) as info:
        await read_upload(stream, content_type, 10_000, 100)
    err = info.value
    assert (err.status, err.code, err.limit, err.unit) == (413, "FILE_TOO_LARGE", 10_000, "bytes")
    assert "the limit is 10000 bytes" in err.message
    assert stream.read <= 12  # about 10 kB read of 100 kB: the header part and eleven chunks at most
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.limit, again.unit, again.message) == (FileTooLarge, 10_000, "bytes", err.message)


async def test_a_file_exactly_at_max_bytes_is_read() -> None:
    content_type, body = encoded({"purpose": "batch"}, ("a.jsonl", b"y" * 4096))
    assert len((await upload(body, content_type, 100, max_bytes=4096)).data) == 4096


@pytest.mark.parametrize(
    ("data", "ok"),
    [
        (b"a\nb\nc\n", True),  # a final newline ends the third line
        (b"a\nb\nc", True),
        (b"a\nb\nc\nd", False),
        (b"a\nb\nc\n\n", True),  # a blank line is no request (as lines.py counts them)
        (b"\n \t\na\n\r\nb\n\nc\n  \n", True),
        (codecs.BOM_UTF8 + b"\na\nb\nc", True),  # the byte order mark is dropped: its line is blank
        (b"x\n" * 10_000, False),
    ],
)
async def test_lines_past_max_lines_are_refused(data: bytes, ok: bool) -> None:
    content_type, body = encoded({"purpose": "batch"}, ("a.jsonl", data))
    if ok:
        assert (await upload(body, content_type, 3, max_lines=3)).data == data
        return
    stream = Chunks(body, 3)
    with pytest.raises(FileTooLarge) as info:
        await read_upload(stream, content_type, 1 << 20, 3)
    assert (info.value.limit, info.value.unit) == (3, "lines")
    if len(data) > 1000:  # a long file stops at its fourth line: its part header and eight bytes read
        assert stream.read * 3 < body.index(data) + 12


@pytest.mark.parametrize(
    "data",
    [
        b"a\nb\nc\n",
        b"a\nb\nc\n\n",
        b"a\n\n\nb\nc",
        b"a\nb\nc\nd",
        codecs.BOM_UTF8 + b"  \na\nb\nc\n",
        b"a\nb\n \nc\n\x0b",
    ],
)
async def test_the_upload_counts_lines_as_the_batch_parse_counts_requests(data: bytes) -> None:
    """A file the upload takes at max_lines is never too_many_tasks at create, and the reverse."""
    from ballast.batch.lines import parse_batch_file
    from ballast.errors import BatchFileInvalid

    content_type, body = encoded({"purpose": "batch"}, ("a.jsonl", data))
    try:
        await upload(body, content_type, 3, max_lines=3)
        taken = True
    except FileTooLarge:
        taken = False
    try:
        parse_batch_file(data, "/v1/completions", 3, lambda body: "m")
        too_many = False
    except BatchFileInvalid as e:
        too_many = any(err["code"] == "too_many_tasks" for err in e.errors)
    assert taken is not too_many


async def test_bytes_after_the_closing_boundary_are_bounded() -> None:
    body = by_hand(("purpose", None, b"batch"), ("file", "a.jsonl", JSONL), epilogue=b"z" * 1000)
    assert (await upload(body)).data == JSONL  # a little is skipped, as the parser does
    body = by_hand(("purpose", None, b"batch"), ("file", "a.jsonl", JSONL), epilogue=b"z" * 100_000)
    err = await refused(body, max_bytes=1000)
    assert isinstance(err, PayloadTooLarge) and not isinstance(err, FileTooLarge)
    assert str(1000 + FORM_OVERHEAD_BYTES) in err.message


@pytest.mark.parametrize(
    ("parts", "field"),
    [
        ([("purpose", None, b"b" * 33), ("file", "a.jsonl", JSONL)], "purpose"),
        ([("purpose", None, b"batch"), ("file", "a" * (MAX_FILENAME_CHARS + 1), JSONL)], "file"),
        ([("purpose", None, b"batch"), ("file", "a\x01b", JSONL)], "file"),
        ([("purpose", None, b"batch"), ("file", "", JSONL)], "file"),
        ([("purpose", None, b"batch"), ("file", None, JSONL)], "file"),
        ([("purpose", None, b"batch"), ("model", None, b"tiny"), ("file", "a.jsonl", JSONL)], "body"),
        ([("purpose", None, b"batch"), ("purpose", None, b"batch"), ("file", "a.jsonl", JSONL)], "purpose"),
        ([("purpose", None, b"batch"), ("file", "a.jsonl", JSONL), ("file", "b.jsonl", JSONL)], "file"),
        ([("file", "a.jsonl", JSONL)], "purpose"),
        ([("purpose", None, b"batch")], "file"),
        ([("purpose", None, b"fine-tune"), ("file", "a.jsonl", JSONL)], "purpose"),
        ([("purpose", None, b"\xff"), ("file", "a.jsonl", JSONL)], "purpose"),
    ],
)
async def test_bad_fields_are_refused_naming_the_field(parts: list[Any], field: str) -> None:
    err = await refused(by_hand(*parts))
    assert isinstance(err, InvalidRequest) and err.field == field


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "7200"}, "expires_after[anchor]"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after[seconds]"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after[seconds]"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "-7200"}, "expires_after[seconds]"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "١٢٣٤٥"}, "expires_after[seconds]"),
        ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
        ({"expires_after[seconds]": "7200"}, "expires_after[anchor]"),
    ],
)
async def test_a_bad_expiry_is_refused(fields: dict[str, str], field: str) -> None:
    content_type, body = encoded({"purpose": "batch", **fields})
    err = await refused(body, content_type)
    assert isinstance(err, InvalidRequest) and err.field == field


@pytest.mark.parametrize(
    "content_type",
    [None, "application/json", "multipart/form-data", "multipart/form-data; boundary=" + "b" * 71],
)
async def test_a_body_that_is_not_a_multipart_form_is_refused(content_type: str | None) -> None:
    err = await refused(by_hand(("purpose", None, b"batch"), ("file", "a.jsonl", JSONL)), content_type)
    assert isinstance(err, InvalidRequest) and err.field == "content-type"


async def test_a_truncated_or_malformed_form_is_refused() -> None:
    err = await refused(by_hand(("purpose", None, b"batch"), ("file", "a.jsonl", JSONL), close=False))
    assert isinstance(err, InvalidRequest) and "closing boundary" in err.message
    err = await refused(b"this is not a form at all")
    assert isinstance(err, InvalidRequest) and err.field == "body"
    header = f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=purpose\r\n".encode()
    err = await refused(header + b"X-Filler: " + b"h" * 10_000 + b"\r\n\r\nbatch\r\n")
    assert isinstance(err, InvalidRequest) and err.field == "body"  # the parser's own header bound


async def test_caps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        await read_upload(Chunks(b"", 1), CONTENT_TYPE, 0, 10)
