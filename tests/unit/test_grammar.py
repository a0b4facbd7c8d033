"""Guided-decoding compiles off the event loop (ballast.model.grammar), against the real
xgrammar compiler over the tiny model's tokenizer: a schema of nested anyOf that takes
about a second to compile here is refused after its limit while the loop, and a second
compile thread, keep serving; a thread stays taken until its compile ends; verdicts are
remembered."""

from __future__ import annotations

import asyncio
import json

import pytest

xgr = pytest.importorskip("xgrammar")

from ballast.errors import EngineRefused, SchemaTooComplex  # noqa: E402
from ballast.model.grammar import GrammarCompiles  # noqa: E402


def nested_any_of(depth: int) -> str:
    """anyOf of (array of it, map of it, it), ``depth`` deep: its grammar grows about 3x a level
    (depth 7: about a second here; depth 3: milliseconds)."""
    s: dict = {"type": "string"}
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
    for _ in range(6000):  # a slow compile runs on to its end: at most a minute
        if gate.running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the compile never ended")


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
        slow = asyncio.ensure_future(gate.check(SLOW, "tools"))
        await gate.check(FAST, "response_format")  # the second thread: compiled while the slow one runs
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
    with pytest.raises(SchemaTooComplex):  # sent again: refused at once, no second compile
        await gate.check(SLOW, "response_format")
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


def test_settings_are_checked():
    for bad in (
        dict(threads=0, timeout_s=1.0),
        dict(threads=1, timeout_s=0),
        dict(threads=1, timeout_s=1.0, remembered=0),
    ):
        with pytest.raises(ValueError):
            GrammarCompiles(lambda s: None, **bad)
