"""guidellm, the tool LLM teams measure servers with, against the integration stack.

It speaks vLLM's dialect of the OpenAI API (``ignore_eos``, ``stop: null``,
``max_completion_tokens``, ``stream_options.continuous_usage_stats``, a probe of
``GET /health``), so this run is the dialect's test with the tool itself: a constant
rate for a few seconds, every request completed, none errored, and its TTFT and ITL.
guidellm lives in an environment of its own (``.venv-guidellm``, ``make test`` installs
it: its pins differ from the server's). Loopback only, bounded by its own duration.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import BASE, GOLD, ROOT

from ballast.model.demo import make_tiny_llama

GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not GUIDELLM.exists(), reason="guidellm's environment is missing: `make test` installs it"),
]


def test_guidellm_runs_against_the_stack_with_no_errored_request(ballast, tmp_path):
    tokenizer = make_tiny_llama(tmp_path / "tokenizer")  # guidellm sizes its synthetic prompts with one
    out = tmp_path / "guidellm.json"
    key = GOLD["Authorization"].split()[1]
    cmd = [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target={BASE},model={ballast.model.name},api_key={key}",
        "--profile",
        "kind=constant,rate=4",
        "--constraint",
        "kind=max_duration,seconds=10",
        "--data",
        "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    # Two worker processes, not its default ten, on this machine's two cores.
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "2", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["median"]
    itl = metrics["inter_token_latency_ms"]["successful"]["median"]
    print(f"guidellm, constant 4/s for 10 s: {totals}; TTFT median {ttft:.1f} ms, ITL median {itl:.1f} ms")
    assert totals["errored"] == 0 and totals["successful"] >= 30, totals
    assert ttft > 0 and itl > 0
