"""What the pipeline answers: how a request was admitted (``Admission``), a unary
answer as the fronts format it and an Idempotency-Key keeps it (``Answer``, ``Settled``),
and an admitted stream with what it learns as it runs (``Stream``, ``StreamState``).
The pipeline (``pipeline.py``) builds them; the fronts read them."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ballast.model.protocol import ChoiceResult, ModelChunk, TokenLogprob
from ballast.policies.criticality import Criticality
from ballast.policies.flex import ServiceTier
from ballast.router.accounts import Outcome
from ballast.router.calls import CallRecord
from ballast.router.ticket import Ticket

__all__ = ["Admission", "Answer", "Settled", "Stream", "StreamState"]


@dataclass(frozen=True)
class Admission:
    """What the level made of an admitted request."""

    criticality: Criticality
    level: int
    max_tokens: int  # clamped
    streaming: bool  # the level allows streaming
    prompt_tokens: int
    degraded_reasons: tuple[str, ...] = ()
    tier: ServiceTier = ServiceTier.DEFAULT  # the tier that served it (``ServiceTier.served``)

    def meta(self, model: str) -> dict[str, Any]:
        """What every native answer says about how it was admitted."""
        return {
            "model": model,
            "criticality": self.criticality.value,
            "service_tier": self.tier.value,
            "degradation_level": self.level,
            "degraded": bool(self.degraded_reasons),
            "degraded_reasons": list(self.degraded_reasons),
            "max_tokens": self.max_tokens,
        }


@dataclass(frozen=True)
class Settled:
    """A unary call's answer as an Idempotency-Key keeps it: the text, its tokens and
    finish reason, who answered (``fallback``: None, the primary; ``model``), and how
    many times it was sent again after its replica went away."""

    text: str
    tokens: int
    finish_reason: str | None
    fallback: str | None
    model: str
    migrations: int = 0
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache
    # What the call asked beyond the text (``ModelResult``'s): choice 0's log-probabilities,
    # the prompt's (echo), and every choice of a call of several.
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    choices: tuple[ChoiceResult, ...] = ()
    embeddings: tuple[bytes, ...] = ()  # an embeddings call's vectors, by input (float32 LE)


@dataclass(frozen=True)
class Answer:
    """A unary answer as the fronts format it: how it was admitted, what the model
    answered (``settled``), and whether it is the first answer to its Idempotency-Key,
    given again (``replayed``)."""

    admission: Admission
    settled: Settled
    replayed: bool = False


@dataclass
class StreamState:
    """What a stream learns as it runs: who answers and how much."""

    model: str
    fallback: str | None = None
    tokens: int = 0
    enough: bool = False
    finish: str | None = None  # the model's: "stop" (end of sequence, a stop string) or "length"
    cached_tokens: int | None = None  # prompt tokens the engine took from its prefix cache (its first word)
    call: CallRecord = field(default_factory=CallRecord)  # migrations: replicas lost mid-stream


class Stream:
    """An admitted stream: ``async for chunk in stream`` (``ModelChunk``s).

    Built from its chunk iterator and the state that iterator keeps: as it runs it says
    who answers (``fallback``, ``model``) and how much (``tokens``, ``finish``,
    ``migrations``). ``aclose`` settles its ticket, whether the stream was read whole,
    cut, or never begun; ``enough`` first, when the front closes it because it has all it
    wants (a stop string): that close is an answer, not a client that left."""

    def __init__(
        self, admission: Admission, ticket: Ticket, chunks: AsyncGenerator[ModelChunk, None], state: StreamState
    ) -> None:
        self.admission = admission
        self._ticket = ticket
        self._state = state
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[ModelChunk]:
        return self._chunks

    @property
    def fallback(self) -> str | None:
        return self._state.fallback

    @property
    def model(self) -> str:
        return self._state.model

    @property
    def tokens(self) -> int:
        return self._state.tokens

    @property
    def finish(self) -> str | None:
        return self._state.finish

    @property
    def migrations(self) -> int:
        return self._state.call.migrations

    @property
    def cached_tokens(self) -> int:
        return self._state.cached_tokens or 0

    def enough(self) -> None:
        self._state.enough = True

    async def aclose(self) -> None:
        await self._chunks.aclose()  # a stream that ran settles in its own finally
        self._ticket.finish(Outcome("OK" if self._state.enough else "CANCELLED"))  # one never begun: here
