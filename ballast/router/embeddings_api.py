"""The OpenAI embeddings protocol: the body ``POST /v1/embeddings`` takes and the answer it
gives (the models ``/openapi.json`` publishes). It runs nothing: ``ballast.router.embeddings``
reads the request here, hands it to the pipeline and builds its answer from these models.

Requests. ``input`` is one text, a list of texts, one input as token ids (a list of
ints), or a list of such inputs; never empty, no text empty, every id a non-negative int
below 2**31 (the front checks it against the model's vocabulary). ``encoding_format``:
``float`` (a list of numbers) or ``base64`` (the float32 little-endian bytes, base64'ed:
what the official ``openai`` client asks for by default and decodes). ``dimensions``: a
shorter vector the model was trained to give (its ``embed.dimensions``; checked by the
front). ``criticality`` and ``service_tier`` are Ballast's, as on the other OpenAI routes.
Unknown fields are refused. The bounds of one request (inputs, each input's tokens, all
of them) are the model's ``embed`` settings, checked by the front after the parse; the
fixed ones here (``MAX_INPUTS``, ``MAX_INPUT_IDS``) hold for every model.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from ballast.policies.criticality import Criticality
from ballast.router.openai_api import BadRequest

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs; a model's embed.max_inputs is at most this
MAX_INPUT_IDS = 1 << 17  # ids of one token-id input (the model's context bounds it further)
MAX_ID = (1 << 31) - 1
MAX_DIMENSIONS = 1 << 16  # as EmbedSettings.dimensions


def _is_id(i: Any) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID


def _ids_fault(ids: list[Any]) -> str | None:
    """What is wrong with one token-id input (None: nothing)."""
    if not ids:
        return "an input of token ids holds at least one id"
    if len(ids) > MAX_INPUT_IDS:
        return f"an input of token ids holds at most {MAX_INPUT_IDS} ids"
    if not all(_is_id(i) for i in ids):
        return f"token ids are integers from 0 to {MAX_ID}"
    return None


def _inputs(value: Any) -> Any:
    """``input`` as a list of inputs, each a non-empty str or a non-empty list of ids; a
    PydanticCustomError (the field named by the parse) for anything else. Checked here
    rather than by the union, so that an error names ``input`` (or ``input.<i>``), not a
    union branch."""
    if isinstance(value, str):
        if not value:
            raise PydanticCustomError("input_text", "a text input is not empty")
        return [value]
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        fault = _ids_fault(value)
        if fault is not None:
            raise PydanticCustomError("input_ids", fault)
        return [value]
    if not isinstance(value, list):
        raise PydanticCustomError(
            "input_type", "must be a string, a list of strings, token ids, or a list of lists of token ids"
        )
    if not value:
        raise PydanticCustomError("input_empty", "holds at least one input")
    if len(value) > MAX_INPUTS:
        raise PydanticCustomError("input_count", "holds at most {most} inputs", {"most": MAX_INPUTS})
    texts = isinstance(value[0], str)
    for i, one in enumerate(value):
        if texts and isinstance(one, str):
            if not one:
                raise PydanticCustomError("input_text", "input.{i}: a text input is not empty", {"i": i})
        elif not texts and isinstance(one, list):
            fault = _ids_fault(one)
            if fault is not None:
                raise PydanticCustomError("input_ids", "input.{i}: {fault}", {"i": i, "fault": fault})
        else:
            raise PydanticCustomError(
                "input_mixed",
                "input.{i}: every input of a list is a string, or every one a list of token ids",
                {"i": i},
            )
    return value


class EmbeddingRequest(BaseModel):
    """Body of ``POST /v1/embeddings``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, description="The embeddings model's name (GET /v1/models).")
    input: Annotated[
        str | list[str] | list[int] | list[list[int]],
        BeforeValidator(_inputs),
    ] = Field(
        description="One text, a list of texts, one input as token ids, or a list of token-id inputs; not empty, "
        "no text empty. At most the model's embed.max_inputs inputs, each at most embed.max_input_tokens (or "
        "the context), all of them at most embed.max_request_tokens. After validation a list of inputs."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: a list of numbers; base64: the float32 little-endian bytes, base64'ed."
    )
    dimensions: int | None = Field(
        None,
        ge=1,
        le=MAX_DIMENSIONS,
        strict=True,
        description="A shorter vector, one of the sizes the model was trained to give (its embed.dimensions).",
    )
    user: str | None = Field(None, max_length=256, description="The end user's id, for abuse tracking.")
    criticality: Criticality | None = Field(
        None,
        description="Ballast extension: how much the request matters under overload, as the "
        "X-Ballast-Criticality header (both must agree); default critical, lowered to the tenant's cap.",
    )
    service_tier: Literal["auto", "default", "flex", "priority", "fast"] | None = Field(
        None,
        description="As on /v1/chat/completions: 'flex' is sheddable held for spare capacity, 'priority' the "
        "tenant's cap.",
    )

    @property
    def inputs(self) -> Sequence[str | list[int]]:
        """The inputs in order (``_inputs`` made ``input`` a list of them)."""
        return self.input  # type: ignore[return-value]


def parse_embedding(data: Any) -> EmbeddingRequest:
    """A decoded body as an embeddings request, or ``BadRequest`` naming the field (an
    input's own fault: ``input.<i>``)."""
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object", field="body")
    try:
        return EmbeddingRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        reason = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        if field == "input" and reason.startswith("input."):  # the input at fault names itself
            field, reason = reason.split(": ", 1)
        raise BadRequest(f"{field}: {reason}", field=field) from None


# ----------------------------------------------------------------------------- answers


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(description="The inputs' tokens, in the model's tokenizer (what the quota charged).")
    total_tokens: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int = Field(description="The input's place in the request.")
    embedding: list[float] | str = Field(
        description="The vector: numbers (encoding_format float), or its float32 little-endian bytes base64'ed."
    )


class EmbeddingList(BaseModel):
    """The answer of ``POST /v1/embeddings``: one vector per input, in order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def vector(raw: bytes, encoding_format: str) -> list[float] | str:
    """One vector as the request asked it: ``raw`` (float32, little-endian) base64'ed, or as numbers."""
    if encoding_format == "base64":
        return base64.b64encode(raw).decode("ascii")
    return [float(x) for x in np.frombuffer(raw, dtype="<f4").tolist()]


def embedding_list(model: str, vectors: Sequence[bytes], encoding_format: str, prompt_tokens: int) -> dict[str, Any]:
    """The answer's body: each vector by its input's index, the model that answered, the usage."""
    body = EmbeddingList(
        object="list",
        data=[
            Embedding(object="embedding", index=i, embedding=vector(raw, encoding_format))
            for i, raw in enumerate(vectors)
        ],
        model=model,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    )
    return body.model_dump(mode="json")
