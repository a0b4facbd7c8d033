"""An engine of several ranks in one replica: what the replica sets before its engine starts,
and how it finds the ranks' processes after, for its watchdog.

The replica of a model of ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks
holds a placement group of one bundle per rank (``ballast.policies.placement``). vLLM runs
the ranks one of two ways:

* ``mp`` (its CPU build; the default without GPUs): the ranks are child processes of the
  engine core, itself a child of the replica. vLLM's CPU workers bind each rank's OpenMP
  threads to the cores ``VLLM_CPU_OMP_THREADS_BIND`` lists ("0,1|2,3": rank 0 on cores 0
  and 1, rank 1 on 2 and 3); its default, ``auto``, binds rank i to NUMA node i and
  refuses more ranks than the host has NUMA nodes. :func:`rank_environment` therefore
  splits the replica's own cores (its ``model.cpus`` where set, else the cores it may run
  on) among the ranks, unless the variable is already set. vLLM sets ``LOCAL_WORLD_SIZE``
  itself (from ``tensor_parallel_size``), and the KV cache is sized per rank
  (``vllm_engine.default_engine_kwargs``).
* ``ray`` (GPUs): the ranks are Ray actors vLLM starts in the replica's placement group
  (Serve starts the replica with ``placement_group_capture_child_tasks``, and the engine
  is handed the group: ``vllm_engine``). A rank of less than a whole GPU tells vLLM its
  share through ``VLLM_RAY_PER_WORKER_GPUS``.

:func:`engine_processes` lists the engine's processes on this node by the names vLLM gives
them (``VLLM::EngineCore``, ``VLLM::Worker_TP1``, ...): the replica hands the list to its
watchdog, which samples them with the replica and names the one that goes away.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ballast.policies.placement import Placement

log = logging.getLogger("ballast.model")

#: How a rank's OpenMP threads are bound on vLLM's CPU build (see the module docstring).
OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: The GPU share of each of vLLM's Ray workers (1 unless set).
PER_WORKER_GPUS = "VLLM_RAY_PER_WORKER_GPUS"


def split_cores(cores: Sequence[int], world: int) -> list[list[int]]:
    """``cores`` split among ``world`` ranks, each a contiguous run, the larger runs first;
    with fewer cores than ranks, rank i shares core ``i mod len(cores)``."""
    if world < 1 or not cores:
        raise ValueError(f"split_cores: at least one core and one rank, got {list(cores)} for {world}")
    ordered = sorted(cores)
    if len(ordered) < world:
        return [[ordered[i % len(ordered)]] for i in range(world)]
    size, extra = divmod(len(ordered), world)
    out, at = [], 0
    for rank in range(world):
        n = size + (1 if rank < extra else 0)
        out.append(ordered[at : at + n])
        at += n
    return out


def rank_environment(placement: Placement | None, cores: Sequence[int], environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the replica sets before its engine of several ranks starts (none with
    one rank; a variable already in ``environ`` is the operator's, and kept)."""
    if placement is None:
        return {}
    out: dict[str, str] = {}
    if placement.executor == "mp" and OMP_BIND not in environ:
        out[OMP_BIND] = "|".join(",".join(str(c) for c in group) for group in split_cores(cores, placement.world))
    share = placement.gpus_per_rank
    if placement.executor == "ray" and 0 < share < 1 and PER_WORKER_GPUS not in environ:
        out[PER_WORKER_GPUS] = f"{share:g}"
    return out


def prepare_ranks(placement: Placement | None) -> dict[str, str]:
    """Set :func:`rank_environment` in this process (the engine's processes inherit it),
    from the cores this process may run on; returns what it set."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env = rank_environment(placement, cores, os.environ)
    os.environ.update(env)
    if env:
        log.info("ranks of %s: %s", placement.model if placement else "?", env)
    return env


def with_executor(engine_kwargs: Mapping[str, Any], placement: Placement | None) -> dict[str, Any]:
    """``engine_kwargs`` with vLLM's ``distributed_executor_backend`` the placement's (unless
    they name one)."""
    out = dict(engine_kwargs)
    if placement is not None:
        out.setdefault("distributed_executor_backend", placement.executor)
    return out


def engine_processes(pids: Sequence[int], psutil_module: Any = None) -> tuple[tuple[int, str], ...]:
    """(pid, name) of each of ``pids`` still running, by the name it gives itself (vLLM
    sets its processes' titles: psutil's ``name()``, else the first word of its command line)."""
    if psutil_module is None:
        import psutil

        psutil_module = psutil
    out = []
    for pid in pids:
        try:
            p = psutil_module.Process(pid)
            name = p.name() or ""
            if not name.startswith("VLLM::"):
                cmd = p.cmdline()
                name = cmd[0].split()[0] if cmd and cmd[0].strip() else name
            out.append((int(pid), name or f"pid {pid}"))
        except psutil_module.Error:
            continue
    return tuple(out)


def placement_group_actor_pids() -> list[int]:
    """The processes of the Ray actors in this replica's placement group on this node (vLLM's
    ranks under its ``ray`` executor), found through Ray's state API; [] where that cannot
    answer (no dashboard) or outside a placement group. Ranks on other nodes are not listed:
    their loss reaches the replica as its engine's death."""
    try:
        import ray
        from ray.util.state import list_actors

        pg = ray.util.get_current_placement_group()
        if pg is None:
            return []
        node = ray.get_runtime_context().get_node_id()
        actors = list_actors(
            filters=[("placement_group_id", "=", pg.id.hex()), ("state", "=", "ALIVE")],
            detail=True,  # placement_group_id is a detail column
            raise_on_missing_output=False,
        )
        me = os.getpid()
        return [int(a.pid) for a in actors if a.node_id == node and a.pid and int(a.pid) != me]
    except Exception as e:  # a view for the watchdog only: never a reason not to serve
        log.info("could not list the placement group's actors: %r", e)
        return []
