"""``POST /v1/files``: a multipart/form-data upload read as it streams in, within its caps.

The form is OpenAI's: ``purpose`` ("batch", the one purpose Ballast serves), ``file`` (its
filename from the part's Content-Disposition), and optionally ``expires_after[anchor]``
("created_at") with ``expires_after[seconds]`` (an hour to 30 days). Nothing else.

Procedure (``read_upload``): the body's chunks go one by one through python-multipart's
streaming parser; its callbacks route each part's bytes to the one field its headers name.
The upload is refused as soon as it passes a cap, before another chunk is read:

- the file past ``max_bytes`` bytes or ``max_lines`` lines (413 ``FILE_TOO_LARGE``, the limit
  in the message); lines are counted as ballast/batch/lines.py counts a batch's requests:
  newline-separated, a final newline ending the last line, a UTF-8 byte order mark before
  the first dropped, and a blank line (nothing but ASCII whitespace) not counted, so a file
  the upload takes never fails its batch for too many requests, and the reverse;
- the whole body past ``max_bytes + FORM_OVERHEAD_BYTES`` (413: boundaries, part headers and
  the small fields fit within the overhead; the parser skips what follows the closing boundary,
  which would otherwise be read without end);
- a small field past its cap (``purpose`` 32 bytes, each ``expires_after`` field 32), a
  filename past 256 characters, an unknown or repeated field, a form that is not
  multipart/form-data, is malformed or ends before its closing boundary (422, the field named).

So the bytes held are at most the file's, and the work is one pass over the body.

Why by hand on python-multipart's parser: Starlette's ``request.form()`` spools a file part
to disk with no cap on its size, and counts no lines; its parser underneath is this one.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from ballast.errors import FileTooLarge, InvalidRequest, PayloadTooLarge
from ballast.policies.validation import check_int

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

PURPOSES = ("batch",)
EXPIRES_ANCHORS = ("created_at",)
EXPIRES_MIN_S = 3600  # OpenAI's bounds on expires_after.seconds: an hour ...
EXPIRES_MAX_S = 30 * 24 * 3600  # ... to 30 days
MAX_FIELD_BYTES = 32  # purpose and each expires_after field
MAX_FILENAME_CHARS = 256
MAX_BOUNDARY_CHARS = 70  # RFC 2046
#: What a body may hold beyond its file: boundaries, each part's headers, the small fields.
FORM_OVERHEAD_BYTES = 16 * 1024
FILE_FIELD = "file"
FIELDS = ("purpose", FILE_FIELD, "expires_after[anchor]", "expires_after[seconds]")


@dataclass(frozen=True)
class ExpiresAfter:
    """When an uploaded file expires: ``seconds`` after its ``anchor`` (its creation)."""

    anchor: str
    seconds: int


class Upload(NamedTuple):
    """An upload read whole: the form's purpose, the file's name and bytes, and its expiry if asked."""

    purpose: str
    filename: str
    data: bytes
    expires_after: ExpiresAfter | None


async def read_upload(chunks: AsyncIterable[bytes], content_type: str | None, max_bytes: int, max_lines: int) -> Upload:
    """The upload in ``chunks`` (Starlette's ``request.stream()``) under its ``Content-Type``
    header, or the refusal of the first cap it passes (procedure: the module docstring)."""
    check_int("max_bytes", max_bytes, minimum=1)
    check_int("max_lines", max_lines, minimum=1)
    form = _Form(max_bytes, max_lines)
    try:
        parser = MultipartParser(_boundary(content_type), form.callbacks())
        body_bytes = 0
        async for chunk in chunks:
            body_bytes += len(chunk)
            if body_bytes > max_bytes + FORM_OVERHEAD_BYTES:
                raise PayloadTooLarge(f"body: more than {max_bytes + FORM_OVERHEAD_BYTES} bytes for a file upload")
            parser.write(chunk)
    except FormParserError as e:
        raise InvalidRequest(f"body: not a valid multipart form ({e})", "body") from None
    return form.upload()


def _boundary(content_type: str | None) -> bytes:
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise InvalidRequest("content-type: must be multipart/form-data", "content-type")
    boundary = params.get(b"boundary", b"")
    if not 0 < len(boundary) <= MAX_BOUNDARY_CHARS:
        raise InvalidRequest(f"content-type: needs a boundary of 1 to {MAX_BOUNDARY_CHARS} characters", "content-type")
    return boundary


class _Form:
    """The parser's callbacks and what they gathered. The parser calls them in order, part by
    part, from ``write``; each part's bytes go to the field its headers named, each bounded."""

    def __init__(self, max_bytes: int, max_lines: int) -> None:
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.fields: dict[str, bytes] = {}
        self.filename = ""
        self.file = bytearray()
        self.requests = 0  # non-blank lines ended by a newline so far
        self._scanned = 0  # where the next count starts in ``file`` (after the last newline counted)
        self.ended = False
        self._name: str | None = None  # the field of the part being read
        self._value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._header_field = bytearray()
        self._header_value = bytearray()

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._header_field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._header_value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._headers = {}
        self._name = None
        self._value = bytearray()

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field = bytearray()
        self._header_value = bytearray()

    def _headers_finished(self) -> None:
        disposition, params = parse_options_header(self._headers.get(b"content-disposition"))
        raw_name = params.get(b"name")
        name = raw_name.decode("latin-1") if disposition == b"form-data" and raw_name is not None else None
        if name not in FIELDS:
            raise InvalidRequest(f"body: unknown form field {name!r}; the fields are {', '.join(FIELDS)}", "body")
        if name in self.fields or (name == FILE_FIELD and self.filename):
            raise InvalidRequest(f"{name}: given twice", name)
        if name == FILE_FIELD:
            self.filename = _filename(params.get(b"filename"))
        self._name = name

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if self._name != FILE_FIELD:
            if len(self._value) + len(piece) > MAX_FIELD_BYTES:
                raise InvalidRequest(f"{self._name}: more than {MAX_FIELD_BYTES} bytes", str(self._name))
            self._value.extend(piece)
            return
        if len(self.file) + len(piece) > self.max_bytes:
            raise FileTooLarge(self.max_bytes, "bytes")
        self.file.extend(piece)
        if self._count_lines() > self.max_lines:
            raise FileTooLarge(self.max_lines, "lines")

    def _count_lines(self) -> int:
        """The file's requests so far (lines.py's count: the module docstring); each byte is
        scanned once, from the last newline counted."""
        start = self._scanned
        if start == 0 and self.file.startswith(codecs.BOM_UTF8):
            start = len(codecs.BOM_UTF8)
        end = self.file.rfind(b"\n", start)
        if end >= start:
            self.requests += sum(1 for line in bytes(self.file[start:end]).split(b"\n") if line.strip())
            start = self._scanned = end + 1
        return self.requests + (1 if self.file[start:].strip() else 0)

    def _part_end(self) -> None:
        if self._name is not None and self._name != FILE_FIELD:
            self.fields[self._name] = bytes(self._value)

    def _end(self) -> None:
        self.ended = True

    def upload(self) -> Upload:
        """What the form held, each field checked; or the refusal naming what is wrong."""
        if not self.ended:
            raise InvalidRequest("body: the multipart form ends before its closing boundary", "body")
        if not self.filename:
            raise InvalidRequest("file: required (a file part with a filename)", FILE_FIELD)
        purpose = self._text("purpose")
        if purpose not in PURPOSES:
            raise InvalidRequest(f"purpose: must be one of {', '.join(PURPOSES)}, got {purpose!r}", "purpose")
        return Upload(purpose, self.filename, bytes(self.file), self._expires_after())

    def _text(self, name: str) -> str:
        if name not in self.fields:
            raise InvalidRequest(f"{name}: required", name)
        try:
            return self.fields[name].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name}: not UTF-8", name) from None

    def _expires_after(self) -> ExpiresAfter | None:
        given = [name for name in FIELDS[2:] if name in self.fields]
        if not given:
            return None
        anchor = self._text("expires_after[anchor]")
        seconds = self._text("expires_after[seconds]")
        if anchor not in EXPIRES_ANCHORS:
            msg = f"expires_after[anchor]: must be one of {', '.join(EXPIRES_ANCHORS)}, got {anchor!r}"
            raise InvalidRequest(msg, "expires_after[anchor]")
        if not seconds.isascii() or not seconds.isdigit() or not EXPIRES_MIN_S <= int(seconds) <= EXPIRES_MAX_S:
            msg = f"expires_after[seconds]: must be an integer from {EXPIRES_MIN_S} to {EXPIRES_MAX_S}, got {seconds!r}"
            raise InvalidRequest(msg, "expires_after[seconds]")
        return ExpiresAfter(anchor, int(seconds))


def _filename(raw: bytes | None) -> str:
    """The file part's name as sent (UTF-8, as browsers and httpx send it), its last path
    component only, at most ``MAX_FILENAME_CHARS``, no control characters."""
    try:
        name = (raw or b"").decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("file: the filename is not UTF-8", FILE_FIELD) from None
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    if not name:
        raise InvalidRequest("file: required (a file part with a filename)", FILE_FIELD)
    if len(name) > MAX_FILENAME_CHARS:
        raise InvalidRequest(f"file: the filename is over {MAX_FILENAME_CHARS} characters", FILE_FIELD)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise InvalidRequest("file: the filename has control characters", FILE_FIELD)
    return name
