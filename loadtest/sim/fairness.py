"""``python -m loadtest.sim.fairness``: fair shares among tenants at fleet scale (``make sim-fairness``).

The cases of ``make bench-fairness`` (parts 2 and 3), through ``simulate`` with
``SimConfig.tenancy`` (``tenants.TenantLines`` on ``ballast.policies.fairness``):

* two tenants, ``a`` and ``b``, in one class (every request ``critical``, as in the
  bench: the order among tenants is inside a class); ``a``'s prompts are 4x ``b``'s,
  both ask for the same output tokens;
* a fixed fleet (``min_replicas = max_replicas``; the Ray Serve baseline's autoscaler,
  pinned there, and no shedding), offered Poisson arrivals at ``overload`` x what it
  starts at full batches, so that both tenants wait all the time;
* weights 1:1, then 2:1; for each, on the same seeded arrivals:
  - one router, both tenants offered alike: first come, first served (fairness off),
    then fair shares;
  - ``routers`` routers with skewed ingress: ``a`` only through the first ``routers - 1``,
    ``b`` only through the last, ``a`` offered 4x ``b``'s requests: the counters shared
    (the controller merges them and apportions the fleet), then not shared.

Printed per case: requests and raw tokens started per tenant; ``(a/wa) / (b/wb)``, each
tenant's service as the counters weigh it (``FairnessConfig.cost``) over its weight (1:
the split the weights ask for); and Jain's index over that service, among the tenants
backlogged at least half the ticks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from ballast.policies.fairness import jain_index

from .config import RAY_SERVE, SimConfig, TenancyConfig, TenantSpec
from .engine import Result, simulate

CRITICAL = 1  # the class every request of the scenario is in (rank order, model.CLASSES)
SHORT_PROMPT_TOKENS = 24
LONG_PROMPT_TOKENS = 4 * SHORT_PROMPT_TOKENS
OUTPUT_TOKENS = 16
SKEW = 4.0  # a's offered requests over b's through skewed ingress


@dataclass(frozen=True)
class Case:
    part: str
    setting: str
    tenancy: TenancyConfig


def cases(weights: tuple[float, float], routers: int) -> list[Case]:
    """The four settings of one weight pair, in the bench's order."""
    wa, wb = weights

    def spec(skewed: bool, enabled: bool = True, shared: bool = True) -> TenancyConfig:
        a_via, b_via = (tuple(range(routers - 1)), (routers - 1,)) if skewed else ((0,), (0,))
        return TenancyConfig(
            tenants=(
                TenantSpec("a", wa, SKEW if skewed else 1.0, LONG_PROMPT_TOKENS, OUTPUT_TOKENS, a_via),
                TenantSpec("b", wb, 1.0, SHORT_PROMPT_TOKENS, OUTPUT_TOKENS, b_via),
            ),
            routers=routers if skewed else 1,
            enabled=enabled,
            shared=shared,
        )

    skewed = f"{routers} routers, skewed"
    return [
        Case("one router", "fair shares", spec(False)),
        Case("one router", "first come, first served", spec(False, enabled=False)),
        Case(skewed, "counters shared", spec(True)),
        Case(skewed, "not shared", spec(True, shared=False)),
    ]


def fleet_config(replicas: int, minutes: float, tick_s: float = 1.0) -> SimConfig:
    """A fixed fleet of ``replicas``, every request critical (tenancy set per case)."""
    return SimConfig(
        replicas_peak=replicas,
        max_replicas_ratio=1.0,
        min_replicas=replicas,
        hours=minutes / 60.0,
        tick_s=tick_s,
        mix=(0.0, 1.0, 0.0, 0.0),
    )


def overloaded_arrivals(cfg: SimConfig, overload: float, seed: int) -> np.ndarray:
    """Poisson arrivals, all critical, at ``overload`` x the fleet's full-batch rate."""
    rate_per_s = overload * cfg.max_replicas * cfg.service.max_rate_per_s(cfg.max_batch_size)
    out = np.zeros((cfg.n_ticks, 4), dtype=np.int64)
    out[:, CRITICAL] = np.random.default_rng([seed, 0]).poisson(rate_per_s * cfg.tick_s, cfg.n_ticks)
    return out


def served_ratio(r: Result) -> float:
    """(a's service / its weight) over (b's / its weight): 1 is the weights' split."""
    a, b = r.tenants
    return a.service / b.service if b.service else float("inf")


def jain(r: Result, n_ticks: int) -> float:
    """Jain's index over the weighted service of the tenants backlogged at least half the ticks."""
    return jain_index(t.service for t in r.tenants if 2 * t.backlogged_ticks >= n_ticks)


def table(rows: Sequence[tuple[Case, tuple[float, float], Result]], n_ticks: int) -> str:
    out = [
        "| part | setting | weights a:b | requests a / b | raw tokens a / b | (a/wa) / (b/wb) | Jain |",
        "|" + "---|" * 7,
    ]
    for case, (wa, wb), r in rows:
        a, b = r.tenants
        tok_a, tok_b = a.prompt_tokens + a.output_tokens, b.prompt_tokens + b.output_tokens
        out.append(
            f"| {case.part} | {case.setting} | {wa:g}:{wb:g} | {a.served:,} / {b.served:,} "
            f"| {tok_a:,} / {tok_b:,} | {served_ratio(r):.3f} | {jain(r, n_ticks):.3f} |"
        )
    return "\n".join(out)


def _run(args: tuple[SimConfig, np.ndarray, int]) -> Result:
    cfg, arr, seed = args
    return simulate(cfg, RAY_SERVE, seed, arr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.sim.fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--overload", type=float, default=4.0, help="offered over what the fleet starts")
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    a = p.parse_args(argv)
    if a.routers < 2 or a.overload <= 0:
        p.error("--routers: at least 2; --overload: > 0")
    try:
        base = fleet_config(a.replicas, a.minutes)
    except ValueError as e:
        p.error(str(e))
    arr = overloaded_arrivals(base, a.overload, a.seed)
    plan = [(c, w) for w in ((1.0, 1.0), (2.0, 1.0)) for c in cases(w, a.routers)]
    work = [(replace(base, tenancy=c.tenancy), arr, a.seed) for c, _ in plan]
    t0 = time.perf_counter()
    if a.jobs > 1:
        with ProcessPoolExecutor(max_workers=a.jobs) as pool:
            results = list(pool.map(_run, work))
    else:
        results = [_run(w) for w in work]
    wall_s = time.perf_counter() - t0

    ten = plan[0][0].tenancy
    print(
        f"## Fair shares in the fleet simulator: {a.replicas:,} replicas (fixed), {a.minutes:g} min, "
        f"offered {a.overload:g}x what the fleet starts, seed {a.seed}\n"
    )
    print(
        f"Every request critical; a's prompts {LONG_PROMPT_TOKENS} tokens, b's {SHORT_PROMPT_TOKENS}, "
        f"{OUTPUT_TOKENS} output tokens each; cost = {ten.fairness.input_weight:g} x prompt + "
        f"{ten.fairness.output_weight:g} x output tokens, over the weight. Skewed ingress: a offered "
        f"{SKEW:g}x b's requests. lag_tokens {base.fair_lag_tokens():,.0f} (production's, scaled to "
        f"the fleet), router floor {ten.router_floor_ratio:g}, {ten.grants_per_router} grants per "
        f"router per tick.\n"
    )
    print(table([(c, w, r) for (c, w), r in zip(plan, results)], base.n_ticks))
    print(f"\nWall time {wall_s:.1f} s with {min(a.jobs, len(work))} process(es).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
