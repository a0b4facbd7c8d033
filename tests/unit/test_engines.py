"""ballast.policies.engines: which engine honours which call."""

from ballast.policies.engines import honours


def test_every_engine_honours_a_plain_call():
    call = {"prompt": "hi", "max_tokens": 8, "temperature": 0.7, "seed": 1, "top_k": 5, "ignore_eos": True}
    assert all(honours(engine, call) for engine in ("builtin", "transformers", "vllm"))


def test_vllms_own_fields_keep_a_call_on_vllm():
    for field, value in (
        ("json_schema", '{"type":"object"}'),
        ("repetition_penalty", 1.3),
        ("keep_special_tokens", True),
    ):
        call = {"prompt": "hi", field: value}
        assert honours("vllm", call)
        assert not honours("builtin", call) and not honours("transformers", call)
    assert honours("builtin", {"prompt": "hi", "json_schema": None})  # absent in all but name
