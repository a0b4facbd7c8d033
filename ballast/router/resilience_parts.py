"""The resilient caller's parts that hold no policy of their own: the bulkhead, the answer
cache, and how a failed attempt is classified (``ballast.router.resilience``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    NodeDiedError,
    OwnerDiedError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from ballast.errors import DeadlineExceeded, InvalidRequest
from ballast.model.protocol import ModelCall, ModelResult
from ballast.policies.ttlmap import TTLMap


class Bulkhead:
    """A concurrency limit without a queue: full means "try elsewhere", at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self.rejected = 0

    def try_enter(self) -> bool:
        if self.in_flight >= self.limit:
            self.rejected += 1
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)


class ResponseCache:
    """Answers to identical calls by the same tenant, bounded in count (overall and per
    tenant) and age.

    Identical means the same tenant and the whole call: prompt, max_tokens, sampling
    (temperature, top_p, seed), stop strings, how the prompt is tokenized. A tenant gets
    only its own earlier answers (another's would tell it what someone asked), and a
    tenant past ``max_entries_per_tenant`` loses its own least recently used answers,
    never another's. A cached greedy answer is the answer; a cached sampled one is one
    fair sample, which is what a fallback can give."""

    def __init__(
        self,
        max_entries: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_entries_per_tenant: int | None = None,
    ):
        self._clock = clock
        # Least recently used first: a hit or a put makes an entry the newest.
        self._entries: TTLMap[tuple[str, ModelCall], ModelResult] = TTLMap(
            ttl_s, max_entries, max_entries_per_group=max_entries_per_tenant, group=lambda k: k[0]
        )

    def get(self, tenant: str, call: ModelCall) -> ModelResult | None:
        """The answer stored for ``tenant``'s ``call`` within ``ttl_s``, or None; a hit
        refreshes recency, not age."""
        return self._entries.get((tenant, call), self._clock(), touch=True)

    def put(self, tenant: str, call: ModelCall, result: ModelResult) -> None:
        """Store ``result`` for ``tenant``'s ``call``, its TTL starting now; the least
        recently used (the tenant's own, at its bound) goes when full."""
        self._entries.put((tenant, call), result, self._clock(), done=True)

    def __len__(self) -> int:
        return len(self._entries)


def classify(exc: BaseException) -> str:
    """Map a failed attempt to the kinds ``ballast.policies.retry.should_retry`` knows."""
    if isinstance(exc, RayTaskError):
        # Raised inside the replica (Ray re-raises it as a subclass of the cause's type,
        # so this comes first: a TimeoutError *in the model* is not our attempt timeout).
        # Judge by the cause: a replica that died under the call is still a replica death.
        cause = exc.cause
        if isinstance(cause, DeadlineExceeded):
            return "deadline_exceeded"
        if isinstance(cause, (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)):
            return "replica_died"
        return "model_error"
    if isinstance(exc, asyncio.TimeoutError):
        return "attempt_timeout"
    if isinstance(exc, BackPressureError):
        return "backpressure"
    if isinstance(exc, (ActorDiedError, ActorUnavailableError, ReplicaUnavailableError, DeploymentUnavailableError)):
        return "replica_died"
    if isinstance(exc, DeadlineExceeded):
        return "deadline_exceeded"
    if isinstance(exc, (RayActorError, NodeDiedError, WorkerCrashedError, OwnerDiedError)):
        return "replica_died"
    return "model_error"


def refused_by_engine(exc: BaseException) -> InvalidRequest | None:
    """The replica's refusal of the request as sent (``EngineRefused``: its engine's own
    validation), which the client gets as it is; None for any other failure."""
    cause = exc.cause if isinstance(exc, RayTaskError) else None
    return cause if isinstance(cause, InvalidRequest) else None


# Failures that say the backend is unhealthy. Backpressure is load, which the
# degradation level handles; a lost replica is capacity that is gone (Serve replaces
# it): neither trips nor heals a breaker.
BREAKER_FAILURES = {"attempt_timeout", "model_error"}


def uncached(call: ModelCall) -> bool:
    """A call whose answer is not cached, the cache's bound being in entries, not bytes:
    one with log-probabilities (up to 21 entries a token), or an embeddings call (a vector
    per input, up to thousands of inputs)."""
    return call.logprobs is not None or call.prompt_logprobs is not None or call.pool is not None
