"""The pure parts of ballast/router/resilience_parts.py: Bulkhead, ResponseCache, classify().

No Ray is started: the Ray and Serve exception classes are constructed directly,
as their public constructors allow.
"""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeClock
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    NodeDiedError,
    OwnerDiedError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from ballast.errors import DeadlineExceeded, ModelUnavailable
from ballast.model.chaos import InjectedFault
from ballast.model.protocol import ModelCall, ModelResult, RowSampling
from ballast.policies.migration import LOST_CAPACITY
from ballast.policies.retry import FAILURE_KINDS
from ballast.router.resilience_parts import BREAKER_FAILURES, Bulkhead, ResponseCache, classify

# -- Bulkhead --------------------------------------------------------------------------


def test_bulkhead_admits_up_to_its_limit_then_rejects() -> None:
    b = Bulkhead(2)
    assert [b.try_enter() for _ in range(4)] == [True, True, False, False]
    assert b.in_flight == 2
    assert b.rejected == 2


def test_bulkhead_frees_a_slot_on_leave() -> None:
    b = Bulkhead(1)
    assert b.try_enter()
    assert not b.try_enter()
    b.leave()
    assert b.in_flight == 0
    assert b.try_enter()
    assert b.rejected == 1  # only the one refusal


def test_bulkhead_rejection_does_not_take_a_slot() -> None:
    b = Bulkhead(1)
    b.try_enter()
    for _ in range(3):
        assert not b.try_enter()
    assert b.in_flight == 1
    b.leave()
    assert b.in_flight == 0


def test_bulkhead_leave_never_goes_negative() -> None:
    b = Bulkhead(2)
    b.leave()
    b.leave()
    assert b.in_flight == 0
    # and an extra leave does not create capacity beyond the limit
    assert [b.try_enter() for _ in range(3)] == [True, True, False]


def test_bulkhead_of_zero_rejects_everything() -> None:
    b = Bulkhead(0)
    assert not b.try_enter()
    assert (b.in_flight, b.rejected) == (0, 1)


# -- ResponseCache --------------------------------------------------------------------


def call(prompt: str, max_tokens: int, stops: tuple[str, ...] = (), **sampling) -> ModelCall:
    return ModelCall(prompt, max_tokens=max_tokens, stops=stops, sampling=RowSampling(**sampling) if sampling else None)


def answer(text: str) -> ModelResult:
    return ModelResult(text, len(text), "stop")


def make_cache(max_entries: int = 10, ttl_s: int = 5) -> tuple[ResponseCache, FakeClock]:
    clock = FakeClock()
    return ResponseCache(max_entries, ttl_s, clock=clock), clock


def test_cache_miss_then_hit_returns_the_stored_result() -> None:
    cache, _ = make_cache()
    assert cache.get("acme", call("hi", 8)) is None
    stored = answer("hello")
    cache.put("acme", call("hi", 8), stored)
    assert cache.get("acme", call("hi", 8)) is stored
    assert len(cache) == 1


def test_cache_key_is_the_whole_call_sampling_and_stops_included() -> None:
    cache, _ = make_cache()
    cache.put("acme", call("hi", 8, temperature=0.7, seed=1), answer("a"))
    assert cache.get("acme", call("hi", 8)) is None
    assert cache.get("acme", call("hi", 8, temperature=0.7, seed=2)) is None
    assert cache.get("acme", call("hi", 8, temperature=0.7, seed=1, stops=("x",))) is None
    assert cache.get("acme", call("hi", 8, seed=1, temperature=0.7)) == answer("a")  # order does not matter


def test_cache_key_is_prompt_and_max_tokens() -> None:
    cache, _ = make_cache()
    cache.put("acme", call("hi", 8), answer("a"))
    assert cache.get("acme", call("hi", 16)) is None
    assert cache.get("acme", call("Hi", 8)) is None
    cache.put("acme", call("hi", 16), answer("b"))
    assert cache.get("acme", call("hi", 8)) == answer("a")
    assert cache.get("acme", call("hi", 16)) == answer("b")
    assert len(cache) == 2


def test_cache_ttl_walked_second_by_second() -> None:
    cache, clock = make_cache(ttl_s=3)
    cache.put("acme", call("p", 1), answer("x"))  # stored at t=0
    for t in (1, 2, 3):  # age <= ttl: hit, the boundary included
        clock.now_s = t
        assert cache.get("acme", call("p", 1)) == answer("x"), t
    clock.now_s = 4  # age 4 > 3: gone, and removed
    assert cache.get("acme", call("p", 1)) is None
    assert len(cache) == 0


