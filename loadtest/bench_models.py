"""Model isolation benchmark: one model flooded at 10 C beside another at 0.5 C, behind one router.

Two built-in models, ``a`` and ``b``, behind one Ballast router (a ``models:`` list built
from the config's first model: the same architecture and batching, seeds 0 and 1), each
its own Serve deployment with one fixed replica, its own level, gate, breaker and queue.
In one run, each step from a settled stack (every model's level 0):

1. C_B, then C_A: each model's capacity measured alone, the other idle, as the overload
   benchmark measures it (``bench_overload.find_capacity``: the highest open-loop rate
   keeping >= 90 % within the SLO, with the criticality mix). With ``--c-a-beside-b``,
   C_A is measured while B gets its phase load: what A can serve on the host B leaves it;
2. phase 1: B alone at ``--b-multiple`` (0.5) x C_B;
3. phase 2: A at ``--a-multiple`` (10) x C_A with the mix (5 % critical_plus), while B gets
   the same load as in phase 1 (the same seeded sequence).

It prints one row per phase and model (goodput, success by class, p99, the levels each
model's snapshot showed, the CPU its replica used), the CPU of the router and the load
generators, the host's speed around each phase (``loadtest.machine_speed``), the targets,
then ``loadtest.adapter_affinity``'s simulation with its defaults, and ends with two lines
a script can read::

    isolation: b_p99_ratio=<x> b_goodput_ratio=<x> b_max_level=<n> a_goodput_c=<x>
    affinity: loads_per_1000=<n> p2c_loads_per_1000=<n> max_over_mean=<x>

``b_p99_ratio`` and ``b_goodput_ratio`` are B's phase 2 over its phase 1: p99 of B's 200s
from each request's scheduled send time, and answers within the SLO per second.
``b_max_level``: the highest level B had during phase 2, in the controller's snapshot
(``snapshot.models.b.level``) or in the router's own view (``models.b.level``), sampled
every 0.5 s. ``a_goodput_c``: A's answers within the SLO per second over C_A.

What is isolated: each model's level (from its own replicas' reports), its gate's limit
and wait line, its breaker and retry budget, its replica's queue and batch. What is
shared: the router (its event loop and CPU parse, authenticate and refuse A's flood
before B's requests get their turn), Serve's proxy and HAProxy, the controller, and,
with ``--no-own-core-b``, the host's cores, on which both replicas, the router and the
load generators run. The edge refuses each model's requests in HAProxy by that model's
own level (it reads the body's ``model``), so most of A's refusals never reach the
router's Python.

By default (``--own-core-b``) B's replica has a core of its own, the CPU-host stand-in
for each model having its own accelerator: this process holds itself, before it starts
anything, on every core but the last, so that the speed probe, B's load process and
Ray (raylet, GCS, the front, A's replica) inherit that mask, and B's config lists the
last core in ``model.cpus``, to which its replica moves itself
(``ballast.model.niceness.pin_to_cores``). The run prints its layout first, and the
report carries it. B's compute is then its own, and what B can still lose to A's flood
is in the front (and the host's memory and caches), as on a cluster, where each model
has its own node and accelerator and only the router is shared; on two cores, A, the
front and the load share the one left, and C_A is measured there. With
``--no-own-core-b`` the figures show how much B loses to a flooded neighbour on the
same CPU.

Choices: one replica per model, fixed (no replica starts mid-phase); no fallback model
(it would be a third model process on two cores, and the question is the primary
lanes); A's replica not pinned within its cores (it shares them with the front and the
load, and keeps the kernel's choice of the idle one; each replica decodes on one torch
thread, ``model.cpu_threads`` 1); a tenant per model (``bench`` sends to A with
critical_plus allowed, ``bench-b`` to B), neither with a token quota, so that only the
levels and gates act; B's load comes from a process of its own, so that A's 10 C in the
generator's event loop does not delay B's sends (each row prints its send lag p99).
Loopback only; bounded in count and time (about 8 minutes). Run: ``make bench-models``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import io
import multiprocessing
import os
import time
from collections import Counter
from contextlib import redirect_stdout
from typing import Any

import httpx

from loadtest.bench_overload import (
    BASE,
    BENCH_KEY,
    CRITICAL_PLUS_TARGET,
    CRITICALITIES,
    DEFAULT_MIX,
    PORT,
    PROMPT,
    Phase,
    ServerCpu,
    Stack,
    bench_data,
    find_capacity,
    offer,
    reason_kind,
    sample_status,
    timed_machine,
)
from loadtest.bench_router import _pct
from loadtest.lean_http import install_uvloop
from loadtest.machine_speed import SpeedProbeProcess

A, B = "a", "b"
B_KEY = "bench-key-models-b"
B_TENANT = "bench-b"
P99_RATIO_TARGET = 1.1  # B's p99 beside A's flood over B alone, at most
GOODPUT_RATIO_TARGET = 1 / 1.1  # B's goodput beside A's flood over B alone, at least
A_GOODPUT_TARGET = 0.9  # A's goodput at 10 C_A, in units of C_A
SETTLE_MAX_S = 180.0  # the longest a settle waits for every model's level 0


def core_layout(own_core_b: bool, n_cores: int) -> tuple[list[int] | None, str]:
    """B's replica's cores, the last of ``n_cores`` (everything else goes on the others), and
    the layout in words; None: nothing pinned (``--no-own-core-b``, or a single core)."""
    if not own_core_b:
        return None, "nothing pinned (--no-own-core-b): every process where the OS puts it"
    if n_cores < 2:
        return None, "nothing pinned: one core, none to give b alone"
    rest = ",".join(str(c) for c in range(n_cores - 1))
    return [n_cores - 1], f"b on core {n_cores - 1}; everything else on cores {rest}"


def models_data(path: str, b_cores: list[int] | None = None, compute_niceness: int | None = None) -> dict[str, Any]:
    """The config at ``path`` as the overload benchmark takes it (``bench_data``: its
    quota-free ``bench`` tenant, one fixed replica, the bench port), its first model
    served twice as ``a`` and ``b`` (seeds 0 and 1, no fallback), and B's own tenant.
    B's replica runs on ``b_cores`` (``model.cpus``); the first model's own ``cpus`` are
    dropped: where each model runs is the benchmark's choice. Both run their engine's
    chunks at ``compute_niceness`` (``model.compute_niceness``; None: the config's)."""
    data = bench_data(path, 1)
    first = data.pop("model", None) or data["models"][0]
    base = {k: v for k, v in first.items() if k not in ("adapters", "tenants", "deployment", "fallback", "cpus")}
    if base.get("backend", "builtin") != "builtin":
        raise ValueError(f"{path}: the first model is {base['backend']!r}; bench-models serves the built-in model")
    if compute_niceness is not None:
        base["compute_niceness"] = compute_niceness
    data["models"] = [{**base, "name": A, "seed": 0}, {**base, "name": B, "seed": 1, "cpus": b_cores}]
    data["fallback"] = None
    data["tenants"][B_TENANT] = {
        "description": "model isolation benchmark: model b's tenant, no token quota",
        "max_concurrent": 100000,
        "max_criticality": "critical_plus",
    }
    data["auth"]["demo_keys"][B_KEY] = B_TENANT
    return data


def model_stack(model: str, key: str, prefix: str, slo_s: float, max_tokens: int) -> Stack:
    """``/v1/generate`` to ``model`` with ``key``, the SLO as each request's deadline."""

    def body(crit: str) -> dict[str, Any]:
        return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "criticality": crit}

    headers = {"Authorization": f"Bearer {key}", "X-Request-Timeout-Ms": str(int(slo_s * 1000))}
    return Stack(model, f"{prefix}/v1/generate", headers, body, class_header=True)


