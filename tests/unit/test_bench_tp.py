"""loadtest.bench_tp's driver on a real engine: ``_run`` drives a batch chunk by chunk to
the end, as it drives vLLM's engine at each tensor-parallel size. Here the engine is the
transformers one (``HFBackend``) on the tiny Llama, on CPU; vLLM's start and its ranks
need the run itself (``python -m loadtest.bench_tp``)."""

from __future__ import annotations

import pytest

from ballast.model.demo import make_tiny_llama
from ballast.model.hf_checkpoint import load_checkpoint
from ballast.model.hf_engine import HFBackend, RowSampling
from loadtest.bench_tp import PROMPTS, _run


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return HFBackend(load_checkpoint(make_tiny_llama(tmp_path_factory.mktemp("tiny")), "cpu"), name="bench")


def test_every_row_runs_to_its_tokens_across_chunks(backend):
    got = _run(backend, len(PROMPTS) + 1, 20, RowSampling(ignore_eos=True))  # 20: more than two 8-step chunks
    assert sorted(got) == list(range(len(PROMPTS) + 1))
    assert all(len(ids) == 20 for ids in got.values())
    assert got[0] != got[1]  # each row its own prompt (they differ in greedy output here)


def test_greedy_answers_repeat_run_to_run(backend):
    first = _run(backend, 3, 8, RowSampling())
    assert _run(backend, 3, 8, RowSampling()) == first
    assert sorted(first) == [0, 1, 2] and all(1 <= len(ids) <= 8 for ids in first.values())
