"""ballast.policies.engines: what each engine does itself (one table), the step curve that
says how many rows an engine runs usefully, and the gate's ceiling from it."""

import math
from types import MappingProxyType

import pytest

from ballast.model.protocol import ModelCall, RowSampling
from ballast.policies import control
from ballast.policies.engines import (
    ASKED_BY,
    ENGINES,
    MIN_ROWS,
    Engine,
    StepCurve,
    capabilities,
    honours,
    model_ceiling,
    unhonoured_request_fields,
)
from ballast.policies.reports import ReplicaReport


def test_every_engine_honours_a_plain_call():
    call = ModelCall("hi", max_tokens=8, sampling=RowSampling(temperature=0.7, seed=1, top_k=5, ignore_eos=True))
    assert all(honours(engine, call.asks) for engine in ("builtin", "transformers", "vllm"))


def test_vllms_own_fields_keep_a_call_on_vllm():
    for field, value in (
        ("json_schema", '{"type":"object"}'),
        ("repetition_penalty", 1.3),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -0.5),
        ("logit_bias", ((3, 5.0),)),
        ("structural_tag", '{"type":"structural_tag"}'),
        ("keep_special_tokens", True),
    ):
        call = ModelCall("hi", sampling=RowSampling(**{field: value}))
        assert call.asks == {field}
        assert honours("vllm", call.asks)
        assert not honours("builtin", call.asks) and not honours("transformers", call.asks)
    # Neutral values ask for nothing.
    assert ModelCall("hi", sampling=RowSampling(json_schema=None, repetition_penalty=1.0)).asks == frozenset()


def test_a_calls_adapter_keeps_it_on_vllm_and_asks_no_request_field():
    call = ModelCall("hi", adapter="sql", sampling=RowSampling(repetition_penalty=1.3))
    assert call.asks == {"adapter", "repetition_penalty"}
    assert ModelCall("hi", adapter="sql").asks == {"adapter"}
    assert honours("vllm", call.asks)
    assert not honours("builtin", call.asks) and not honours("transformers", call.asks)
    assert "model" not in unhonoured_request_fields("builtin")  # the router resolves a request's model itself


def test_the_fronts_refuse_the_request_fields_that_ask_for_what_the_engine_lacks():
    expected = {
        "repetition_penalty": 1.0,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "logit_bias": None,
        "response_format": None,
        "tools": None,
    }
    assert list(unhonoured_request_fields("transformers")) == list(expected)  # the order refusals are checked in
    # The built-in template takes no variables (reasoning_effort is one); both Hugging Face engines' templates do.
    assert unhonoured_request_fields("builtin") == {**expected, "reasoning_effort": None, "chat_template_kwargs": None}
    assert unhonoured_request_fields("vllm") == {}


def test_each_engine_a_config_names_has_one_row_and_a_default_grants_the_least():
    assert set(ENGINES) == {"builtin", "transformers", "vllm"}
    assert all(capabilities(name).name == name for name in ENGINES)
    least = Engine("new")
    assert (least.honours, least.self_scheduling, least.prefix_events, least.lora, least.tool_parsing) == (
        frozenset(),
        False,
        False,
        False,
        False,
    )
    assert capabilities("builtin") == Engine("builtin")  # the built-in engine does none of it itself
    vllm = capabilities("vllm")
    assert vllm.self_scheduling and vllm.prefix_events and vllm.lora and vllm.tool_parsing
    assert vllm.honours == frozenset(ASKED_BY)
    hf = capabilities("transformers")
    assert hf.honours == {"chat_template"} and not (hf.self_scheduling or hf.lora or hf.tool_parsing)


def test_the_table_is_read_only_and_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="'sglang': must be one of"):
        capabilities("sglang")
    with pytest.raises(ValueError, match="sglang"):
        honours("sglang", set())  # an engine no config can name honours nothing, not everything
    with pytest.raises(ValueError, match="beam_width"):
        Engine("x", honours=frozenset({"beam_width"}))
    with pytest.raises(TypeError):
        ENGINES["x"] = Engine("x")
    assert isinstance(ASKED_BY["json_schema"], MappingProxyType)


def feed(curve: StepCurve, a: float, b: float, rows: range, rounds: int = 10) -> None:
    for _ in range(rounds):
        for r in rows:
            curve.observe(r, a + b * r)


def test_the_fit_finds_the_line_and_the_knee_where_throughput_reaches_the_gain():
    c = StepCurve(gain=0.85)
    feed(c, 0.005, 0.0005, range(1, 33))
    a, b = c.fit()
    assert a == pytest.approx(0.005) and b == pytest.approx(0.0005)
    # rows / (a + b rows) = 0.85 / b at rows = 0.85 / 0.15 * a / b = 56.7
    assert c.rows() == 57
    assert c.snapshot() == {"step_base_ms": 5.0, "step_per_row_ms": 0.5, "rows": 57}
    r = c.rows()
    assert r / (a + b * r) >= 0.85 / b > (r - 1) / (a + b * (r - 1))