def _offer_in_process(
    stack_args: tuple[str, str, str, float, int], rate: float, duration_s: float, mix: dict[str, float], seed: int
) -> Phase:
    """``offer`` in the load process (B's): its own event loop on uvloop, its CPU counted."""
    install_uvloop()
    stack = model_stack(*stack_args)
    cpu0 = time.process_time()
    phase = asyncio.run(offer(stack, rate, duration_s, stack_args[3], mix, seed))
    phase.client_cpu_s = time.process_time() - cpu0
    return phase


def _ready() -> int:
    return os.getpid()


def levels_seen(trace: list[dict[str, Any]], model: str) -> list[int]:
    """Every level ``model`` had in the sampled ``/v1/status``: the controller's snapshot
    (``snapshot.models``) and the level the router acted on (``models``)."""
    out = []
    for t in trace:
        snap = ((t.get("snapshot") or {}).get("models") or {}).get(model)
        if snap is not None:
            out.append(int(snap["level"]))
        lane = (t.get("models") or {}).get(model)
        if lane is not None:
            out.append(int(lane["level"]))
    return out


def level_rises(trace: list[dict[str, Any]], model: str) -> list[tuple[int, str, dict[str, Any]]]:
    """The first sample at each level above 0 that ``model``'s snapshot entry showed: the
    level, its reason in full and that sample's signals (``inputs``). Sampled every 0.5 s, so
    the reason may already be a "hold" one: the signals are what kept it there."""
    seen: dict[int, tuple[int, str, dict[str, Any]]] = {}
    for t in trace:
        entry = ((t.get("snapshot") or {}).get("models") or {}).get(model) or {}
        level = int(entry.get("level") or 0)
        if level > 0 and level not in seen:
            seen[level] = (level, str(entry.get("reason")), entry.get("inputs") or {})
    return [seen[lv] for lv in sorted(seen)]


