"""What goes on the wire for ``POST /v1/generate``: the path, the body, the answer, SSE framing.

Pure data and parsing, shared by the sync and async clients (and by the Locust
user in loadtest/locustfile.py, which reuses ``SSEDecoder`` and the names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ballast.client.errors import ServerError

GENERATE_PATH = "/v1/generate"
USER_AGENT = "ballast-client/0.1"
CRITICALITIES = ("critical_plus", "critical", "sheddable_plus", "sheddable")


def build_payload(prompt: str, max_tokens: int, criticality: str, stream: bool) -> dict[str, Any]:
    # Bounds and allowed values are the server's to enforce (422 INVALID_REQUEST names the
    # field); the client does not keep a second copy of them.
    return {"prompt": prompt, "max_tokens": max_tokens, "criticality": criticality, "stream": stream}


@dataclass(frozen=True)
class Generation:
    text: str
    tokens_generated: int
    model: str
    degradation_level: int
    degraded: bool
    degraded_reasons: tuple[str, ...]
    #: None when the primary model answered, else "fallback_model" or "cache".
    fallback: str | None
    #: The answer (or, for a stream, the ``done`` payload) as the server sent it.
    raw: dict[str, Any] = field(compare=False)

    @classmethod
    def from_payload(cls, payload: object, text: str | None = None) -> Generation:
        """From the JSON answer, or from a ``done`` event plus the streamed ``text``."""
        try:
            if not isinstance(payload, dict):
                raise TypeError("not an object")
            body_text = payload["text"] if text is None else text
            reasons = payload["degraded_reasons"]
            fallback = payload["fallback"]
            gen = cls(
                text=body_text,
                tokens_generated=int(payload["tokens_generated"]),
                model=str(payload["model"]),
                degradation_level=int(payload["degradation_level"]),
                degraded=bool(payload["degraded"]),
                degraded_reasons=tuple(str(r) for r in reasons),
                fallback=None if fallback is None else str(fallback),
                raw=payload,
            )
            if not isinstance(gen.text, str):
                raise TypeError("text is not a string")
            return gen
        except (KeyError, TypeError, ValueError) as e:
            raise ServerError(f"malformed answer: {type(e).__name__}: {e}", 200, "MALFORMED_RESPONSE") from None


class SSEDecoder:
    """Server-sent events, fed one line at a time (line endings stripped).

    ``feed`` returns ``(event, data)`` when a blank line completes an event, else
    None. Comments (``:``) and ``id``/``retry`` fields are ignored; several
    ``data`` lines are joined with newlines, as the SSE spec says.
    """

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        if line == "":
            if not self._data and not self._event:
                return None
            out = (self._event or "message", "\n".join(self._data))
            self._event, self._data = "", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None