def test_a_slower_host_keeps_the_same_knee():
    fast, slow = StepCurve(), StepCurve()
    feed(fast, 0.004, 0.001, range(1, 17))
    feed(slow, 0.004 * 2.5, 0.001 * 2.5, range(1, 17))  # every step 2.5x longer
    assert fast.rows() == slow.rows() == math.ceil(0.85 / 0.15 * 4)


def test_rows_that_cost_nothing_give_no_knee_and_a_flat_step_of_rows_gives_the_floor():
    free = StepCurve()
    feed(free, 0.01, 0.0, range(1, 17))
    assert free.fit() is not None and free.rows() is None  # more rows are free: no cap
    saturated = StepCurve()
    feed(saturated, 0.0, 0.002, range(1, 17))  # step time grows with rows alone
    assert saturated.rows() == MIN_ROWS  # a noisy or saturated fit never closes the engine


def test_no_fit_until_the_steps_spread_over_rows_and_weigh_enough():
    c = StepCurve()
    for _ in range(500):
        c.observe(8, 0.01)  # rows never vary: the slope is unknown
    assert c.fit() is None and c.rows() is None
    few = StepCurve()
    feed(few, 0.005, 0.0005, range(1, 9), rounds=2)  # 16 steps
    assert few.fit() is None
    feed(few, 0.005, 0.0005, range(1, 9), rounds=6)
    assert few.fit() is not None


def test_old_steps_fade_so_the_knee_follows_an_engine_that_changed():
    c = StepCurve(horizon=200)
    feed(c, 0.005, 0.0005, range(1, 17), rounds=20)
    assert c.rows() == 57
    feed(c, 0.005, 0.002, range(1, 17), rounds=60)  # each row now costs four times as much
    assert c.rows() == math.ceil(0.85 / 0.15 * 2.5)


def test_bad_samples_are_ignored():
    c = StepCurve()
    feed(c, 0.003, 0.001, range(1, 17))
    before = c.fit()
    assert before is not None
    for rows, step_s in ((0, 0.01), (-2, 0.01), (math.nan, 0.01), (4, 0.0), (4, -1.0), (4, math.nan), (4, math.inf)):
        c.observe(rows, step_s)
    assert c.fit() == before


def test_the_arguments_are_checked():
    for kwargs in ({"gain": 1.0}, {"gain": 0.0}, {"horizon": 1}, {"min_rows": 0}, {"min_weight": 0}):
        with pytest.raises(ValueError):
            StepCurve(**kwargs)


def report(rid: str, rows, deployment: str = "m") -> ReplicaReport:
    return ReplicaReport(replica_id=rid, deployment=deployment, engine_rows=rows)


def test_a_models_engine_rows_are_its_replicas_sum_only_when_every_one_knows():
    assert control.engine_rows([report("a", 12), report("b", 9), report("c", 40, "other")], "m") == 21
    assert control.engine_rows([report("a", 12), report("b", None)], "m") is None
    assert control.engine_rows([], "m") is None
    with pytest.raises(ValueError):
        report("a", -1)


def test_the_gates_ceiling_takes_no_more_rows_than_the_engines_run_usefully():
    assert model_ceiling(2, 1, 32) == 64
    assert model_ceiling(2, 1, 32, engine_rows=20) == 20
    assert model_ceiling(2, 2, 32, engine_rows=20) == 10  # split among the routers
    assert model_ceiling(2, 2, 32, share=0.25, engine_rows=20) == 5
    assert model_ceiling(1, 1, 8, engine_rows=20) == 8  # the slots still bound it
    assert model_ceiling(0, 1, 8, engine_rows=20) is None


def test_the_model_ceiling_is_an_even_share_of_replicas_times_max_ongoing():
    assert model_ceiling(0, 2, 16) is None  # no replica heard of yet
    assert model_ceiling(2, 1, 16) == 32
    assert model_ceiling(2, 3, 16) == 10  # 32 // 3
    assert model_ceiling(3, 0, 8) == 24  # no router heard of: this one
    assert model_ceiling(1, 100, 4) == 1  # never 0: that would close the gate
    assert model_ceiling(2, 2, 10, share=0.25) == 5  # the controller's fair share, not the even split
    assert model_ceiling(2, 2, 10, share=0.0) == 1
    assert model_ceiling(0, 2, 10, share=0.5) is None


def test_the_table_has_a_row_for_every_backend_the_config_takes():
    from typing import get_args

    from ballast.config import ModelConfig

    assert set(get_args(ModelConfig.model_fields["backend"].annotation)) == set(ENGINES)
