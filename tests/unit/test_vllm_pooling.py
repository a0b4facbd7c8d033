"""An embeddings model on vLLM's pooling runner (``vllm_args.pooling_engine_kwargs``, a
``*ForCausalLM`` converted to embed): a batch's pooled rows (``AsyncLLM.encode``) give
vLLM's offline ``LLM.embed`` vectors on the same directory and transformers' last-token
pooling (cosine >= 0.9999), cut to a Matryoshka size then normalised; a generating row, a
row of another pooling and a size the model was not given are each refused alone. One
pooling engine for the module, on the tiny random Llama."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ballast.errors import EngineRefused  # noqa: E402
from ballast.model.demo import VLLM_GEOMETRY, make_llama  # noqa: E402
from ballast.model.protocol import Join, Pooling  # noqa: E402
from ballast.model.vllm_args import pooling_engine_kwargs  # noqa: E402
from ballast.model.vllm_engine import VLLMBackend  # noqa: E402

ENGINE_KWARGS = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8)
PROMPTS = ["The quick brown fox", "Hello!", "A replica serves requests; the router sends each one to a replica"]
SIZES = [8, 16]  # the Matryoshka sizes the model is given


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("vllm-embed"), **VLLM_GEOMETRY)


@pytest.fixture(scope="module")
def backend(ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of CPU KV cache
        b = VLLMBackend(
            str(ckpt), name="tiny-embed", engine_kwargs=pooling_engine_kwargs(ENGINE_KWARGS, "last", True, SIZES)
        )
    yield b
    b.shutdown()


def vector(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())


def drive(batch, joins, chunks=40):
    """``joins`` into ``batch``, then chunks until every row has left: (vectors, ids, failed)
    by key; every pooled row is answered once, with no id, in the chunk its vector came."""
    vectors, ids, failed = {}, {}, {}
    out = batch.run_chunk(joins, 4)
    for _ in range(chunks):
        got = batch.take_embeddings()
        assert set(got) <= set(out)  # a vector comes with the row's key in run_chunk's answer
        for key, new in out.items():
            assert key not in vectors
            if key in got:
                assert new == []
                vectors[key] = vector(got[key])
            else:
                ids.setdefault(key, []).extend(new)
        failed.update(batch.take_failed())
        if not batch.keys():
            return vectors, ids, failed
        out = batch.run_chunk([], 4)
    raise AssertionError(f"rows still in the batch after {chunks} chunks: {batch.keys()}")


def hf_last(ckpt, ids):
    """transformers' last-token pooling of the base's last hidden state (after its norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.model(input_ids=torch.tensor([i])).last_hidden_state[0, -1] for i in ids]


def cosine(a, b):
    return float(F.cosine_similarity(a, b, dim=0))


def test_the_engine_is_vllms_pooling_runner_with_the_models_pooler(backend):
    cfg = backend.llm.vllm_config.model_config
    assert cfg.runner_type == "pooling" and cfg.convert_type == "embed"
    assert backend.pooling == "last" and backend.hidden_size == VLLM_GEOMETRY["hidden"]
    assert cfg.matryoshka_dimensions == SIZES
    backend.warmup([1, 2])  # pools, and leaves nothing behind
    assert backend.open_batch().keys() == []


def test_vectors_equal_vllms_offline_embed_and_transformers_last_token(backend, ckpt, monkeypatch):
    from vllm import LLM

    ids = [backend.text.tokenize(p) for p in PROMPTS]
    vectors, _, failed = drive(backend.open_batch(), [Join(i, p, 0, pool=Pooling()) for i, p in enumerate(ids)])
    assert failed == {} and sorted(vectors) == [0, 1, 2]
    for i, want in enumerate(hf_last(ckpt, ids)):
        assert cosine(vectors[i], F.normalize(want, dim=-1)) >= 0.9999
        assert torch.allclose(vectors[i], F.normalize(want, dim=-1), atol=1e-4)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    offline = LLM(model=str(ckpt), tokenizer=str(ckpt), seed=0, **pooling_engine_kwargs(ENGINE_KWARGS, "last", True))
    try:
        embedded = offline.embed([{"prompt_token_ids": p} for p in ids])
    finally:
        offline.llm_engine.engine_core.shutdown()
    for i, e in enumerate(embedded):
        assert cosine(vectors[i], torch.tensor(e.outputs.embedding)) >= 0.9999


