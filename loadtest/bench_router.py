"""Router overhead benchmark: Ballast's two fronts vs a plain Serve ingress.

All three call the *same* model deployment (the plain one through
``serve.get_deployment_handle``), so the difference is what the router adds:
auth, body bounds and validation, admission, clamping, accounting and metrics.
``router`` is the native ``/v1/generate``, ``openai`` the OpenAI front's
``/v1/completions`` (the same pipeline, OpenAI's bodies and answers).

Closed-loop load at a fixed concurrency, alternating A/B in rounds so that drift
(thermal, other processes, GC) lands on both sides; all figures come from one run.
Loopback only; bounded in time. Run: ``make bench-router``.
"""

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx

PORT = 8124
BASE = f"http://127.0.0.1:{PORT}"


def plain_ingress_app(model_app: str):
    from fastapi import FastAPI
    from pydantic import BaseModel
    from ray import serve

    from ballast.model.protocol import ModelCall

    app = FastAPI()

    class Body(BaseModel):
        prompt: str
        max_tokens: int = 16

    @serve.deployment(name="PlainIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512)
    @serve.ingress(app)
    class PlainIngress:
        def __init__(self) -> None:
            self._model = serve.get_deployment_handle("BallastModel", app_name=model_app)

        @app.post("/generate")
        async def generate(self, body: Body) -> dict[str, Any]:
            # No ids: the replica tokenizes the prompt itself.
            out = await self._model.generate.remote(ModelCall(prompt=body.prompt, max_tokens=body.max_tokens))
            return {"text": out.text, "tokens_generated": out.tokens}

    return PlainIngress.bind()


async def _closed_loop(url: str, headers: dict[str, str], body: dict[str, Any], concurrency: int, duration_s: float):
    latencies_ms: list[float] = []
    errors = 0
    stop_at = time.monotonic() + duration_s

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            r = await client.post(url, headers=headers, json=body)
            if r.status_code == 200:
                latencies_ms.append((time.perf_counter() - t0) * 1000.0)
            else:
                errors += 1
                if errors == 1:
                    print(f"first error from {url}: {r.status_code} {r.text[:200]}")

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
    return latencies_ms, errors, elapsed


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_parser(description: str, rounds: int, round_s: float) -> argparse.ArgumentParser:
    """The options every local benchmark takes: its config, and its rounds (sides
    alternating, each round ``round_s`` seconds per side)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default="cluster/local.yaml")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--round-s", type=float, default=round_s)
    return parser


@contextlib.contextmanager
def local_stack(cfg: Any) -> Iterator[None]:
    """The Ballast stack on this machine for the block: the ingress settings applied, Ray
    started, the application on ``PORT``; then the application shut down, and Ray, however
    the block ends."""
    import ray

    from ballast.ops.app import shutdown, start
    from ballast.router.ingress import apply_ingress_env

    apply_ingress_env(cfg)
    ray.init(include_dashboard=False, logging_level="ERROR")
    try:
        start(cfg, "127.0.0.1", PORT)
        yield
    finally:
        try:
            shutdown(cfg)
        finally:
            ray.shutdown()


def main(argv: "list[str] | None" = None) -> int:
    parser = bench_parser(__doc__.splitlines()[0], rounds=3, round_s=8.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    args = parser.parse_args(argv)

    from ray import serve

    from ballast.config import load_config

    cfg = load_config(args.config)
    with local_stack(cfg):
        serve.run(plain_ingress_app(cfg.app_name), name="plain", route_prefix="/plain", blocking=False)
        key = next(iter(cfg.auth.demo_keys), None)
        if key is None:
            raise SystemExit("the benchmark needs a config with a demo key (cluster/local.yaml has two)")
        body = {"prompt": "The quick brown fox", "max_tokens": args.max_tokens}
        auth = {"Authorization": f"Bearer {key}"}
        sides = {
            "router": (f"{BASE}/v1/generate", auth, body),
            "openai": (f"{BASE}/v1/completions", auth, {"model": cfg.model.name, **body}),
            "plain": (f"{BASE}/plain/generate", {}, body),
        }
        for side in sides.values():  # warm every path
            asyncio.run(_closed_loop(*side, args.concurrency, args.warmup_s))
        results: dict[str, dict[str, Any]] = {k: {"lat": [], "err": 0, "s": 0.0} for k in sides}
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            for name in order:
                lat, err, elapsed = asyncio.run(_closed_loop(*sides[name], args.concurrency, args.round_s))
                results[name]["lat"] += lat
                results[name]["err"] += err
                results[name]["s"] += elapsed

    print(
        f"\nrouter overhead: concurrency={args.concurrency} max_tokens={args.max_tokens} "
        f"rounds={args.rounds}x{args.round_s:g}s per side, model={cfg.model.name}"
    )
    print(f"{'path':<8} {'n':>6} {'err':>4} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'req/s':>8}")
    fig: dict[str, dict[str, float]] = {}
    for name, r in results.items():
        lat = r["lat"]
        fig[name] = {"p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "rps": len(lat) / r["s"]}
        print(
            f"{name:<8} {len(lat):>6} {r['err']:>4} {fig[name]['p50']:>9.1f} {fig[name]['p99']:>9.1f} "
            f"{statistics.fmean(lat):>9.1f} {fig[name]['rps']:>8.1f}"
        )
    for front in ("router", "openai"):
        f, p = fig[front], fig["plain"]
        print(
            f"ratio {front}/plain: p50 {f['p50'] / p['p50']:.3f} (target <= 1.05), p99 {f['p99'] / p['p99']:.3f}, "
            f"throughput {f['rps'] / p['rps']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
