"""Fairness benchmark: a quiet tenant beside a noisy one, and shares between two backlogged tenants.

Part 1: a quiet tenant alone, then beside a noisy one at 10x its quota. Prints, from one
run, the quiet tenant's success rate and p50/p99 latency alone and beside the noisy
tenant, the noisy tenant's outcomes, and the quiet p99 ratio (target: beside / alone
<= 1.1) with a bootstrap interval. Alternates alone/beside rounds so drift lands on
both. Requests go out through ``loadtest.lean_http`` on uvloop: with httpx (~2.8 ms of
client CPU per request), the noisy tenant's 17 requests a second ran in the loop that
times the quiet tenant and on the same two cores, so the client's own work could count
against "beside".

Parts 2 and 3 (``loadtest.fair_shares``): two tenants backlogged through one router
(weights 1:1, then 2:1, one sending 4x longer prompts), then through two routers with
skewed ingress, each beside the setting it improves on (first come, first served;
counters not shared).

Loopback only; bounded in time (about 10 minutes). Run: ``make bench-fairness``.
"""

import asyncio
import time
from collections import Counter
from typing import Any

from loadtest.bench_router import PORT, _pct, bench_parser, local_stack
from loadtest.lean_http import LeanClient, LeanHttpError, install_uvloop


async def _quiet(c: LeanClient, key: str, workers: int, duration_s: float) -> tuple[list[float], Counter]:
    latencies: list[float] = []
    codes: Counter = Counter()
    stop = time.monotonic() + duration_s

    async def worker() -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                r = await c.post_json(
                    "/v1/generate", {"prompt": "quiet tenant", "max_tokens": 16}, {"Authorization": f"Bearer {key}"}
                )
            except LeanHttpError as e:  # no answer: counted, and the worker goes on
                codes[e.kind] += 1
                continue
            ok = r.status == 200 and bool(r.json().get("text"))  # a 200 without text is no answer
            codes[200 if ok else r.status] += 1
            if ok:
                latencies.append((time.perf_counter() - t0) * 1000.0)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return latencies, codes


