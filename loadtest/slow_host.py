"""A deliberately slowed host for the benchmarks (``--slow-host N``): ``N`` busy processes,
each pinned to one core and spinning at normal priority, take a share of those cores from
everything else for as long as the benchmark runs.

What it shows: whether a stack's figures measured against its own capacity C hold when
the host is slower (the overload benchmark's ratios should not depend on the host's
speed). The benchmarks' machine-speed probe (``loadtest.machine_speed``) prints how much
slower the host got.

Bounded: the burners stop when the context exits, when their parent dies (each polls its
parent's pid), and at ``max_s`` in any case. Nothing leaves the host.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MAX_S = 4 * 3600.0  # a burner's longest life, whatever happens to its parent
_CHECK_EVERY = 200_000  # spins between looks at the stop flag, the parent and the clock


def _burn(core: int, parent: int, stop: Any, pinned: Any, max_s: float) -> None:
    os.sched_setaffinity(0, {core})
    pinned.release()
    end = time.monotonic() + max_s
    x = 0
    while True:
        for _ in range(_CHECK_EVERY):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        if stop.is_set() or os.getppid() != parent or time.monotonic() > end:
            return


def cores_for(n: int) -> list[int]:
    """The cores ``n`` burners are pinned to: the first ``n`` this process may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= n <= len(allowed):
        raise ValueError(f"--slow-host: 1 to {len(allowed)} busy cores on this host, got {n}")
    return allowed[:n]


@contextmanager
def slowed(n: int, max_s: float = MAX_S) -> Iterator[list[mp.Process]]:
    """``n`` burners (none for 0), each on its core before the block runs; stopped and
    joined after it."""
    if n == 0:
        yield []
        return
    ctx = mp.get_context("spawn")  # no copy of the bench's threads or Ray state
    stop, pinned = ctx.Event(), ctx.Semaphore(0)
    procs = [
        ctx.Process(target=_burn, args=(core, os.getpid(), stop, pinned, max_s), daemon=True, name=f"slow-host-{core}")
        for core in cores_for(n)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:  # the run starts once every burner is on its core
            if not pinned.acquire(timeout=60.0):
                raise RuntimeError("--slow-host: a busy process did not start within 60 s")
        yield procs
    finally:
        stop.set()
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
