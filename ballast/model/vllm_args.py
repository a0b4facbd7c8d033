"""vLLM's engine arguments as Ballast sets them: its defaults for what a model's
``engine_kwargs`` leave out, an embeddings model's pooling runner, and the sections
``AsyncEngineArgs`` takes only as objects."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ballast.model.vllm_lora import lora_engine_kwargs

__all__ = [
    "DEFAULT_ENGINE_KWARGS",
    "config_sections",
    "cuda_visible",
    "default_engine_kwargs",
    "pooling_engine_kwargs",
]

#: vLLM options Ballast sets unless ``engine_kwargs`` says otherwise. ``scheduling_policy``
#: "priority": vLLM starts the requests waiting in it by (priority, arrival time), so no batch
#: line's row (``protocol.BATCH_PRIORITY``) starts before an interactive one (0) waiting with
#: it, and short of KV blocks it preempts the latest row of the highest value (a batch row)
#: first; among rows of one priority it is first come, first served, as vLLM's default
#: "fcfs" is. Under "fcfs" vLLM ignores a request's priority.
DEFAULT_ENGINE_KWARGS: Mapping[str, Any] = {"enable_prefix_caching": True, "scheduling_policy": "priority"}


def default_engine_kwargs(
    path: str, engine_kwargs: dict[str, Any], rows: int, adapters: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``engine_kwargs`` with Ballast's defaults for what it leaves out: room in the engine
    for ``rows`` requests (the replica bounds them; ``max_num_seqs``, the rows of one step:
    :func:`step_rows`), LoRA when the model
    has ``adapters`` (:func:`lora_engine_kwargs`), guided JSON without whitespace between
    its tokens (``structured_outputs_config``: backend xgrammar, ``disable_any_whitespace``;
    vLLM's default lets a small model fill ``max_tokens`` with whitespace; another backend
    named is left as it is), and on CPU a KV cache
    with room for ``rows`` rows that each fill the context, as Ballast's own engines are
    sized (vLLM's size is each rank's: with tensor or pipeline parallelism, that share of
    it). vLLM's CPU default (``gpu_memory_utilization`` 0.92 of the host's memory) is
    refused by a host that runs anything else; an explicit size, or
    ``VLLM_CPU_KVCACHE_SPACE``, is kept."""
    out = lora_engine_kwargs(
        {"max_num_seqs": step_rows(rows, engine_kwargs), **engine_kwargs}, adapters or {}, base_slot=not cuda_visible()
    )
    so = out.get("structured_outputs_config")
    if so is None or isinstance(so, dict):  # compact JSON: a small model fills max_tokens with whitespace
        so = dict(so or {})
        if so.get("backend", "xgrammar") == "xgrammar":  # vLLM takes the setting with a named backend only
            so = {"backend": "xgrammar", "disable_any_whitespace": True, **so}
        out["structured_outputs_config"] = so
    sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(out) or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if sized or cuda_visible():
        return out
    try:
        c = json.loads((Path(path) / "config.json").read_text())
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        kv_heads = int(c.get("num_key_value_heads") or heads)
        context = int(out.get("max_model_len") or c.get("max_position_embeddings") or 2048)
        per_token = (
            2
            * int(c["num_hidden_layers"])
            * kv_heads
            * head_dim
            * (2 if out.get("dtype") in ("bfloat16", "float16", "half") else 4)
        )
    except (OSError, ValueError, KeyError, TypeError):  # vLLM names what is wrong with the directory at start
        return out
    out["kv_cache_memory_bytes"] = max(64 << 20, rows * context * per_token // ranks_sharing_kv(out, c))
    return out


def step_rows(rows: int, engine_kwargs: Mapping[str, Any]) -> int:
    """The rows vLLM runs in one step (``max_num_seqs``) for a replica that holds ``rows``:
    all of them for a generating engine; half for a pooling one (``runner: pooling``),
    whose row is one step (its prefill) and done, so that the next step's rows are already
    in vLLM's line when a step ends, rather than on their way from the replica."""
    return max(1, (rows + 1) // 2) if engine_kwargs.get("runner") == "pooling" else rows


def pooling_engine_kwargs(
    engine_kwargs: Mapping[str, Any], kind: str, normalize: bool, dimensions: Sequence[int] | None = None
) -> dict[str, Any]:
    """``engine_kwargs`` for an embeddings model (``kind: embed``), what they leave out set:
    vLLM's pooling runner (``runner: pooling``; its ``convert: auto`` turns a ``*ForCausalLM``
    into an embedding model, ``convert: embed``, and keeps a pooling architecture as it is),
    a pooler of ``kind`` (``last``/``mean``/``cls``: vLLM's LAST/MEAN/CLS over the hidden
    states after the final norm) normalising by default as ``normalize`` says (a request's
    ``PoolingParams.use_activation`` may say otherwise), and with ``dimensions`` the shorter
    vectors vLLM may cut (``hf_overrides.matryoshka_dimensions``: vLLM refuses a request's
    ``dimensions`` for a model whose config names none)."""
    out: dict[str, Any] = {
        "runner": "pooling",
        "pooler_config": {"pooling_type": kind.upper(), "use_activation": bool(normalize)},
    }
    if dimensions:
        out["hf_overrides"] = {"matryoshka_dimensions": [int(d) for d in dimensions]}
    return {**out, **engine_kwargs}


def ranks_sharing_kv(engine_kwargs: Mapping[str, Any], c: Mapping[str, Any]) -> int:
    """How many ranks share one token's KV (vLLM's size is per rank): tensor parallel ranks
    split the KV heads (each keeps at least one), pipeline ranks the layers."""
    tp = int(engine_kwargs.get("tensor_parallel_size") or 1)
    pp = int(engine_kwargs.get("pipeline_parallel_size") or 1)
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    return min(tp, heads) * min(pp, int(c["num_hidden_layers"]))


def cuda_visible() -> bool:
    """Whether torch sees a CUDA device (False without torch)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def config_sections(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the config sections that ``AsyncEngineArgs`` takes only as objects
    built from the mappings a YAML config gives (it builds the others itself)."""
    from vllm.config import PoolerConfig, StructuredOutputsConfig

    out = dict(kwargs)
    if isinstance(out.get("structured_outputs_config"), dict):
        out["structured_outputs_config"] = StructuredOutputsConfig(**out["structured_outputs_config"])
    if isinstance(out.get("pooler_config"), dict):
        out["pooler_config"] = PoolerConfig(**out["pooler_config"])
    return out
