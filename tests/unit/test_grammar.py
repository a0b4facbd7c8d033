"""Guided-decoding compiles off the event loop (ballast.model.grammar), against the real
xgrammar compiler over the tiny model's tokenizer: a schema of nested anyOf that takes
about a second to compile here is refused after its limit while the loop, and a second
compile thread, keep serving; a thread stays taken until its compile ends; verdicts are
remembered. The threads are shared among tenants: one tenant's slow compiles hold at
most its share, walked step by step with compiles the test ends (``HeldCompiles``), and
shown with the real compiler."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import pytest

xgr = pytest.importorskip("xgrammar")

from ballast.errors import EngineRefused, SchemaTooComplex  # noqa: E402
from ballast.model.grammar import GrammarCompiles  # noqa: E402


def nested_any_of(depth: int, leaf: str = "string") -> str:
    """anyOf of (array of it, map of it, it), ``depth`` deep, over a ``leaf`` type: its grammar
    grows about 3x to 8x a level (depth 7: about a second here; depth 3: milliseconds)."""
    s: dict = {"type": leaf}
    for _ in range(depth):
        s = {"anyOf": [{"type": "array", "items": s}, {"type": "object", "additionalProperties": s}, s]}
    return json.dumps(s)


SLOW, FAST = nested_any_of(7), json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}})


@pytest.fixture(scope="module")
def compile_schema():
    from tests.unit.hf_fixture import train_tokenizer

    tok = train_tokenizer()
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)), max_threads=1, cache_enabled=False
    )

    def run(schema: str) -> None:
        try:
            compiler.compile_json_schema(schema)
        except RuntimeError as e:  # as the vLLM engine's compile hands a refusal on
            raise ValueError(str(e)) from None

    return run


async def until_idle(gate: GrammarCompiles) -> None:
    await until(lambda: gate.running == 0)


async def until(done: Callable[[], bool]) -> None:
    """Wait for a compile thread to get somewhere (a hand-over between threads, not a time
    the test measures): at most a minute."""
    for _ in range(6000):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the compile threads never got there")


class HeldCompiles:
    """A compile the test ends: a schema named in ``held`` compiles until ``end(schema)``
    (so it is always past the limit of 1 s below), any other at once. ``started``: the
    schemas in the order their compiles began."""

    def __init__(self, *held: str) -> None:
        self._ends = {name: threading.Event() for name in held}
        self.started: list[str] = []

    def __call__(self, schema: str) -> None:
        self.started.append(schema)
        end = self._ends.get(schema)
        if end is not None:
            assert end.wait(60), f"{schema} was never ended"

    def end(self, schema: str) -> None:
        self._ends[schema].set()


async def test_a_slow_schema_is_refused_at_its_limit_while_the_loop_and_other_schemas_go_on(compile_schema):
    gate = GrammarCompiles(compile_schema, threads=2, timeout_s=0.05)
    ticks = 0

    async def ticker() -> None:  # another request's work on the same event loop
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    beside = asyncio.get_running_loop().create_task(ticker())
    try:
        slow = asyncio.ensure_future(gate.check(SLOW, "tools", tenant="a"))
        await gate.check(FAST, "response_format", tenant="b")  # the second thread: compiled while the slow one runs
        assert not slow.done() and gate.running == 1
        with pytest.raises(SchemaTooComplex) as e:
            await slow
        assert e.value.field == "tools" and e.value.status == 400 and e.value.code == "SCHEMA_TOO_COMPLEX"
        assert ticks >= 10  # the loop was never blocked by the compile
        assert gate.running == 1  # it runs on to its end in its thread, still holding it
    finally:
        beside.cancel()
    await until_idle(gate)
    assert gate.compiles == 2
    with pytest.raises(SchemaTooComplex):  # sent again (by anyone): refused at once, no second compile
        await gate.check(SLOW, "response_format", tenant="b")
    await gate.check(FAST, "response_format")
    assert gate.compiles == 2 and gate.running == 0
    gate.close()


async def test_a_compile_holds_its_thread_to_its_end_so_a_flood_cannot_pile_threads(compile_schema):
    gate = GrammarCompiles(compile_schema, threads=1, timeout_s=0.05)
    with pytest.raises(SchemaTooComplex):
        await gate.check(SLOW, "response_format")
    nxt = asyncio.ensure_future(gate.check(FAST, "response_format"))
    await asyncio.sleep(0.02)
    assert gate.running == 1 and gate.compiles == 1 and not nxt.done()  # waits on the loop, no thread
    await nxt  # once the slow compile ended
    assert gate.compiles == 2 and gate.running == 0
    gate.close()


async def test_a_waiting_check_cancelled_by_its_deadline_takes_nothing(compile_schema):
    gate = GrammarCompiles(compile_schema, threads=1, timeout_s=0.05)
    with pytest.raises(SchemaTooComplex):
        await gate.check(SLOW, "response_format")
    with pytest.raises(asyncio.TimeoutError):  # the replica's wait_for: the request's deadline
        await asyncio.wait_for(gate.check(nested_any_of(2), "response_format"), 0.01)
    await until_idle(gate)
    await gate.check(FAST, "response_format")
    assert gate.compiles == 2  # the cancelled one never compiled


async def test_a_schema_the_engine_refuses_is_engine_refused_and_remembered(compile_schema):
    calls = []

    def refusing(schema: str) -> None:
        calls.append(schema)
        raise ValueError("multi-branch allOf is not served")

    gate = GrammarCompiles(refusing, threads=1, timeout_s=5.0, remembered=2)
    for _ in range(2):
        with pytest.raises(EngineRefused) as e:
            await gate.check("{}", "tools")
        assert e.value.field == "tools" and "multi-branch allOf" in e.value.message
    assert len(calls) == 1
    for s in ('{"a": 1}', '{"b": 1}'):  # two more verdicts: the first one is forgotten
        with pytest.raises(EngineRefused):
            await gate.check(s, "tools")
    with pytest.raises(EngineRefused):
        await gate.check("{}", "tools")
    assert len(calls) == 4


async def test_one_tenants_slow_compiles_hold_its_share_and_the_others_compile_beside_them():
    compiles = HeldCompiles("noisy-1", "noisy-2", "noisy-3")
    gate = GrammarCompiles(compiles, threads=2, timeout_s=1.0)
    assert gate.per_tenant == 1  # half the threads
    first = asyncio.ensure_future(gate.check("noisy-1", "response_format", tenant="noisy"))
    second = asyncio.ensure_future(gate.check("noisy-2", "response_format", tenant="noisy"))
    with pytest.raises(SchemaTooComplex):
        await first  # past its limit; its compile runs on, holding the tenant's one thread
    assert (gate.running, gate.held("noisy"), compiles.started) == (1, 1, ["noisy-1"])
    assert not second.done()  # a thread is free, but not to this tenant
    await gate.check("quiet-1", "response_format", tenant="quiet")  # the other thread: at once
    await gate.check("quiet-2", "tools", tenant="quiet")
    assert (gate.running, gate.held("quiet"), compiles.started[1:]) == (1, 0, ["quiet-1", "quiet-2"])
    assert not second.done()
    compiles.end("noisy-1")  # its thread is the tenant's again: the waiting one takes it
    await until(lambda: "noisy-2" in compiles.started)
    with pytest.raises(SchemaTooComplex):
        await second
    # A caller cancelled while it waits (its deadline) takes nothing and leaves the line.
    third = asyncio.ensure_future(gate.check("noisy-3", "response_format", tenant="noisy"))
    await asyncio.sleep(0)
    third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await third
    compiles.end("noisy-2")
    await until_idle(gate)
    await gate.check("quiet-3", "response_format", tenant="quiet")
    assert "noisy-3" not in compiles.started and gate.held("noisy") == 0 and gate.compiles == 5
    gate.close()


async def test_waiters_take_free_threads_in_arrival_order_within_their_shares():
    compiles = HeldCompiles("a-1", "b-1", "a-2", "b-2", "c-1")
    gate = GrammarCompiles(compiles, threads=2, timeout_s=1.0)

    def check(name: str) -> asyncio.Future[None]:
        return asyncio.ensure_future(gate.check(name, "response_format", tenant=name[0]))

    running = [check("a-1"), check("b-1")]
    await until(lambda: len(compiles.started) == 2)
    waiting = [check("a-2"), check("b-2"), check("c-1")]  # in this order
    await asyncio.sleep(0)
    compiles.end("b-1")  # the first in line is a's, which holds its share: b's next one goes
    await until(lambda: len(compiles.started) == 3)
    assert compiles.started[2] == "b-2"
    compiles.end("a-1")  # a's second, first in line, now may
    await until(lambda: len(compiles.started) == 4)
    assert compiles.started[3] == "a-2"
    compiles.end("b-2")
    await until(lambda: len(compiles.started) == 5)
    assert compiles.started[4] == "c-1"
    # Each compiled, or was past its 1 s while the test held it (a-2 and c-1 are still held).
    outcomes = await asyncio.gather(*running, *waiting, return_exceptions=True)
    assert all(o is None or isinstance(o, SchemaTooComplex) for o in outcomes)
    assert isinstance(outcomes[2], SchemaTooComplex) and isinstance(outcomes[4], SchemaTooComplex)
    for name in ("a-2", "c-1"):
        compiles.end(name)
    await until_idle(gate)
    gate.close()


async def test_two_slow_schemas_of_one_tenant_leave_another_tenants_compile_a_thread(compile_schema):
    """The real compiler: a tenant sends two slow schemas at once; the first takes the
    tenant's one thread and is refused at its limit, still compiling, the second waits for
    that thread; another tenant's schema compiles meanwhile on the other."""
    gate = GrammarCompiles(compile_schema, threads=2, timeout_s=0.2)
    slow = [
        asyncio.ensure_future(gate.check(nested_any_of(7, leaf), "tools", tenant="noisy"))
        for leaf in ("string", "integer")
    ]
    with pytest.raises(SchemaTooComplex):
        await slow[0]
    await gate.check(FAST, "response_format", tenant="quiet")
    assert (gate.held("noisy"), gate.compiles) == (1, 2) and not slow[1].done()  # still compiling, still waiting
    slow[1].cancel()
    await until_idle(gate)
    gate.close()


def test_settings_are_checked():
    for bad in (
        dict(threads=0, timeout_s=1.0),
        dict(threads=1, timeout_s=0),
        dict(threads=1, timeout_s=1.0, remembered=0),
        dict(threads=2, timeout_s=1.0, per_tenant=3),
        dict(threads=2, timeout_s=1.0, per_tenant=0),
    ):
        with pytest.raises(ValueError):
            GrammarCompiles(lambda s: None, **bad)
    assert [GrammarCompiles(lambda s: None, threads=n, timeout_s=1.0).per_tenant for n in (1, 2, 3, 8)] == [1, 1, 1, 4]