def test_cache_get_does_not_extend_the_ttl() -> None:
    cache, clock = make_cache(ttl_s=3)
    cache.put("acme", call("p", 1), answer("x"))
    clock.now_s = 3
    assert cache.get("acme", call("p", 1)) is not None  # a hit refreshes recency, not age
    clock.now_s = 4
    assert cache.get("acme", call("p", 1)) is None


def test_cache_put_again_restarts_the_ttl_and_replaces_the_value() -> None:
    cache, clock = make_cache(ttl_s=3)
    cache.put("acme", call("p", 1), answer("old"))
    clock.now_s = 2
    cache.put("acme", call("p", 1), answer("new"))
    clock.now_s = 5  # 5 from the first put, 3 from the second
    assert cache.get("acme", call("p", 1)) == answer("new")
    assert len(cache) == 1
    clock.now_s = 6
    assert cache.get("acme", call("p", 1)) is None


def test_cache_evicts_least_recently_used_at_max_entries() -> None:
    cache, _ = make_cache(max_entries=2, ttl_s=100)
    cache.put("acme", call("a", 1), answer("a"))
    cache.put("acme", call("b", 1), answer("b"))
    cache.put("acme", call("c", 1), answer("c"))  # a is the least recently used
    assert len(cache) == 2
    assert cache.get("acme", call("a", 1)) is None
    assert cache.get("acme", call("b", 1)) == answer("b")
    assert cache.get("acme", call("c", 1)) == answer("c")


def test_cache_get_refreshes_recency() -> None:
    cache, _ = make_cache(max_entries=2, ttl_s=100)
    cache.put("acme", call("a", 1), answer("a"))
    cache.put("acme", call("b", 1), answer("b"))
    assert cache.get("acme", call("a", 1)) is not None  # a becomes the most recent
    cache.put("acme", call("c", 1), answer("c"))  # so b goes
    assert cache.get("acme", call("b", 1)) is None
    assert cache.get("acme", call("a", 1)) == answer("a")
    assert cache.get("acme", call("c", 1)) == answer("c")


def test_cache_put_of_an_existing_key_refreshes_recency_without_growing() -> None:
    cache, _ = make_cache(max_entries=2, ttl_s=100)
    cache.put("acme", call("a", 1), answer("a"))
    cache.put("acme", call("b", 1), answer("b"))
    cache.put("acme", call("a", 1), answer("a2"))
    assert len(cache) == 2
    cache.put("acme", call("c", 1), answer("c"))  # b is now the least recent
    assert cache.get("acme", call("b", 1)) is None
    assert cache.get("acme", call("a", 1)) == answer("a2")


def test_cache_a_miss_does_not_change_recency() -> None:
    cache, _ = make_cache(max_entries=2, ttl_s=100)
    cache.put("acme", call("a", 1), answer("a"))
    cache.put("acme", call("b", 1), answer("b"))
    assert cache.get("acme", call("a", 2)) is None  # different key: a is not touched
    cache.put("acme", call("c", 1), answer("c"))
    assert cache.get("acme", call("a", 1)) is None


def test_cache_never_exceeds_max_entries() -> None:
    cache, clock = make_cache(max_entries=3, ttl_s=100)
    for i in range(10):
        clock.advance(1)
        cache.put("acme", call(f"p{i}", 1), answer(str(i)))
        assert len(cache) == min(i + 1, 3)
    assert [cache.get("acme", call(f"p{i}", 1)) for i in (7, 8, 9)] == [answer("7"), answer("8"), answer("9")]


# -- classify -------------------------------------------------------------------------


def test_classify_asyncio_timeout_is_an_attempt_timeout() -> None:
    assert classify(asyncio.TimeoutError()) == "attempt_timeout"


async def test_classify_the_error_wait_for_actually_raises() -> None:
    with pytest.raises(asyncio.TimeoutError) as info:
        await asyncio.wait_for(asyncio.Event().wait(), timeout=0)  # times out at once: no real wait
    assert classify(info.value) == "attempt_timeout"


