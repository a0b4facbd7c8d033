"""ballast.policies.engines: which engine honours which call, from one table."""

from ballast.model.protocol import ModelCall, RowSampling
from ballast.policies.engines import honours, unhonoured_request_fields


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
    # The built-in template takes no variables; both Hugging Face engines' templates do.
    assert unhonoured_request_fields("builtin") == {**expected, "chat_template_kwargs": None}
    assert unhonoured_request_fields("vllm") == {}
