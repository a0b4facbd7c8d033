"""Pooled rows (``Join.pool``, ``Batch.take_embeddings``) on the transformers and built-in
engines: each vector equals the same model's plain forward over the prompt alone, computed
here (hidden states after the final norm, pooled last / mean / cls, cut to ``dimensions``
then L2-normalised), cosine >= 0.9999 and within 1e-4, in float32; prompts of different
lengths pool together in one left-padded batch; pooled rows beside generating rows in one
chunk leave at once and change no generated id; a row the engine cannot pool is refused
alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ballast.config import ModelConfig
from ballast.errors import EngineRefused
from ballast.model.builtin_batch import _prefill_mask
from ballast.model.builtin_checkpoint import BackendSpec, load_backend, save_torchscript
from ballast.model.builtin_decoder import TinyDecoderConfig, build_tiny_decoder
from ballast.model.builtin_engine import TorchDecoderBackend
from ballast.model.engine import ModelLoadError, build_engine
from ballast.model.hf_checkpoint import load_checkpoint
from ballast.model.hf_engine import HFBackend
from ballast.model.protocol import Join, Pooling
from tests.unit.hf_fixture import make_tiny_llama

SMALL = TinyDecoderConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=128)
PROMPTS = ["The quick brown fox", "Hi", "A replica serves requests; the router sends each one to a replica"]
ATOL = 1e-4


# ------------------------------------------------------------------------- helpers


def vector(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())


def pooled(hidden: torch.Tensor, pool: Pooling) -> torch.Tensor:
    """The reference: ``hidden`` [T, D] of one prompt alone, pooled as ``pool`` says."""
    v = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(dim=0)}[pool.kind].float()
    if pool.dimensions is not None:
        v = v[: pool.dimensions]
    return F.normalize(v, dim=-1) if pool.normalize else v


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert float(F.cosine_similarity(got, want, dim=0)) >= 0.9999
    assert torch.allclose(got, want, atol=ATOL, rtol=0), float((got - want).abs().max())


def pool_all(backend: Any, ids: list[list[int]], pool: Pooling) -> dict[int, torch.Tensor]:
    """Every prompt a pooled row of one chunk: the vectors by index; they leave at once."""
    batch = backend.open_batch()
    with torch.inference_mode():
        out = batch.run_chunk([Join(i, p, 0, pool=pool) for i, p in enumerate(ids)], 3)
    assert out == {i: [] for i in range(len(ids))} and batch.keys() == []
    got = batch.take_embeddings()
    assert batch.take_embeddings() == {}  # taken once
    return {k: vector(v) for k, v in got.items()}


def run_to_end(batch: Any, joins_by_chunk: list[list[Join]], steps: int) -> tuple[dict, dict]:
    """Drive ``batch`` until empty: (ids by key, vectors by key)."""
    ids: dict[Any, list[int]] = {}
    vectors: dict[Any, bytes] = {}
    i = 0
    with torch.inference_mode():
        while i < len(joins_by_chunk) or batch.keys():
            for key, new in batch.run_chunk(joins_by_chunk[i] if i < len(joins_by_chunk) else [], steps).items():
                ids.setdefault(key, []).extend(new)
            vectors.update(batch.take_embeddings())
            i += 1
    return ids, vectors


POOLINGS = [
    Pooling("last"),
    Pooling("mean"),
    Pooling("cls"),
    Pooling("last", dimensions=8),
    Pooling("mean", normalize=False),
    Pooling("last", normalize=False, dimensions=5),
]


# --------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def hf(ckpt):
    return HFBackend(load_checkpoint(ckpt, "cpu"), name="tiny")


def hf_reference(backend: HFBackend, ids: list[int], pool: Pooling) -> torch.Tensor:
    """transformers' plain forward of the prompt alone: the base's last hidden state."""
    with torch.inference_mode():
        hidden = backend.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return pooled(hidden, pool)


@pytest.mark.parametrize("pool", POOLINGS, ids=repr)
def test_hf_vectors_equal_a_plain_forward_of_each_prompt_alone(hf, pool):
    ids = [hf.text.tokenize(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # different lengths: the batch is left-padded
    got = pool_all(hf, ids, pool)
    for i, p in enumerate(ids):
        assert_same(got[i], hf_reference(hf, p, pool))
    if pool.normalize:
        assert all(abs(float(v.norm()) - 1) < 1e-5 for v in got.values())
    else:
        assert any(abs(float(v.norm()) - 1) > 0.01 for v in got.values())


def test_hf_cut_comes_before_normalising(hf):
    ids = hf.text.tokenize(PROMPTS[0])
    whole = pool_all(hf, [ids], Pooling("last", normalize=False))[0]
    cut = pool_all(hf, [ids], Pooling("last", dimensions=8))[0]
    assert_same(cut, F.normalize(whole[:8], dim=-1))
    assert not torch.allclose(cut, F.normalize(whole, dim=-1)[:8], atol=ATOL)  # the other order differs


def test_hf_pooled_rows_beside_generating_rows_change_no_id(hf):
    gen = [Join(("g", i), hf.text.encode(p, 9), 9) for i, p in enumerate(PROMPTS)]
    alone, _ = run_to_end(hf.open_batch(), [gen], 3)
    # The same rows with pooled rows joining in the first and in a later chunk.
    pools = [Join(("p", i), hf.text.tokenize(p), 0, pool=Pooling("mean")) for i, p in enumerate(PROMPTS)]
    mixed, vectors = run_to_end(hf.open_batch(), [gen[:2] + pools[:2], [gen[2], pools[2]]], 3)
    assert {k: v for k, v in mixed.items() if k[0] == "g"} == alone
    assert all(mixed[("p", i)] == [] for i in range(3))
    for i, p in enumerate(PROMPTS):
        assert_same(vector(vectors[("p", i)]), hf_reference(hf, hf.text.tokenize(p), Pooling("mean")))


def test_hf_row_asking_more_dimensions_than_the_model_has_is_refused_alone(hf):
    batch = hf.open_batch()
    ids = hf.text.tokenize(PROMPTS[0])
    with torch.inference_mode():
        out = batch.run_chunk(
            [Join("big", ids, 0, pool=Pooling(dimensions=hf.hidden_size + 1)), Join("ok", ids, 0, pool=Pooling())], 2
        )
    failed = batch.take_failed()
    assert list(failed) == ["big"] and isinstance(failed["big"], EngineRefused)
    assert failed["big"].field == "dimensions" and str(hf.hidden_size) in str(failed["big"])
    assert out == {"ok": []} and list(batch.take_embeddings()) == ["ok"]


def test_build_engine_serves_a_transformers_embed_model(ckpt):
    m = ModelConfig(name="emb", backend="transformers", path=str(ckpt), device="cpu", kind="embed")
    engine = build_engine(m)
    assert isinstance(engine, HFBackend) and engine.base is not None


# ----------------------------------------------------------------------- built-in


@pytest.fixture(scope="module")
def builtin():
    """The engine as a replica loads it: the seed's module scripted (``compile: torchscript``)."""
    return load_backend(BackendSpec(seed=3, device="cpu", config=SMALL))


