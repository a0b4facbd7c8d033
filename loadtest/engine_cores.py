"""An engine on a core of its own, for the benches that compare stacks on this small host.

On a GPU host the engine computes on its device and the serving processes (proxy, router,
replica, Ray's daemons, the load generator) have the host's cores; on a CPU host of two
cores they take turns on the engine's. ``engine_cpu("own")`` gives the engine the last
core of this process's affinity and keeps everything else off it: this process, and so Ray
and every process either side starts, runs on the other cores, and vLLM's worker binds its
threads to the engine's core (``VLLM_CPU_OMP_THREADS_BIND``, in the environment its
processes inherit). A Ballast model replica is pinned there by its config (``model.cpus``:
the benches set it to ``Placement.core``), and with it what it starts: vLLM's engine core
beside its worker. Left on the busy cores, the engine core (vLLM's scheduler) starved
when the front refused 400 requests a second, and steps came late (critical_plus 0.81 in a
10 C crowd, against 1.00 with it on the engine's core: docs/benchmarks.md). ``shared``
changes nothing: the kernel places everything, as on a host nobody tuned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

ENGINE_CPU = ("own", "shared")
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def engine_core(cores: Iterable[int]) -> tuple[int, set[int]] | None:
    """The core the engine gets to itself (the last of ``cores``) and the ones left to
    everything else; None with fewer than two cores (nothing to keep apart)."""
    ordered = sorted(set(cores))
    if len(ordered) < 2:
        return None
    return ordered[-1], set(ordered[:-1])


@dataclass(frozen=True)
class Placement:
    """Where the engine runs: ``core`` (None: wherever the kernel puts it), in words."""

    core: int | None
    words: str


@contextlib.contextmanager
def engine_cpu(mode: str) -> Iterator[Placement]:
    """Within it, what ``mode`` says (the module docstring); this process's affinity and
    the environment are restored after. A bind the operator set is kept as set."""
    if mode not in ENGINE_CPU:
        raise ValueError(f"engine cpu: one of {ENGINE_CPU}, got {mode!r}")
    split = engine_core(os.sched_getaffinity(0)) if mode == "own" else None
    if split is None or os.environ.get(OMP_BIND):
        why = f"{OMP_BIND}={os.environ[OMP_BIND]!r} as set" if os.environ.get(OMP_BIND) else mode
        yield Placement(None, f"engine cores: {why}, the kernel places the rest")
        return
    core, rest = split
    before = os.sched_getaffinity(0)
    os.environ[OMP_BIND] = str(core)
    os.sched_setaffinity(0, rest)
    try:
        yield Placement(core, f"engine cores: the model on core {core} alone, every other process on {sorted(rest)}")
    finally:
        os.environ.pop(OMP_BIND, None)
        os.sched_setaffinity(0, before)
