"""CPU priority and placement of Ballast's processes on a host whose cores are busy.

Ray starts every worker process at nice 15 (its ``worker_niceness``), behind its raylet
and GCS. Ballast's front runs in Ray workers too: the router replicas, Serve's proxy and
HAProxy manager, and the HAProxy they start inherit the 15. On a host whose cores are
saturated by anything at the normal priority (another job, a load generator, the test
that is calling) the front then waits for the CPU, and deadlines are answered late.

So Ballast starts Ray's workers at the host's normal priority (``RAY_worker_niceness=0``,
``ballast.router.ingress.WORKER_NICENESS_ENV``, set before Ray starts, and in
cluster/cluster.yaml), and each model replica moves itself to ``model.niceness``. That is
0 by default, not Ray's 15: a replica is not only torch's compute but its own Ray and
asyncio threads, which hand batches in and answers out, and at 15 they waited behind
every wake-up of the front and the load generator. A node that runs batch work beside
the model can still set 15. Raising one's own niceness needs no
privilege, lowering it does, so nothing here lowers it.

Placement: a replica whose model lists ``model.cpus`` pins every one of its threads to
those cores (``pin_to_cores``), and what it starts later inherits the mask. On a CPU host
that gives the model cores of its own, as a GPU host gives it a device; the other
processes are kept off them by starting Ray under a mask without them (make
bench-models does), since a pin only says where the replica runs, not who else may.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection


def niceness(tid: int = 0) -> int:
    """The niceness of thread ``tid`` (Linux: a task; 0 is the calling thread)."""
    return os.getpriority(os.PRIO_PROCESS, tid)


def _thread_ids() -> list[int]:
    """This process's threads (Linux tasks); ``[0]``, the caller, where ``/proc/self/task`` is missing."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        return [0]


def yield_cpu_to(target: int) -> int:
    """Every thread of this process at niceness ``target`` or above; returns how many moved.

    On Linux niceness is per thread, and a thread started later takes its starter's, so
    each of the process's threads is set (the torch and Ray threads already running
    included). Where ``/proc/self/task`` is missing, the calling process is set.
    """
    if not 0 <= target <= 19:
        raise ValueError(f"niceness: must be in 0..19, got {target!r}")
    moved = 0
    for tid in _thread_ids():
        try:
            if niceness(tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
                moved += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return moved


def yield_this_thread_to(target: int) -> bool:
    """The calling thread (alone) at niceness ``target`` or above; True when it moved.

    For a thread that computes beside threads that must answer promptly: the compute
    takes what the others leave, and each of them runs as soon as it wakes."""
    if not 0 <= target <= 19:
        raise ValueError(f"compute_niceness: must be in 0..19, got {target!r}")
    tid = threading.get_native_id()
    if niceness(tid) >= target:
        return False
    os.setpriority(os.PRIO_PROCESS, tid, target)
    return True


def pin_to_cores(cores: Collection[int]) -> int:
    """Every thread of this process on ``cores`` alone; returns how many threads were set.

    Affinity is per thread on Linux, and a thread or process started later takes its
    starter's mask, so each of the process's threads is set (torch's and Ray's already
    running included). The cores are checked against the machine's, ``os.cpu_count()``,
    not against the mask this process inherited: a process may widen its own mask, and a
    replica started under a mask that leaves its cores out is how those cores are kept
    for it. A thread that ended meanwhile is skipped.
    """
    wanted = set(cores)
    have = os.cpu_count() or 1
    missing = sorted(c for c in wanted if not 0 <= c < have)
    if not wanted or missing:
        raise ValueError(f"cpus: cores {sorted(wanted)} asked for, this machine has cores 0..{have - 1}")
    pinned = 0
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, wanted)
            pinned += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return pinned