def builtin_reference(seed: int, ids: list[int], pool: Pooling) -> torch.Tensor:
    """The eager module's plain forward (logits path) over the prompt alone, its final
    norm's output read by a hook."""
    model = build_tiny_decoder(SMALL, seed)
    seen: list[torch.Tensor] = []
    model.ln_f.register_forward_hook(lambda _m, _i, out: seen.append(out))
    t = len(ids)
    valid = torch.ones(1, t, dtype=torch.bool)
    empty = torch.zeros(SMALL.n_layers, 1, SMALL.n_heads, 0, SMALL.head_dim)
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(t)[None], _prefill_mask(valid), empty, empty)
    return pooled(seen[0][0], pool)


def test_builtin_archive_exports_its_hidden_states(builtin):
    assert isinstance(builtin._model, torch.jit.ScriptModule) and builtin.pools


@pytest.mark.parametrize("pool", POOLINGS, ids=repr)
def test_builtin_vectors_equal_a_plain_forward_of_each_prompt_alone(builtin, pool):
    ids = [builtin.text.tokenize(p) for p in PROMPTS]
    got = pool_all(builtin, ids, pool)
    for i, p in enumerate(ids):
        assert_same(got[i], builtin_reference(3, p, pool))


def test_builtin_pooled_rows_beside_generating_rows_change_no_id(builtin):
    gen = [Join(("g", i), builtin.text.encode(p, 9), 9) for i, p in enumerate(PROMPTS)]
    alone, _ = run_to_end(builtin.open_batch(), [gen], 3)
    pools = [Join(("p", i), builtin.text.tokenize(p), 0, pool=Pooling("cls")) for i, p in enumerate(PROMPTS)]
    mixed, vectors = run_to_end(builtin.open_batch(), [gen[:2] + pools[:2], [gen[2], pools[2]]], 3)
    assert {k: v for k, v in mixed.items() if k[0] == "g"} == alone
    for i, p in enumerate(PROMPTS):
        assert_same(vector(vectors[("p", i)]), builtin_reference(3, builtin.text.tokenize(p), Pooling("cls")))


class _NoHidden(torch.nn.Module):
    """A decoder archive as one scripted before ``TinyDecoder.hidden`` was exported: its
    forward and geometry only."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        for name in ("vocab_size", "n_layers", "n_heads", "head_dim", "max_seq_len"):
            setattr(self, name, getattr(inner, name))

    def forward(self, ids, positions, mask, k, v):  # type: ignore[no-untyped-def]
        return self.inner(ids, positions, mask, k, v)


def test_an_archive_without_hidden_states_pools_no_row_and_is_no_embed_model(tmp_path):
    path = tmp_path / "old.pt"
    save_torchscript(_NoHidden(build_tiny_decoder(SMALL, 0)), path)
    backend = load_backend(BackendSpec(checkpoint_path=str(path), device="cpu"))
    assert isinstance(backend, TorchDecoderBackend) and not backend.pools
    batch = backend.open_batch()
    with torch.inference_mode():
        out = batch.run_chunk([Join("p", [104, 105], 0, pool=Pooling()), Join("g", [104, 105], 2)], 2)
    failed = batch.take_failed()
    assert list(failed) == ["p"] and failed["p"].field == "model" and "hidden states" in str(failed["p"])
    assert len(out["g"]) == 2 and batch.take_embeddings() == {}
    with pytest.raises(ModelLoadError, match="kind embed"):
        build_engine(ModelConfig(kind="embed", checkpoint_path=str(path), device="cpu"))