def test_a_matryoshka_size_is_cut_then_normalised_and_raw_vectors_stay_raw(backend, ckpt):
    ids = backend.text.tokenize(PROMPTS[0])
    joins = [Join("cut", ids, 0, pool=Pooling(dimensions=8)), Join("raw", ids, 0, pool=Pooling(normalize=False))]
    vectors, _, failed = drive(backend.open_batch(), joins)
    assert failed == {}
    (want,) = hf_last(ckpt, [ids])
    assert vectors["cut"].shape == (8,) and cosine(vectors["cut"], F.normalize(want[:8], dim=-1)) >= 0.9999
    assert torch.allclose(vectors["raw"], want, atol=1e-4) and abs(float(vectors["raw"].norm()) - 1) > 0.01


def test_rows_the_pooling_engine_cannot_run_are_refused_alone(backend):
    ids = backend.text.tokenize(PROMPTS[1])
    joins = [
        Join("gen", ids, 4),  # a generating row on an embeddings engine
        Join("mean", ids, 0, pool=Pooling("mean")),  # the engine's pooler is LAST
        Join("size", ids, 0, pool=Pooling(dimensions=12)),  # not one of the model's sizes
        Join("ok", ids, 0, pool=Pooling()),
    ]
    vectors, ids_out, failed = drive(backend.open_batch(), joins)
    assert sorted(failed) == ["gen", "mean", "size"] and sorted(vectors) == ["ok"]
    assert all(isinstance(e, EngineRefused) for e in failed.values())
    assert failed["gen"].field == "model" and "generates no text" in str(failed["gen"])
    assert failed["mean"].field == "model" and "'last'" in str(failed["mean"])
    assert failed["size"].field == "dimensions" and "12" in str(failed["size"])
    assert all(not v for v in ids_out.values())


def test_build_engine_gives_an_embed_model_the_pooling_runner_its_config_says(ckpt, monkeypatch):
    """``model.embed`` (pooling, normalize, dimensions) as vLLM's config reads it; an
    explicit ``engine_kwargs`` entry wins; a generating model keeps the generate runner."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    import ballast.model.vllm_engine as ve
    from ballast.config import ModelConfig
    from ballast.model.engine import build_engine
    from ballast.model.vllm_args import config_sections

    seen: dict = {}
    monkeypatch.setattr(ve, "VLLMBackend", lambda *a, **k: seen.update(k) or "backend")

    def engine_config(**model):
        seen.clear()
        assert build_engine(ModelConfig(name="m", backend="vllm", path=str(ckpt), **model)) == "backend"
        args = AsyncEngineArgs(model=str(ckpt), **config_sections({**seen["engine_kwargs"], "max_model_len": 256}))
        return args.create_engine_config().model_config

    embed = {"pooling": "mean", "normalize": False, "dimensions": [16, 64]}
    cfg = engine_config(kind="embed", embed=embed)
    assert cfg.runner_type == "pooling" and cfg.convert_type == "embed"
    assert cfg.pooler_config.seq_pooling_type == "MEAN" and cfg.pooler_config.use_activation is False
    assert cfg.matryoshka_dimensions == [16, 64]
    cfg = engine_config(kind="embed", engine_kwargs={"pooler_config": {"pooling_type": "CLS"}})
    assert cfg.pooler_config.seq_pooling_type == "CLS" and not cfg.is_matryoshka
    assert engine_config().runner_type == "generate"