def gate_service_ms(trace: list[dict[str, Any]], model: str) -> float:
    """The median of ``model``'s gate's ``expected_service_ms`` over the sampled ``/v1/status``."""
    values = [
        float(g["expected_service_ms"])
        for t in trace
        if (g := ((t.get("models") or {}).get(model) or {}).get("gate")) and g.get("expected_service_ms") is not None
    ]
    return _pct(values, 0.5)


def critical_plus_first(phase: Phase) -> bool:
    """critical_plus answered within the SLO at a share no lower than any other class's."""
    top = phase.good_fraction("critical_plus")
    return all(top >= phase.good_fraction(c) for c in CRITICALITIES[1:] if phase.count(c))


class ReplicaCpu:
    """CPU time (user + system) of each model's replica processes, found by their Serve
    actor's name (``#<deployment>#``), read with psutil."""

    def __init__(self, deployments: dict[str, str]) -> None:
        import psutil
        import ray

        self.procs: dict[str, list[Any]] = {m: [] for m in deployments}
        for actor in ray.util.list_named_actors(all_namespaces=True):
            for model, dep in deployments.items():
                if f"#{dep}#" in actor["name"]:
                    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                    pid: int = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
                    self.procs[model].append(psutil.Process(pid))

    def read(self) -> dict[str, float]:
        return {m: sum(p.cpu_times().user + p.cpu_times().system for p in ps) for m, ps in self.procs.items()}


