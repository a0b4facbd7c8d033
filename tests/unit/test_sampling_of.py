"""The OpenAI fronts' sampling, built once at the front (``openai_api.sampling_of``):
refused naming the field, normalised, and None when the request asks for none."""

import pytest

from ballast.config import LimitsConfig
from ballast.errors import EngineRefused
from ballast.router import openai_api as oa


def completion(**fields):
    return oa.parse_completion({"model": "m", "prompt": "hi", **fields}, LimitsConfig())


def test_a_request_that_asks_for_no_sampling_sends_none():
    assert oa.sampling_of(completion()) is None
    assert oa.sampling_of(completion(temperature=0, repetition_penalty=1.0, top_k=0)) is None  # neutral values


def test_sampling_is_normalised_and_carries_what_the_tool_plan_asks():
    assert oa.sampling_of(completion(temperature=1e-40, seed=3)).temperature == 0.0  # greedy: 1e-40 overflows
    s = oa.sampling_of(completion(temperature=0.5, top_p=0.9, seed=4, top_k=3))
    assert (s.temperature, s.top_p, s.seed, s.top_k) == (0.5, 0.9, 4, 3)
    forced = oa.sampling_of(completion(), json_schema='{"type":"object"}')
    assert forced.json_schema == '{"type":"object"}' and forced.json_schema_of == "tools"
    assert oa.sampling_of(completion(), keep_special_tokens=True).keep_special_tokens is True


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("seed", 2**63)])
def test_a_value_the_sampling_refuses_names_its_field(field, value):
    try:
        req = completion(**{field: value})
    except oa.BadRequest as e:  # the body's own bounds came first: named as well
        assert e.field == field
        return
    with pytest.raises(EngineRefused) as e:
        oa.sampling_of(req)
    assert e.value.field == field and e.value.status == 400
