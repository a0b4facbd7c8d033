"""``python -m loadtest.sim``: every arm on the same seeded day, printed as markdown.

The arms are independent given the seed, so they run in parallel processes
(``--jobs``); the results do not depend on how many.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from .config import ARMS, SimConfig
from .engine import Result, simulate
from .report import render


def _run(args: tuple[SimConfig, str, int]) -> Result:
    cfg, arm, seed = args
    return simulate(cfg, arm, seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.sim", description=__doc__)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--replicas-peak", type=int, default=SimConfig.replicas_peak)
    p.add_argument("--hours", type=float, default=SimConfig.hours)
    p.add_argument("--tick-s", type=float, default=SimConfig.tick_s)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--jobs", type=int, default=min(len(ARMS), os.cpu_count() or 1))
    a = p.parse_args(argv)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)}")
    try:
        cfg = replace(SimConfig(), replicas_peak=a.replicas_peak, hours=a.hours, tick_s=a.tick_s)
    except ValueError as e:
        p.error(str(e))

    t0 = time.perf_counter()
    work = [(cfg, arm, a.seed) for arm in arms]
    if a.jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(max_workers=a.jobs) as pool:
            results = list(pool.map(_run, work))
    else:
        results = [_run(w) for w in work]
    wall_s = time.perf_counter() - t0

    print(render(cfg, results, a.seed))
    per_arm = ", ".join(f"{r.arm} {r.wall_s:.1f} s" for r in results)
    print(f"\nWall time {wall_s:.1f} s with {min(a.jobs, len(work))} process(es) ({per_arm}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
