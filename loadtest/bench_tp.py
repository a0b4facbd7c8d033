"""vLLM's CPU build at one rank and at tensor_parallel_size N, standalone: start time,
tokens/s, and whether greedy answers agree.

``python -m loadtest.bench_tp [--tp 2] [--rounds 2] [--model DIR]``. No Ray: each engine
is a :class:`ballast.model.vllm_engine.VLLMBackend` in a process of its own, one at a
time, started as a replica starts one (``ballast.model.ranks``: the ranks' OpenMP threads
split over this process's cores, vLLM's ``mp`` executor), driven chunk by chunk as the
replica drives it. Each round runs every size once, alternating, so a busy host weighs on
both alike. The model is the tiny random Llama the integration tests serve
(``ballast.model.demo.VLLM_GEOMETRY``) unless ``--model`` names a directory.

Per engine: seconds to start (``VLLMBackend.start_s``: vLLM's config, its processes and
the model's load), tokens/s for 1 and for 4 rows of 128 tokens each (ignore_eos), and
the greedy ids of 4 prompts of 32 tokens, which the report compares across sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ballast.model.protocol import Join, RowSampling

PROMPTS = ("The quick brown fox", "Hello!", "A replica serves requests; the router sends each one to", "Tokens per")


def measure(path: str, tp: int) -> dict[str, Any]:
    """One engine of ``tp`` ranks on ``path``: its start, tokens/s and greedy ids."""
    from ballast.model.ranks import prepare_ranks, with_executor
    from ballast.model.vllm_engine import VLLMBackend, default_engine_kwargs
    from ballast.policies.placement import Placement

    placement = Placement("bench", tp, 1, (("CPU", 1.0),)) if tp > 1 else None
    env = prepare_ranks(placement)
    kwargs = with_executor({"dtype": "float32", "enforce_eager": True, "max_model_len": 512}, placement)
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
    backend = VLLMBackend(path, name="bench", engine_kwargs=default_engine_kwargs(path, kwargs, 8))
    try:
        greedy = _run(backend, 4, 32, RowSampling())
        backend.warmup([1, 4])
        rates = {}
        for rows in (1, 4):
            started = time.monotonic()
            got = _run(backend, rows, 128, RowSampling(ignore_eos=True))
            rates[rows] = round(sum(len(ids) for ids in got.values()) / (time.monotonic() - started), 1)
        return {"tp": tp, "start_s": round(backend.start_s, 1), "tokens_per_s": rates, "greedy": greedy, "env": env}
    finally:
        backend.shutdown()


def _run(backend: Any, rows: int, tokens: int, sampling: Any) -> dict[int, list[int]]:
    batch = backend.open_batch()
    joins = [Join(i, backend.text.encode(PROMPTS[i % len(PROMPTS)], tokens), tokens, sampling) for i in range(rows)]
    got: dict[int, list[int]] = {}
    for key, ids in batch.run_chunk(joins, 8).items():
        got.setdefault(key, []).extend(ids)
    while batch.keys():
        for key, ids in batch.run_chunk([], 8).items():
            got.setdefault(key, []).extend(ids)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="the tensor-parallel size set beside one rank")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", help="a local Hugging Face directory (default: the tests' tiny random Llama)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one engine in this process
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.model, args.one)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from ballast.model.demo import VLLM_GEOMETRY, make_llama

            path = str(make_llama(Path(tmp) / "tiny", **VLLM_GEOMETRY))
        runs = [_child(path, tp) for _ in range(args.rounds) for tp in (1, args.tp)]
    for r in runs:
        print(f"tp {r['tp']}: started in {r['start_s']} s; tokens/s {r['tokens_per_s']} (rows: tokens/s); {r['env']}")
    same = all(r["greedy"] == runs[0]["greedy"] for r in runs)
    print(f"greedy ids of {len(PROMPTS)} prompts x 32 tokens equal at every size: {same}")
    return 0 if same else 1


def _child(path: str, tp: int) -> dict[str, Any]:
    """One engine in a fresh process (vLLM's engine spawns its own; one engine at a time)."""
    cmd = [sys.executable, "-m", "loadtest.bench_tp", "--one", str(tp), "--model", path]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy()).stdout
    (line,) = [x for x in out.splitlines() if x.startswith('{"tp"')]  # vLLM logs to stdout too
    r: dict[str, Any] = json.loads(line)
    r["greedy"] = {int(k): v for k, v in r["greedy"].items()}
    return r


if __name__ == "__main__":
    raise SystemExit(main())
