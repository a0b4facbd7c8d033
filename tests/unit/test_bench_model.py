"""loadtest.bench_model on the tiny Llama: every stack runs, each produces the workload's tokens, the table's shape.

No timing is asserted: the clock here is a counter (one tick per read), so
latencies are tick counts.
"""

from __future__ import annotations

import itertools

import pytest

from ballast.model.demo import make_tiny_llama
from loadtest import bench_model as bm

CONCURRENCY = [1, 2]
N_REQUESTS = 4
MAX_TOKENS = 12


def ticks():
    counter = itertools.count()
    return lambda: float(next(counter))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    ckpt = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return bm.run_all(
        ckpt,
        "cpu",
        CONCURRENCY,
        N_REQUESTS,
        MAX_TOKENS,
        chunk_tokens=4,
        seed=0,
        short_trials=2,
        clock=ticks(),
    )


def test_the_workload_is_seeded_and_mixes_short_and_long_requests():
    a = bm.workload(64, 128, seed=3)
    assert a == bm.workload(64, 128, seed=3)
    assert a != bm.workload(64, 128, seed=4)
    tokens = [r.max_tokens for r in a]
    assert bm.SHORT_TOKENS in tokens
    assert all(t == bm.SHORT_TOKENS or 64 <= t <= 128 for t in tokens)
    assert 16 < tokens.count(bm.SHORT_TOKENS) < 48
    with pytest.raises(ValueError):
        bm.workload(4, bm.SHORT_TOKENS - 1, seed=0)


def test_every_stack_runs_at_every_concurrency_and_generates_the_same_tokens(report):
    assert not report.notes, report.notes  # transformers-cb ran too
    stacks = ["ballast", "generate", "transformers-cb"]
    assert [(r.concurrency, r.stack) for r in report.runs] == [(c, s) for c in CONCURRENCY for s in stacks]
    want = sum(r.max_tokens for r in bm.workload(N_REQUESTS, MAX_TOKENS, 0))
    for run in report.runs:
        assert run.tokens == want, run
        assert len(run.latencies_s) == N_REQUESTS
        assert all(lat > 0 for lat in run.latencies_s)
        assert run.elapsed_s >= max(run.latencies_s)


def test_a_static_batch_finishes_its_requests_together(report):
    for run in report.runs:
        if run.stack == "generate" and run.concurrency == 2:
            # one batch of two, then the next: each pair shares a latency
            assert run.latencies_s[0] == run.latencies_s[1]
            assert run.latencies_s[2] == run.latencies_s[3]


def test_the_short_request_is_measured_alone_and_beside_long_ones(report):
    assert [s.stack for s in report.shorts] == ["ballast", "generate", "transformers-cb"]
    for s in report.shorts:
        assert s.beside == max(CONCURRENCY) - 1
        assert s.alone_s and s.beside_s
        assert s.ratio > 0
    ballast = report.shorts[0]
    assert len(ballast.from_join_s) == len(ballast.beside_s)
    # from the boundary it joined at is never longer than from its arrival before it
    assert all(j <= b for j, b in zip(ballast.from_join_s, ballast.beside_s))
    assert sorted(ballast.step_s) == [1, max(CONCURRENCY)] and all(v > 0 for v in ballast.step_s.values())


def test_the_table_has_a_row_per_stack_and_concurrency_and_marks_the_targets(report):
    lines = bm.render(report)
    rows = [ln for ln in lines if ln.split("|")[0].strip().isdigit()]
    assert len(rows) == len(report.runs)
    assert any(ln.startswith("target: ballast tok/s >= 0.9x generate's at 2:") for ln in lines)
    assert any(ln.rstrip().endswith(("ok", "MISSED")) and "ballast" in ln and "alone" in ln for ln in lines)
    assert any("one decode step:" in ln for ln in lines)
    assert any(ln.startswith("model: ") and "params" in ln for ln in lines)
    assert any(ln.startswith("device: cpu") and "threads" in ln for ln in lines)