class _Bench:
    """One run: the stack, B's load process, the speed probe; ``rows`` and ``phases`` as measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ballast.config import load_config
        from ballast.model.niceness import pin_to_cores
        from ballast.router.ingress import ingress_env

        self.args = args
        self.mix = dict(DEFAULT_MIX)
        b_cores, self.layout = core_layout(args.own_core_b, os.cpu_count() or 1)
        if b_cores is not None:
            # Before any process is started: the speed probe, B's load process and Ray
            # (raylet, GCS, every worker, the front and A's replica) inherit this mask; B's
            # replica alone widens itself to its core, through its config.
            pin_to_cores(range(b_cores[0]))
        self.cfg = cfg = load_config(models_data(args.config, b_cores, args.compute_niceness))
        compute = {m.compute_niceness for m in cfg.models}
        self.layout += f"; engine chunks at niceness {'/'.join(str(c) for c in sorted(compute, key=str))}"
        print(f"layout: {self.layout}", flush=True)
        prefix = f"{BASE}{cfg.route_prefix.rstrip('/')}"
        self.stack_args = {
            A: (A, BENCH_KEY, prefix, args.slo_s, args.max_tokens),
            B: (B, B_KEY, prefix, args.slo_s, args.max_tokens),
        }
        self.stacks = {m: model_stack(*a) for m, a in self.stack_args.items()}
        self.status_url = f"{prefix}/v1/status"
        self.admin = {"Authorization": f"Bearer {cfg.auth.demo_admin_token}"}
        self.speed = SpeedProbeProcess(cfg.model.architecture.model_dump(), cfg.model.seed)
        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")
        )
        self.pool.submit(_ready).result()  # spawned now, not in phase 1's first second
        haproxy_cfg = ingress_env(cfg).get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC")
        self.front = ServerCpu(os.path.dirname(haproxy_cfg) if haproxy_cfg else None)
        self.caps: dict[str, float] = {}
        self.machine_at_c: dict[str, float] = {}
        self.phases: list[dict[str, Any]] = []
        self.replicas: ReplicaCpu | None = None  # found once the models are up

    def run(self) -> None:
        import ray

        from ballast.ops.app import shutdown, start
        from ballast.router.ingress import ingress_env

        os.environ.update(ingress_env(self.cfg))
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        try:
            start(self.cfg, "127.0.0.1", PORT)
            install_uvloop()
            asyncio.run(self._run())
        finally:
            try:
                shutdown(self.cfg)
            finally:
                ray.shutdown()
                self.speed.close()
                self.pool.shutdown()

    async def _run(self) -> None:
        args = self.args
        for model, given in ((B, args.capacity_b), (A, args.capacity_a)):
            if given is not None:
                self.caps[model] = given
                print(f"{model}: C = {given:.1f} req/s, as given", flush=True)
                continue
            beside = None
            if model == A and args.c_a_beside_b:
                beside = asyncio.create_task(self._b_steady(args.b_multiple * self.caps[B]))
            try:
                self.caps[model], self.machine_at_c[model] = await find_capacity(
                    self.stacks[model],
                    self.mix,
                    args.slo_s,
                    args.probe_s,
                    args.confirm_s,
                    args.seed,
                    self.settle,
                    self.speed,
                )
            finally:
                if beside is not None:
                    beside.cancel()
                    await asyncio.gather(beside, return_exceptions=True)
                    await asyncio.wrap_future(self.pool.submit(_ready))  # its last run done in B's process
        self.front.find()
        self.replicas = ReplicaCpu({m: self.cfg.deployment_name(m) for m in (A, B)})
        b_rate = args.b_multiple * self.caps[B]
        for name, rates in (("B alone", {B: b_rate}), ("A flooded", {A: args.a_multiple * self.caps[A], B: b_rate})):
            await self.settle()
            self.phases.append(await self.phase(name, rates))
            self._print_phase(self.phases[-1])

    async def _b_steady(self, rate: float) -> None:
        """B's phase load, again and again in 10 s runs, until cancelled (``--c-a-beside-b``;
        a run under way when cancelled finishes in its process, its outcomes unread: the
        caller waits for it)."""
        i = 0
        while True:
            i += 1
            future = self.pool.submit(
                _offer_in_process, self.stack_args[B], rate, 10.0, self.mix, self.args.seed + 300 + i
            )
            await asyncio.wrap_future(future)

    async def settle(self) -> None:
        """A quiet stack: the last load's stragglers done, every model's level 0 (bounded)."""
        await asyncio.sleep(2.0)
        stop = time.monotonic() + SETTLE_MAX_S
        async with httpx.AsyncClient(timeout=5) as c:
            while time.monotonic() < stop:
                try:
                    st = (await c.get(self.status_url, headers=self.admin)).json()
                    models = (st.get("snapshot") or {}).get("models") or {}
                    if models and all(int(m["level"]) == 0 for m in models.values()):
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(1.0)
        print(f"  settle: a model's level still above 0 after {SETTLE_MAX_S:g} s; going on", flush=True)

    async def phase(self, name: str, rates: dict[str, float]) -> dict[str, Any]:
        """Each model in ``rates`` offered its rate at once (B from its own process), with
        the CPU of the replicas, the front and the generators, and ``/v1/status`` sampled."""
        args = self.args
        trace: list[dict[str, Any]] = []
        sampler = asyncio.create_task(sample_status(self.status_url, self.admin, trace))
        seeds = {A: args.seed + 100, B: args.seed + 200}

        async def offered(model: str, rate: float) -> Phase:
            if model == B:
                future = self.pool.submit(_offer_in_process, self.stack_args[B], rate, args.phase_s, self.mix, seeds[B])
                return await asyncio.wrap_future(future)
            cpu0 = time.process_time()
            p = await offer(self.stacks[model], rate, args.phase_s, args.slo_s, self.mix, seeds[model])
            p.client_cpu_s = time.process_time() - cpu0  # with the status sampler and Ray's driver
            return p

        replicas = self.replicas
        assert replicas is not None

        async def work() -> tuple[dict[str, Phase], dict[str, float]]:
            rep0, front0 = replicas.read(), self.front.total_s()
            done = await asyncio.gather(*(offered(m, r) for m, r in rates.items()))
            rep1, front1 = replicas.read(), self.front.total_s()
            cpu = {m: rep1[m] - rep0[m] for m in rep0}
            cpu["front"] = front1 - front0
            return dict(zip(rates, done)), cpu

        (phases, cpu), machine_rps = await timed_machine(self.speed, work, 2.0)
        sampler.cancel()
        return {"name": name, "rates": rates, "phases": phases, "cpu": cpu, "machine_rps": machine_rps, "trace": trace}

    def _print_phase(self, ph: dict[str, Any]) -> None:
        for model, p in ph["phases"].items():
            codes = {c: dict(Counter(o.code for o in p.outcomes if o.criticality == c)) for c in self.mix}
            levels = Counter(levels_seen(ph["trace"], model))
            reasons = Counter(
                reason_kind((((t.get("snapshot") or {}).get("models") or {}).get(model) or {}).get("reason"))
                for t in ph["trace"]
            )
            print(
                f"  {ph['name']}: {model} at {p.rate:.1f} req/s: goodput {p.goodput():.1f} req/s, "
                f"p99 {p.admitted_p99_ms():.0f} ms, levels {dict(sorted(levels.items()))}; {codes} "
                f"({p.edge_refused} refused at the edge); "
                f"level reasons {dict(reasons)}",
                flush=True,
            )
            for level, why, inputs in level_rises(ph["trace"], model):
                print(f"    {model} at level {level}: {why}; inputs {inputs}", flush=True)

    # -- the report ---------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The table, the targets; the isolation figures (for the last line)."""
        args = self.args
        print(
            f"\nbench-models: SLO {args.slo_s:g} s, max_tokens {args.max_tokens}, {args.phase_s:g} s per phase, "
            f"mix "
            + "/".join(f"{c} {self.mix[c]:.0%}" for c in CRITICALITIES)
            + "; "
            + ", ".join(
                f"C_{m.upper()} {self.caps[m]:.1f} req/s"
                + (f" beside B at {args.b_multiple:g} C_B" if m == A and args.c_a_beside_b else "")
                + (f" (machine {self.machine_at_c[m]:.1f} rows/s)" if m in self.machine_at_c else "")
                for m in (B, A)
            )
            + f"; layout: {self.layout}"
        )
        print(
            f"{'phase':<10} {'model':<5} {'offered':>7} {'req/s':>6} {'goodput':>7} {'gp/C':>6} "
            + " ".join(f"{c[:10]:>10}" for c in CRITICALITIES)
            + f" {'p99 ms':>6} {'svc ms':>6} {'lag p99':>7} {'levels':>11} {'replica':>7} {'gen':>5}"
        )
        for ph in self.phases:
            for model, p in ph["phases"].items():
                levels = levels_seen(ph["trace"], model)
                span = f"{min(levels)}..{max(levels)}" if levels else "-"
                print(
                    f"{ph['name']:<10} {model:<5} {p.rate / self.caps[model]:>6.1f}C {p.rate:>6.1f} "
                    f"{p.goodput():>7.1f} {p.goodput() / self.caps[model]:>6.3f} "
                    + " ".join(f"{p.good_fraction(c):>10.3f}" for c in CRITICALITIES)
                    + f" {p.admitted_p99_ms():>6.0f} {gate_service_ms(ph['trace'], model):>6.0f} "
                    f"{p.send_lag_p99_ms():>7.0f} {span:>11} "
                    f"{ph['cpu'][model] / p.duration_s:>7.2f} {(p.client_cpu_s or 0.0) / p.duration_s:>5.2f}"
                )
        for ph in self.phases:
            print(
                f"{ph['name']}: front (proxy, router, HAProxy) {ph['cpu']['front'] / args.phase_s:.2f} cores; "
                + ", ".join(f"replica {m} {ph['cpu'][m] / args.phase_s:.2f}" for m in (A, B))
                + f" cores; machine {ph['machine_rps']:.1f} rows/s"
            )
        print(
            "goodput: answers within the SLO per second (gp/C: over the model's own C); per class: the share "
            "answered within the SLO; p99: of the 200s, from each request's scheduled send time; lag p99: how "
            "late its generator sent; svc ms: the median of the model's gate's mean service time (router to "
            "replica and back, the gate's wait left out) in the sampled /v1/status; levels: the model's "
            "levels there (the snapshot's and the router's view); replica, gen: cores used by the model's "
            "replica and by its load generator (A's "
            "with the status sampler and Ray's driver); machine: loadtest.machine_speed around the phase"
        )
        alone, beside = self.phases[0]["phases"][B], self.phases[1]["phases"][B]
        a = self.phases[1]["phases"][A]
        b_levels = levels_seen(self.phases[1]["trace"], B)
        out = {
            "b_p99_ratio": beside.admitted_p99_ms() / alone.admitted_p99_ms(),
            "b_goodput_ratio": beside.goodput() / alone.goodput() if alone.goodput() else float("nan"),
            "b_max_level": max(b_levels) if b_levels else -1,
            "a_goodput_c": a.goodput() / self.caps[A],
            "a_critical_plus": a.good_fraction("critical_plus"),
            "layout": self.layout,
        }
        print(
            "\nmachine: phase 2 / phase 1 "
            f"{self.phases[1]['machine_rps'] / self.phases[0]['machine_rps']:.2f} (the host's speed, not a target)"
        )
        targets = [
            (f"B's p99 beside A <= {P99_RATIO_TARGET} x alone", out["b_p99_ratio"] <= P99_RATIO_TARGET),
            (f"B's goodput beside A >= alone / {P99_RATIO_TARGET}", out["b_goodput_ratio"] >= GOODPUT_RATIO_TARGET),
            ("B's level 0 throughout", out["b_max_level"] == 0),
            (f"A's goodput >= {A_GOODPUT_TARGET} C_A", out["a_goodput_c"] >= A_GOODPUT_TARGET),
            (f"A's critical_plus >= {CRITICAL_PLUS_TARGET}", out["a_critical_plus"] >= CRITICAL_PLUS_TARGET),
            ("A's critical_plus first (its share above every other class's)", critical_plus_first(a)),
        ]
        for what, ok in targets:
            print(f"  [{'ok' if ok else 'MISSED'}] {what}")
        print(
            f"  b_p99_ratio {out['b_p99_ratio']:.3f}, b_goodput_ratio {out['b_goodput_ratio']:.3f}, "
            f"b_max_level {out['b_max_level']}, a_goodput_c {out['a_goodput_c']:.3f}, "
            f"a critical_plus {out['a_critical_plus']:.4f}"
        )
        return out


