"""The CPU every process of a serving stack takes on this host, by its role on the path.

For the overload benchmark's cost section (``loadtest.bench_overload``): what a request
costs in front of the engine and beside it, Ballast's processes side by side with
``ray.serve.llm``'s on the same engine. Each process is named by its title (Ray sets
``ray::<actor class>`` or ``ray::ServeReplica:<app>:<deployment>``; vLLM sets
``VLLM::EngineCore`` and ``VLLM::Worker``), read with psutil:

========== ===================================================================
role       processes
========== ===================================================================
edge       HAProxy (Ballast's ingress)
proxy      Serve's HTTP proxy actors
router     Ballast's router replicas, or ray.serve.llm's OpenAI ingress
front      the model replica around the engine: Ballast's ``BallastModel``
           replica, or ray.serve.llm's ``LLMServer``
engine     vLLM's engine core and its worker (or the replica's own forward
           pass, which runs inside ``front`` on the built-in engine)
fallback   Ballast's fallback model replica
guards     Ballast's watchdogs, controller and idempotency store
serve      Serve's controller
ray        Ray's own daemons (raylet, GCS, dashboard, log monitor, ...)
========== ===================================================================

A process that ends between two reads counts what it had used when last read.

Beside its CPU, each role's **wait for a core**: the seconds its threads were runnable and
not running (Linux ``/proc/PID/task/TID/schedstat``, second field), summed over the role's
threads. On a host whose cores are all busy, a role that waits is one that the others slow
down: vLLM's worker waiting is the engine's throughput lost to the rest of the host.
"""

from __future__ import annotations

import os

ROLES = ("edge", "proxy", "router", "front", "engine", "fallback", "guards", "serve", "ray")

MAX_PIDS = 4096  # processes remembered (bounded)
MAX_THREADS = 16384  # threads remembered for their waits (bounded)
_RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "ray_client")


def role_of(name: str, title: str) -> str | None:
    """The role of a process named ``name`` (psutil's) with ``title`` (its ``cmdline[0]``),
    None for a process that is not the stack's."""
    if name == "haproxy":
        return "edge"
    if title.startswith("VLLM::"):
        return "engine"
    if title.startswith("ray::ServeReplica:"):
        deployment = title.split(":", 3)[-1]
        if "Router" in deployment or "OpenAiIngress" in deployment:
            return "router"
        if "FallbackModel" in deployment:
            return "fallback"
        if "BallastModel" in deployment or "LLMServer" in deployment:
            return "front"
        return None  # another app's replica: not this stack's
    if title.startswith(("ray::ProxyActor", "ray::SERVE_PROXY")):
        return "proxy"
    if title.startswith("ray::ServeController"):
        return "serve"
    if title.startswith(("ray::Watchdog", "ray::Controller", "ray::IdempotencyKeys")):
        return "guards"
    if any(d in title for d in _RAY_DAEMONS) or name in ("raylet", "gcs_server"):
        return "ray"
    return None


def thread_waits(pid: int) -> dict[int, float]:
    """Each thread of ``pid`` and the seconds it has waited, runnable, for a core (Linux
    ``/proc/PID/task/TID/schedstat``: run ns, wait ns, slices); empty where unreadable."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):  # the thread ended, or no schedstats
            continue
    return out


def wait_key(role: str) -> str:
    """The key of ``role``'s wait for a core in ``StackCpu.read``'s dict."""
    return f"{role} wait"


class StackCpu:
    """CPU seconds by role, and each role's wait for a core (``wait_key``), read on demand
    (``read``); differences of two reads are a phase's."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[str, float]] = {}  # pid -> (role, cpu s at its last read)
        self._waits: dict[int, tuple[str, float]] = {}  # tid -> (role, wait s at its last read)

    def read(self) -> dict[str, float]:
        import psutil

        for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
            try:
                title = (p.info["cmdline"] or [""])[0]
                role = role_of(p.info["name"] or "", title)
                times = p.info["cpu_times"]
            except (psutil.Error, IndexError):
                continue
            if role is not None and times is not None:
                self._last[p.pid] = (role, times.user + times.system)
                self._waits.update((tid, (role, w)) for tid, w in thread_waits(p.pid).items())
        if len(self._last) > MAX_PIDS:  # a long run's churn: forget the processes gone now
            self._last = {pid: v for pid, v in self._last.items() if psutil.pid_exists(pid)}
        if len(self._waits) > MAX_THREADS:
            self._waits = {tid: v for tid, v in self._waits.items() if os.path.exists(f"/proc/{tid}")}
        out = dict.fromkeys((*ROLES, *map(wait_key, ROLES)), 0.0)
        for role, cpu in self._last.values():
            out[role] += cpu
        for role, wait in self._waits.values():
            out[wait_key(role)] += wait
        return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds and waits by role between two reads (a role that appeared counts from zero)."""
    return {key: max(0.0, after.get(key, 0.0) - before.get(key, 0.0)) for key in after}
