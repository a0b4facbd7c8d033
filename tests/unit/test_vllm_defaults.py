"""Ballast's defaults for the vLLM engine's arguments (ballast/model/vllm_engine.py): room
for the replica's rows, and on CPU a KV cache sized for them rather than vLLM's 92 % of
the host's memory. Pure: reads config.json, starts nothing."""

from __future__ import annotations

import json

import pytest

from ballast.model.vllm_args import step_rows
from ballast.model.vllm_engine import default_engine_kwargs

COMPACT_JSON = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
CONFIG = {
    "num_attention_heads": 4,
    "hidden_size": 256,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
}


@pytest.fixture()
def model(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def test_the_kv_cache_holds_every_row_at_the_full_context(model):
    got = default_engine_kwargs(model, {"max_model_len": 256}, rows=256)
    per_token = 2 * 2 * 2 * 64 * 4  # K and V, layers, KV heads, head size, float32
    assert got == {
        "max_num_seqs": 256,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 256 * 256 * per_token,
        **COMPACT_JSON,
    }
    half = default_engine_kwargs(model, {"dtype": "bfloat16"}, rows=256)["kv_cache_memory_bytes"]
    assert half == 256 * 512 * per_token // 2  # the model's context, two bytes a value
    assert default_engine_kwargs(model, {}, rows=2)["kv_cache_memory_bytes"] == 64 << 20  # at least 64 MiB


def test_a_size_the_operator_gave_is_kept(model, monkeypatch):
    assert default_engine_kwargs(model, {"kv_cache_memory_bytes": 5, "max_num_seqs": 3}, rows=8) == {
        "kv_cache_memory_bytes": 5,
        "max_num_seqs": 3,
        **COMPACT_JSON,
    }
    assert "kv_cache_memory_bytes" not in default_engine_kwargs(model, {"gpu_memory_utilization": 0.5}, rows=8)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert "kv_cache_memory_bytes" not in default_engine_kwargs(model, {}, rows=8)


def test_a_pooling_engine_steps_half_the_rows_and_keeps_room_for_all(model):
    """A pooled row is one step and done: vLLM runs half the replica's rows in a step and
    holds the other half in its line for the next, with KV room for every row."""
    pooled = default_engine_kwargs(model, {"runner": "pooling", "max_model_len": 256}, rows=32)
    generating = default_engine_kwargs(model, {"max_model_len": 256}, rows=32)
    assert pooled["max_num_seqs"] == 16 and generating["max_num_seqs"] == 32
    assert pooled["kv_cache_memory_bytes"] == generating["kv_cache_memory_bytes"]
    assert [step_rows(r, {"runner": "pooling"}) for r in (1, 2, 3, 8)] == [1, 1, 2, 4]
    assert default_engine_kwargs(model, {"runner": "pooling", "max_num_seqs": 32}, rows=32)["max_num_seqs"] == 32


def test_a_directory_without_a_readable_config_is_left_to_vllm_to_name(tmp_path):
    assert default_engine_kwargs(str(tmp_path), {}, rows=4) == {"max_num_seqs": 4, **COMPACT_JSON}


def test_guided_json_is_compact_unless_the_operator_says_otherwise(model):
    """vLLM's default grammar allows any whitespace between JSON tokens, which a small model
    fills max_tokens with; Ballast's default is compact JSON, an explicit setting kept."""

    def so(given: dict) -> dict:
        return default_engine_kwargs(model, {"structured_outputs_config": given}, rows=4)["structured_outputs_config"]

    assert so({"backend": "xgrammar"}) == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert so({"disable_any_whitespace": False}) == {"backend": "xgrammar", "disable_any_whitespace": False}
    # vLLM refuses disable_any_whitespace with "auto": another backend named is left alone.
    assert so({"backend": "auto"}) == {"backend": "auto"} and so({"backend": "guidance"}) == {"backend": "guidance"}


def test_with_several_ranks_the_kv_cache_is_each_ranks_share(model):
    # vLLM's size is per rank: tensor-parallel ranks split the KV heads (2 here: a third
    # and fourth rank hold a copy, not less), pipeline ranks the layers (2 here).
    whole = default_engine_kwargs(model, {"max_model_len": 256}, rows=512)["kv_cache_memory_bytes"]

    def share(**sizes):
        return default_engine_kwargs(model, {"max_model_len": 256, **sizes}, rows=512)["kv_cache_memory_bytes"]

    assert share(tensor_parallel_size=2) == whole // 2
    assert share(tensor_parallel_size=4) == whole // 2  # one KV head each, replicated
    assert share(pipeline_parallel_size=2) == whole // 2
    assert share(tensor_parallel_size=2, pipeline_parallel_size=2) == whole // 4


def test_a_reasoning_models_engine_applies_its_grammar_after_the_thinking(tmp_path, monkeypatch):
    """model.reasoning_parser reaches vLLM's engine (its structured-output manager waits for
    the end of the reasoning before a tool call's or response_format's grammar applies)."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs

    import ballast.model.vllm_engine as ve
    from ballast.config import ModelConfig
    from ballast.model.demo import VLLM_GEOMETRY, make_llama
    from ballast.model.engine import build_engine
    from ballast.model.vllm_args import config_sections

    path = make_llama(tmp_path / "m", **VLLM_GEOMETRY)
    tok = AutoTokenizer.from_pretrained(path)  # a thinking model's markers: deepseek_r1 looks for them
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.save_pretrained(path)
    seen: dict = {}
    monkeypatch.setattr(ve, "VLLMBackend", lambda *a, **k: seen.update(k) or "backend")
    m = ModelConfig(name="m", backend="vllm", path=str(path), reasoning_parser="deepseek_r1")
    assert build_engine(m) == "backend" and seen["engine_kwargs"]["reasoning_parser"] == "deepseek_r1"
    args = AsyncEngineArgs(model=str(path), **config_sections({**seen["engine_kwargs"], "max_model_len": 256}))
    assert args.create_engine_config().structured_outputs_config.reasoning_parser == "deepseek_r1"
    seen.clear()
    build_engine(ModelConfig(name="m", backend="vllm", path=str(path)))
    assert "reasoning_parser" not in seen["engine_kwargs"]
