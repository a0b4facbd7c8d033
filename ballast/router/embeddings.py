"""``POST /v1/embeddings``: the OpenAI embeddings front on the shared request pipeline.

A model of ``kind: embed`` (ballast/config/model.py, ``EmbedSettings``) answers here alone,
and only such a model does. Procedure of a request (``prepare``, then the pipeline):

1. the caller is its API key's tenant (401), as on every route;
2. the body (``embeddings_api.parse_embedding``): a 400 naming the field;
3. the model: one the caller may use (404 ``model_not_found``), of kind ``embed`` (else
   400 naming ``model``); ``dimensions`` one of its ``embed.dimensions`` (else 400 naming
   ``dimensions``);
4. the inputs, at most ``embed.max_inputs`` of them (400 naming ``input``); each text
   tokenized here, once, by the model's tokenizer with its special tokens added (as vLLM's
   embeddings server does for a text input: ``add_special_tokens`` true); token-id inputs
   taken as sent, each id below the model's vocabulary (400 naming ``input.<i>``, or
   ``input`` when it is the only one); each input at most the model's context (400
   ``CONTEXT_LENGTH_EXCEEDED``, named so) and at most ``embed.max_input_tokens`` (400, named
   so); all of them together at most ``embed.max_request_tokens`` (400 naming ``input``);
5. one model call for all the inputs (``ModelCall.pool`` and ``inputs``: the replica runs a
   row per input, and answers their vectors in order), of ``max_tokens`` 0: the pipeline
   admits it by class and level, charges the inputs' tokens to the tenant's quota (at the
   model's ``cost_per_token``) and sends it through the model's gate, breaker and fallback
   (an embeddings model's fallback embeds with the same weights: the config refuses any
   other), as any request;
6. the answer: a vector per input by its index, as numbers or base64 (``encoding_format``),
   the model that answered, and ``usage`` in the model's tokens.

A batch line of ``/v1/embeddings`` (``batch_line``) is checked and run the same way, at the
class ``batch`` (``Pipeline.serve_batch``). Errors take OpenAI's shape (api.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ballast.errors import ContextLengthExceeded, ModelUnavailable
from ballast.model.protocol import ModelCall, Pooling
from ballast.model.special_tokens import BYTES_TOKENIZER, encode_bytes
from ballast.policies.catalog import Target
from ballast.policies.criticality import Criticality
from ballast.router import embeddings_api as ea
from ballast.router.answered import Answer
from ballast.router.api import answer_headers, read_json
from ballast.router.gate import BatchSlot, GateSlot
from ballast.router.lanes import Lane
from ballast.router.openai import OpenAIFront
from ballast.router.openai_api import BadRequest, model_token_ids
from ballast.router.pipeline import Caller, ModelRequest, Pipeline, tiered_claim
from ballast.router.tokens import ModelText


@dataclass(frozen=True)
class PreparedEmbedding:
    """A body checked as the online call checks it: the request, what its model name
    means, and its one model call (every input's ids)."""

    req: ea.EmbeddingRequest
    target: Target
    call: ModelCall

    @property
    def prompt_tokens(self) -> int:
        return self.call.input_tokens


class EmbeddingsFront:
    """``POST /v1/embeddings`` on the pipeline it holds."""

    def __init__(self, pipeline: Pipeline, cfg: Any) -> None:
        self._pipeline = pipeline
        self._cfg = cfg
        self._limits = cfg.limits

    async def embed(self, request: Request) -> JSONResponse:
        """``POST /v1/embeddings`` (the module docstring's procedure)."""
        caller = self._pipeline.identify(request)
        p = self.prepare(await read_json(request, self._limits, BadRequest), caller)
        tier, claimed = tiered_claim(request, p.req.service_tier, p.req.criticality, BadRequest)
        served = await self._pipeline.serve(ModelRequest(caller, claimed, 0, False, p.call, tier))
        assert isinstance(served, Answer)  # a call that does not stream is answered whole
        headers = {**OpenAIFront.headers(served.admission), **answer_headers(served)}
        return JSONResponse(self._body(served, p), headers=headers)

    def prepare(self, data: dict[str, Any], caller: Caller) -> PreparedEmbedding:
        """A body (an online request's, or a batch line's) checked as the online call checks
        it (steps 2 to 5 of the module docstring), and its model call."""
        req = ea.parse_embedding(data)
        lane, target = self._pipeline.target(caller, req.model)
        lane.serves("embed", req.model, BadRequest)
        settings = self._cfg.served_model(lane.name).embed
        if req.dimensions is not None and req.dimensions not in (settings.dimensions or ()):
            sizes = ", ".join(str(d) for d in settings.dimensions or ()) or "none: only its whole vector"
            raise BadRequest(
                f"dimensions: {req.dimensions} is not a size model {req.model!r} gives (its sizes: {sizes})",
                field="dimensions",
            )
        inputs = self._inputs(req, lane, settings)
        call = ModelCall(
            prompt="",
            tokenizer=lane.text.tokenizer_id,
            max_tokens=0,
            model=target.model,
            adapter=target.adapter,
            pool=Pooling(settings.pooling, settings.normalize, req.dimensions),
            inputs=inputs,
        )
        return PreparedEmbedding(req, target, call)

    async def batch_line(self, caller: Caller, body: dict[str, Any], slot: GateSlot | BatchSlot) -> Any:
        """A batch line's answer body, as the online call would have answered it (200), run on
        ``slot`` (the dispatcher's; given back whatever happens): ``prepare``, then the
        pipeline's ``serve_batch``. A refusal or failure raises its BallastError."""
        try:
            p = self.prepare(body, caller)
        except BaseException:
            slot.release()
            raise
        served = await self._pipeline.serve_batch(ModelRequest(caller, Criticality.SHEDDABLE, 0, False, p.call), slot)
        return self._body(served, p)

    def _inputs(self, req: ea.EmbeddingRequest, lane: Lane, settings: Any) -> tuple[tuple[int, ...], ...]:
        """Every input's ids within the model's bounds (step 4 of the module docstring)."""
        inputs = req.inputs
        if len(inputs) > settings.max_inputs:
            raise BadRequest(
                f"input: {len(inputs)} inputs; model {req.model!r} takes at most {settings.max_inputs} in one request",
                field="input",
            )
        text = lane.text
        one = len(inputs) == 1  # a single input is the whole field
        out: list[tuple[int, ...]] = []
        total = 0
        for i, one_input in enumerate(inputs):
            field = "input" if one else f"input.{i}"
            ids = _ids_of(one_input, text, field)
            self._bound(len(ids), text, settings, field)
            total += len(ids)
            if total > settings.max_request_tokens:
                raise BadRequest(
                    f"input: more than {settings.max_request_tokens} tokens in all (at input {i}), the most "
                    f"model {req.model!r} takes in one request",
                    field="input",
                )
            out.append(ids)
        return tuple(out)

    @staticmethod
    def _bound(tokens: int, text: ModelText, settings: Any, field: str) -> None:
        """One input's tokens: at least one, at most the context and ``max_input_tokens``."""
        if tokens < 1:
            raise ContextLengthExceeded(f"{field}: the input has no tokens; send at least one", field=field)
        if tokens > text.context:
            raise ContextLengthExceeded(
                f"{field}: the model's context is {text.context} tokens and the input is {tokens}", field=field
            )
        most = settings.max_input_tokens
        if most is not None and tokens > most:
            raise BadRequest(f"{field}: the input is {tokens} tokens; the most one input may be is {most}", field=field)

    @staticmethod
    def _body(answer: Answer, p: PreparedEmbedding) -> dict[str, Any]:
        """The answer's body: the model as the request named it when that model answered
        (an adapter's name, as on the other routes), the fallback's own name when it did."""
        settled = answer.settled
        if len(settled.embeddings) != len(p.call.inputs):  # an engine's fault: no answer rather than a wrong one
            raise ModelUnavailable(
                f"model {settled.model!r} answered {len(settled.embeddings)} vectors for {len(p.call.inputs)} inputs"
            )
        model = p.req.model if settled.model == p.target.model else settled.model
        return ea.embedding_list(model, settled.embeddings, p.req.encoding_format, answer.admission.prompt_tokens)


def _ids_of(one_input: str | list[int], text: ModelText, field: str) -> tuple[int, ...]:
    """One input's token ids: a text tokenized by the model's tokenizer with its special
    tokens (the byte model's: its bytes, whole; its prompts' encode keeps only their end),
    or token ids as sent, each below the vocabulary."""
    if isinstance(one_input, str):
        if text.tokenizer_id == BYTES_TOKENIZER:
            return tuple(encode_bytes(one_input))
        return tuple(text.encode(one_input, add_special_tokens=True))
    return tuple(model_token_ids(one_input, text.vocab_size, field))