def test_classify_backpressure() -> None:
    assert classify(BackPressureError(num_queued_requests=10, max_queued_requests=10)) == "backpressure"


def test_classify_actor_died() -> None:
    assert classify(ActorDiedError()) == "replica_died"


def test_classify_actor_unavailable() -> None:
    assert classify(ActorUnavailableError("gone for now", None)) == "replica_died"


def test_classify_replica_unavailable() -> None:
    assert classify(ReplicaUnavailableError("replica-1")) == "replica_died"


def test_classify_deployment_unavailable() -> None:
    exc = DeploymentUnavailableError(DeploymentID(name="model", app_name="ballast"))
    assert classify(exc) == "replica_died"


def test_classify_deadline_exceeded() -> None:
    assert classify(DeadlineExceeded("late")) == "deadline_exceeded"


def test_classify_deadline_exceeded_raised_in_a_replica() -> None:
    # Ray wraps a remote exception in RayTaskError, and re-raises it as an instance of both.
    wrapped = RayTaskError("generate", "traceback", DeadlineExceeded("late"))
    assert classify(wrapped) == "deadline_exceeded"
    assert classify(wrapped.as_instanceof_cause()) == "deadline_exceeded"


@pytest.mark.parametrize(
    "exc",
    [
        Exception("boom"),
        RuntimeError("cuda error"),
        ValueError("bad input"),
        InjectedFault("chaos"),
        ModelUnavailable("nope"),
        RayTaskError("generate", "traceback", RuntimeError("oom")),
    ],
    ids=["Exception", "RuntimeError", "ValueError", "InjectedFault", "ModelUnavailable", "RayTaskError(RuntimeError)"],
)
def test_classify_anything_else_is_a_model_error(exc: BaseException) -> None:
    assert classify(exc) == "model_error"


def test_breaker_failures_exclude_backpressure_deadline_and_lost_capacity() -> None:
    assert BREAKER_FAILURES == {"attempt_timeout", "model_error"}
    assert "backpressure" not in BREAKER_FAILURES
    # the client's deadline says nothing about the backend's health either
    assert "deadline_exceeded" not in BREAKER_FAILURES
    # nor does a replica or node that went away: Serve replaces it; the request migrates
    assert LOST_CAPACITY not in BREAKER_FAILURES


def test_classify_kinds_are_retry_kinds_and_three_spare_the_breaker() -> None:
    kinds = {
        classify(e)
        for e in (
            asyncio.TimeoutError(),
            BackPressureError(1, 1),
            ActorDiedError(),
            DeadlineExceeded("x"),
            Exception("x"),
        )
    }
    assert kinds == {"attempt_timeout", "backpressure", "replica_died", "deadline_exceeded", "model_error"}
    assert kinds <= FAILURE_KINDS  # should_retry raises on a kind it does not know
    assert kinds - BREAKER_FAILURES == {"backpressure", "deadline_exceeded", "replica_died"}


@pytest.mark.parametrize(
    "error",
    [
        ActorDiedError(),
        ActorUnavailableError("the node is gone", b"\x00" * 16),
        NodeDiedError("node lost"),
        WorkerCrashedError(),
        OwnerDiedError("00" * 28, None, "generate"),
        RayTaskError("generate_stream", "traceback", ActorDiedError()),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_way_a_replica_or_node_goes_away_is_lost_capacity(error) -> None:
    assert classify(error) == LOST_CAPACITY


@pytest.mark.parametrize(
    "error",
    [
        RayTaskError("generate", "traceback", RuntimeError("CUDA error: an illegal memory access")),
        RayTaskError("generate", "traceback", InjectedFault("chaos error")),
        Exception("anything else"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_what_the_model_itself_got_wrong_is_a_model_error(error) -> None:
    assert classify(error) == "model_error"
    assert "model_error" in BREAKER_FAILURES


def test_a_timeout_raised_inside_the_replica_is_a_model_error_not_our_attempt_timeout():
    wrapped = RayTaskError("generate", "traceback", TimeoutError("the model timed out")).as_instanceof_cause()
    assert isinstance(wrapped, TimeoutError)  # why the order in classify() matters
    assert classify(wrapped) == "model_error"


def test_a_replica_death_wrapped_in_a_task_error_is_still_a_replica_death():
    wrapped = RayTaskError("generate", "traceback", ActorDiedError())
    assert classify(wrapped) == "replica_died"
