"""Time to first token with tools and without, on Ballast's vLLM path (``make bench-tools``).

One stack: the config's app with its primary model the ``--vllm-model`` directory on vLLM,
``model.tool_parser`` hermes (the demo model's template writes hermes-style calls), one
model replica, nothing else running. Requests one at a time (no queue: TTFT is the path's
and the engine's, not a wait), streamed, greedy, ``--max-tokens`` with ``ignore_eos``.
Each round sends one user message (new each round, so that its prefill is real) in three
forms, in an order that rotates:

- ``plain``: the conversation without tools;
- ``auto``: the same with ``TOOLS`` and ``tool_choice`` "auto" (an agent's every request:
  vLLM's hermes parser reads the stream, and the tools' grammar waits for ``<tool_call>``);
- ``required``: the same with ``tool_choice`` "required" (the call is forced: its first
  delta is the call's id and name).

The tools' definitions and the system prompt repeat from round to round, as an agent's do
(vLLM's prefix cache keeps them). TTFT: from the send to the first chunk carrying content
or a tool call, client side; the first ``--warmup`` rounds are not counted (the grammar's
first compile). Prints p50 and p90 per form and the ratios, then one line a script reads::

    tools-ttft: plain_p50_ms=<n> auto_p50_ms=<n> required_p50_ms=<n> auto_over_plain=<x> required_over_plain=<x>

Loopback only; bounded by ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

FORMS = ("plain", "auto", "required")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city now.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "metric": {"type": "boolean"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documentation.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]
SYSTEM = "You are a careful assistant. Call a tool when it helps; answer briefly otherwise."


def body(model: str, form: str, round_: int, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {round_}: what should I pack for a trip to city {round_}?"},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if form != "plain":
        out.update(tools=TOOLS, tool_choice=form)
    return out


def first_token_ms(client: Any, url: str, key: str, payload: dict[str, Any]) -> float:
    """Milliseconds from the send to the first chunk with content or a tool call."""
    start = time.perf_counter()
    with client.stream("POST", url, json=payload, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{payload.get('tool_choice', 'plain')}: {r.status_code} {r.read()[:300]!r}")
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    first = (time.perf_counter() - start) * 1000
    if first is None:
        raise RuntimeError(f"{payload.get('tool_choice', 'plain')}: no content and no call in the answer")
    return first


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def run(args: argparse.Namespace) -> dict[str, list[float]]:
    import httpx
    import ray

    from ballast.config import load_config, with_model_dir
    from ballast.ops.app import shutdown, start
    from loadtest.bench_overload import BASE, BENCH_KEY, PORT, VLLM_RSS_LIMIT_MB, bench_data

    data = with_model_dir(bench_data(args.config, 1), args.vllm_model, "vllm")
    data["fallback"] = None
    data["model"]["tool_parser"] = "hermes"
    data.setdefault("watchdog", {})["rss_limit_mb"] = VLLM_RSS_LIMIT_MB
    cfg = load_config(data)
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    try:
        start(cfg, "127.0.0.1", PORT)
        prefix = cfg.route_prefix.rstrip("/")
        url = f"{BASE}{prefix}/v1/chat/completions"
        with httpx.Client(timeout=60) as client:
            for _ in range(120):
                try:
                    if client.get(f"{BASE}{prefix}/healthz/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            for round_ in range(args.warmup + args.rounds):
                order = FORMS[round_ % 3 :] + FORMS[: round_ % 3]
                for form in order:
                    ms = first_token_ms(client, url, BENCH_KEY, body(cfg.model.name, form, round_, args.max_tokens))
                    if round_ >= args.warmup:
                        times[form].append(ms)
        return times
    finally:
        try:
            shutdown(cfg)
        finally:
            ray.shutdown()


def report(times: dict[str, list[float]]) -> str:
    p50 = {f: statistics.median(times[f]) for f in FORMS}
    for f in FORMS:
        print(f"{f:<9} n={len(times[f])} ttft p50 {p50[f]:.1f} ms  p90 {pct(times[f], 90):.1f} ms", flush=True)
    line = (
        f"tools-ttft: plain_p50_ms={p50['plain']:.1f} auto_p50_ms={p50['auto']:.1f} "
        f"required_p50_ms={p50['required']:.1f} auto_over_plain={p50['auto'] / p50['plain']:.3f} "
        f"required_over_plain={p50['required'] / p50['plain']:.3f}"
    )
    print(line, flush=True)
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cluster/local.yaml")
    p.add_argument("--vllm-model", default="models/demo")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    if not 1 <= args.rounds <= 1000 or not 0 <= args.warmup <= 100 or not 1 <= args.max_tokens <= 256:
        p.error("--rounds 1-1000, --warmup 0-100, --max-tokens 1-256")
    report(run(args))


if __name__ == "__main__":
    main()