def affinity_lines() -> list[str]:
    """``loadtest.adapter_affinity`` with its defaults, in this process: its output's lines."""
    from loadtest import adapter_affinity

    buf = io.StringIO()
    with redirect_stdout(buf):
        adapter_affinity.main([])
    lines = buf.getvalue().splitlines()
    if not lines or not lines[-1].startswith("affinity: "):
        raise RuntimeError(f"loadtest.adapter_affinity: its last line is no 'affinity: ' line: {lines[-1:]}")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="cluster/local.yaml", help="the config whose first (built-in) model a and b are")
    p.add_argument("--slo-s", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--probe-s", type=float, default=8.0, help="length of each capacity probe on the ladder")
    p.add_argument("--confirm-s", type=float, default=20.0, help="length of the probe confirming C")
    p.add_argument("--phase-s", type=float, default=30.0, help="length of each phase")
    p.add_argument("--a-multiple", type=float, default=10.0, help="A's load in phase 2, in units of C_A")
    p.add_argument("--b-multiple", type=float, default=0.5, help="B's load in both phases, in units of C_B")
    p.add_argument("--capacity-a", type=float, default=None, help="take C_A as given (req/s) instead of measuring it")
    p.add_argument("--capacity-b", type=float, default=None, help="take C_B as given (req/s) instead of measuring it")
    p.add_argument(
        "--c-a-beside-b",
        action="store_true",
        help="measure C_A while B gets its phase load (what A can serve on the host B leaves it), not alone",
    )
    p.add_argument(
        "--own-core-b",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="model B's replica on a core of its own (the last core), everything else (Ray, the front, model A, "
        "the load generators, the speed probe) kept on the other cores: the CPU-host stand-in for each model "
        "having its own accelerator",
    )
    p.add_argument(
        "--compute-niceness",
        type=int,
        default=10,
        help="both models' model.compute_niceness: the engine's chunks at that niceness, the replica's other "
        "threads and the front at their own, so that a model's compute takes what the shared core's hops leave "
        "(docs/benchmarks.md: B's p99 beside A 1.62x alone without it, 1.01x with it)",
    )
    p.add_argument("--seed", type=int, default=7)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag in ("slo_s", "probe_s", "confirm_s", "phase_s", "a_multiple", "b_multiple"):
        if not getattr(args, flag) > 0:
            _parser().error(f"--{flag.replace('_', '-')}: need a positive number, got {getattr(args, flag)!r}")
    bench = _Bench(args)
    bench.run()
    out = bench.report()
    lines = affinity_lines()
    print("\nadapter affinity (loadtest.adapter_affinity, its defaults):")
    print("\n".join(lines[:-1]))
    print(
        f"isolation: b_p99_ratio={out['b_p99_ratio']:.3f} b_goodput_ratio={out['b_goodput_ratio']:.3f} "
        f"b_max_level={out['b_max_level']} a_goodput_c={out['a_goodput_c']:.3f}"
    )
    print(lines[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