async def _noisy(c: LeanClient, key: str, rate_per_s: float, duration_s: float) -> Counter:
    codes: Counter = Counter()
    t0 = time.monotonic()
    tasks = []

    async def one() -> None:
        try:
            r = await c.post_json(
                "/v1/generate",
                {"prompt": "n" * 28, "max_tokens": 32, "criticality": "sheddable_plus"},
                {"Authorization": f"Bearer {key}"},
            )
        except LeanHttpError as e:
            codes[("no answer", e.kind)] += 1
            return
        codes[(r.status, r.json().get("error", {}).get("code", "OK"))] += 1

    for i in range(int(rate_per_s * duration_s)):
        await asyncio.sleep(max(0.0, t0 + i / rate_per_s - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return codes


def ratio_interval(
    beside: "list[float]", alone: "list[float]", q: float = 0.99, resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """A 90 % bootstrap interval for ``pct(beside, q) / pct(alone, q)``.

    A p99 from a thousand samples rests on its top ten, so one run's ratio moves by
    tenths between runs; the interval says how far this run's figure can be trusted.
    """
    import random

    rng = random.Random(seed)
    ratios = sorted(
        _pct(rng.choices(beside, k=len(beside)), q) / _pct(rng.choices(alone, k=len(alone)), q)
        for _ in range(resamples)
    )
    return ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]


def quiet_beside_noisy(args: Any) -> None:
    """Part 1: the quiet tenant alone and beside the noisy one; prints its table."""
    from ballast.config import load_config

    cfg = load_config(args.config)
    keys = {tenant: key for key, tenant in cfg.auth.demo_keys.items()}
    quiet_key, noisy_key = keys[args.quiet_tenant], keys[args.noisy_tenant]
    noisy_rate = cfg.tenants[args.noisy_tenant].rate_tokens_per_s
    if noisy_rate is None:
        raise SystemExit(f"tenant {args.noisy_tenant!r} has no token quota in {args.config}")
    noisy_rps = args.noise_factor * noisy_rate / (28 + 32)

    results: dict[str, dict[str, Any]] = {k: {"lat": [], "codes": Counter()} for k in ("alone", "beside")}
    noisy_codes: Counter = Counter()
    with local_stack(cfg):

        async def run() -> None:
            async with LeanClient("127.0.0.1", PORT, max_connections=400, timeout_s=60.0) as c:
                await _quiet(c, quiet_key, args.quiet_workers, 3.0)  # warm-up
                for rnd in range(args.rounds):
                    for side in ("alone", "beside") if rnd % 2 == 0 else ("beside", "alone"):
                        if side == "alone":
                            lat, codes = await _quiet(c, quiet_key, args.quiet_workers, args.round_s)
                        else:
                            (lat, codes), noise = await asyncio.gather(
                                _quiet(c, quiet_key, args.quiet_workers, args.round_s),
                                _noisy(c, noisy_key, noisy_rps, args.round_s),
                            )
                            noisy_codes.update(noise)
                        results[side]["lat"] += lat
                        results[side]["codes"].update(codes)
                        await asyncio.sleep(2.0)  # let the noisy tenant's bucket and the level settle

        install_uvloop()
        asyncio.run(run())

    print(
        f"\nfairness: quiet={args.quiet_tenant} ({args.quiet_workers} closed-loop workers), "
        f"noisy={args.noisy_tenant} at {args.noise_factor:g}x its {noisy_rate:g} tokens/s "
        f"({noisy_rps:.1f} req/s), {args.rounds}x{args.round_s:g}s per side"
    )
    print(f"{'quiet tenant':<14} {'n':>6} {'success':>8} {'p50 ms':>9} {'p99 ms':>9}")
    for side, r in results.items():
        total = sum(r["codes"].values())
        ok = r["codes"][200] / total if total else float("nan")
        print(f"{side:<14} {total:>6} {ok:>8.3f} {_pct(r['lat'], 0.5):>9.1f} {_pct(r['lat'], 0.99):>9.1f}")
    print(
        "noisy tenant outcomes: "
        + ", ".join(f"{s} {c}: {n}" for (s, c), n in sorted(noisy_codes.items(), key=lambda kv: str(kv[0])))
    )
    ratio = _pct(results["beside"]["lat"], 0.99) / _pct(results["alone"]["lat"], 0.99)
    low, high = ratio_interval(results["beside"]["lat"], results["alone"]["lat"])
    print(f"quiet p99 beside / alone: {ratio:.3f} (90 % bootstrap interval {low:.3f}..{high:.3f}; target <= 1.1)")


def main(argv: "list[str] | None" = None) -> int:
    parser = bench_parser(__doc__.splitlines()[0], rounds=4, round_s=15.0)
    parser.add_argument("--quiet-tenant", default="gold")
    parser.add_argument("--noisy-tenant", default="free")
    parser.add_argument("--quiet-workers", type=int, default=2)
    parser.add_argument("--noise-factor", type=float, default=10.0)
    parser.add_argument("--no-shares", action="store_true", help="the quiet tenant only (part 1)")
    parser.add_argument(
        "--shares-only", action="store_true", help="the shares between two backlogged tenants only (parts 2 and 3)"
    )
    parser.add_argument("--shares-warmup-s", type=float, default=8.0)
    parser.add_argument("--shares-measure-s", type=float, default=20.0)
    args = parser.parse_args(argv)

    if not args.shares_only:
        quiet_beside_noisy(args)
    if args.no_shares:
        return 0

    import yaml

    from loadtest import fair_shares

    with open(args.config) as f:
        base = yaml.safe_load(f)
    rows = fair_shares.run(
        base, PORT, args.shares_warmup_s, args.shares_measure_s, log=lambda s: print(f"... {s}", flush=True)
    )
    print(
        f"\nfair shares between two backlogged tenants (a's prompts 4x b's; {args.shares_measure_s:g} s measured each)"
    )
    print("\n".join(fair_shares.render(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
