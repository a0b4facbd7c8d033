"""`ballast status`'s batch and flex lines (ballast.ops.status_text) against a /v1/status
document whose ``batch`` and ``models.<m>.flex`` parts come from the real objects the
router's status route reads (ballast/router/admin.py: ``BatchDispatch.status()``;
ballast/router/pipeline.py: ``FlexHold.view()``).

The batch part is a real dispatcher and finalizer on a real redis-server (EmbeddedRedis)
and a real gate: one batch's line dead-lettered, another batch's lines running (held by
the one fake here, the model call, which needs Ray Serve), the rest queued; the wall clock
is a fake one moved by the test. The flex part is a real hold refusing one request past
its size. The rest of the document is test_cli_status.py's, built from the controller's
core.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import batchkit
import pytest
from batchkit import open_store

from ballast.batch.embedded import EmbeddedRedis
from ballast.batch.store import BatchStore
from ballast.config import load_config
from ballast.errors import ModelUnavailable
from ballast.ops.status_text import format_status
from ballast.policies.flex import FlexQueue, FlexRefused
from ballast.policies.limiter import AimdLimit, LimiterConfig
from ballast.router.dispatcher import BatchDispatch, Finalizer, ModelDispatcher
from ballast.router.flex import FlexHold
from ballast.router.gate import PriorityGate
from tests.unit.fakes import FakeClock
from tests.unit.test_cli_status import MODEL, live_document, model_block

T0 = 1_800_000_000


class ModelCall:
    """The one fake: stands in for ``OpenAIFront.batch_line`` (a model deployment needs Ray
    Serve). Fails with ``error`` if given, else holds every call until ``release`` is set;
    gives the slot back as the real call's ticket does."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.release = asyncio.Event()

    async def __call__(self, caller: Any, body: dict[str, Any], chat: bool, slot: Any) -> Any:
        try:
            if self.error is not None:
                raise self.error
            await self.release.wait()
            return {"id": "chatcmpl-1", "choices": [{"message": {"content": "ok"}}]}
        finally:
            slot.release()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    yield from batchkit.serve(tmp_path_factory)


@pytest.fixture
async def store(server: EmbeddedRedis) -> AsyncIterator[BatchStore]:
    async for s in open_store(server):
        yield s


async def new_batch(store: BatchStore, lines: int, queued_at: float) -> None:
    await batchkit.new_batch(store, lines, MODEL, "gold", queued_at)


def dispatcher(store: BatchStore, call: ModelCall, gate: PriorityGate, wall: FakeClock, **batch: Any) -> Any:
    cfg = load_config({"batch": batch})
    return ModelDispatcher(MODEL, gate, lambda: 0, call, store, cfg, "router-a", clock=wall, wall=wall, rng=lambda: 0.5)


def flex_view() -> dict[str, Any]:
    """A model's flex hold as ``/v1/status`` shows it: two requests held (the older for 3 s),
    one refused, the hold being full."""
    clock = FakeClock(0)
    hold = FlexHold(FlexQueue(max_held=2, clock=clock), room=lambda: 0, interval_s=1.0, model=MODEL, clock=clock)
    hold.queue.push("gold", 600, 4)
    clock.advance(2)
    hold.queue.push("free", 600, 4)
    with pytest.raises(FlexRefused):
        hold.queue.push("free", 600, 4)
    clock.advance(1)
    return hold.view()


async def test_each_model_shows_its_batch_queue_dead_letters_dispatch_and_flex_hold(store: BatchStore) -> None:
    wall = FakeClock(T0)
    gate = PriorityGate(AimdLimit(LimiterConfig(initial=4, min_limit=1)), max_waiting=16, max_wait_s=5.0)

    # One line that fails retryably on its one attempt: dead-lettered.
    await new_batch(store, 1, queued_at=T0)
    failing = dispatcher(store, ModelCall(ModelUnavailable("no replica")), gate, wall, max_attempts=1)
    assert await failing.step() == 1
    await asyncio.gather(*failing.running)
    assert failing.outcomes == {"dead_lettered": 1}

    # Five lines queued 42 s before the finalizer reads the store; the room starts some.
    await new_batch(store, 5, queued_at=T0)
    wall.advance(42)
    call = ModelCall()
    d = dispatcher(store, call, gate, wall)
    running = await d.step()
    assert 0 < running < 5 and len(d.running) == running and d.room() == 0
    finalizer = Finalizer(store, [MODEL], wall=wall)
    await finalizer.step()
    dispatch = BatchDispatch({MODEL: d}, finalizer, interval_s=1.0)

    doc = live_document()
    doc["batch"] = dispatch.status()  # as GET /v1/status carries it
    doc["models"][MODEL]["flex"] = flex_view()
    assert doc["batch"]["models"][MODEL]["queued"] == 5  # the running lines stay on the stream until acked
    block = model_block(format_status(doc))
    assert "  batch queue: 5 lines queued or running, oldest 42 s; dead letters: 1" in block
    assert f"  batch here: {running} running, 0 held, room for 0 more" in block
    # no interactive rows sampled yet: the gate's limit bounds the step
    assert "  batch step bound: 4 rows with interactive ones; no interactive rows in the window" in block
    assert "  flex: 2 held (at most 2), oldest 3.0 s, refused queue_full 1" in block
    assert "batches finalized by this router: 0" in format_status(doc).splitlines()
    # both batches: the dead-lettered line's waits for it (until its window ends), the other runs
    assert "batches in progress: 2" in format_status(doc).splitlines()

    call.release.set()  # the held lines answer; the finalizer ends nothing until every line has
    await asyncio.gather(*d.running)
    await finalizer.step()
    doc["batch"] = dispatch.status()
    block = model_block(format_status(doc))
    assert f"  batch queue: {5 - running} lines queued or running, oldest 42 s; dead letters: 1" in block
    here = f"  batch here: 0 running, 0 held, room for {d.room()} more; lines since it started: completed {running}"
    assert here in block


def test_a_router_without_a_store_says_batch_is_off_and_an_older_one_says_nothing() -> None:
    doc = live_document()
    before = format_status(doc)  # a router older than the Batch API: no batch key, no batch line
    assert not any(line.lstrip().startswith(("batch", "flex")) for line in before.splitlines())
    doc["batch"] = None  # batch.enabled false, or no batch.store_url (the route's null)
    text = format_status(doc)
    off = "batch: off at this router (batch.enabled false or no batch.store_url): its routes answer 503"
    lines = text.splitlines()
    at = lines.index(off)  # after the model blocks, before what the router shares: nothing else changed
    assert lines[at + 1] == "replicas (desired / running):"
    assert lines[:at] + lines[at + 1 :] == before.splitlines()


def test_a_model_whose_queue_was_not_read_yet_says_so() -> None:
    doc = live_document()
    doc["batch"] = {
        "models": {MODEL: {"room": 3, "held": 0, "running": 0, "interactive_rate_per_s": 0.0, "lines": {}}},
        "finalized": 2,
    }
    text = format_status(doc)
    block = model_block(text)
    assert "  batch queue: not read from the store yet" in block
    assert "  batch here: 0 running, 0 held, room for 3 more" in block
    assert not any("step bound" in line for line in block)  # a router older than the bound: not shown
    assert "batches finalized by this router: 2" in text.splitlines()
    assert not any(line.startswith("batches in progress") for line in text.splitlines())  # not read yet
