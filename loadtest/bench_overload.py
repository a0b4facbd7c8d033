"""Overload benchmark: plain Ray Serve vs Ballast at 1, 2, 4 and 10 times capacity, on the
built-in model and on vLLM.

For each stack, in one run:

1. measure its capacity C: the highest open-loop rate at which at least 90 % of
   requests get a 200 within the SLO (an ascending ladder of short probes, its last
   passing rung confirmed over a phase's length: ``measure_capacity``); where no rate
   keeps 90 %, the ladder's first rung stands in for C, and the report says so;
2. offer 1 C, 2 C, 4 C and 10 C with a criticality mix, and print goodput / C
   (answers within the SLO per second, over C), success by criticality (the share
   answered within the SLO) and the p99 latency of the requests that were admitted;
3. print, per class, the share it got of what strict class order allows it
   (``feasible_shares``: what is left of C after the classes above it, capped by its
   demand), so that "critical got 15 %" reads against what it could have had.

A stack whose C was not found, or whose session failed, does not stop the run: every other
stack's rows, the table and the targets are printed, then each such stack and why, and
only then does the process exit with 1 (``report``).

Three stacks, each measured against its own C:

- ``plain``: the same torch model with the same dynamic batching, deployed as its own
  HTTP ingress with Serve's default settings (one replica, ``max_ongoing_requests``
  5, an unbounded queue);
- ``plain-bounded``: the same, as a careful Serve user sets it up: a bounded
  ``max_queued_requests`` and 503 + Retry-After beyond it (``BackpressureConfig``).
  Its C is measured with Ballast's ``max_ongoing_requests`` and a queue that bounds
  nothing; then each pair of ``--ongoing`` x ``--queue-factors`` (the queue as a factor
  of C x SLO, what the replica serves in one SLO) is tried for a half-length phase
  at 4 x that C; the best pair is kept, so plain Serve gets its best 4 C, and
  its C is measured again as configured;
- ``ballast``: the app from the config, behind its router.

Three more on vLLM, on a Hugging Face directory (``--vllm-model``, the demo model that
``make demo-model`` writes), all with the same engine settings (``vllm_engine_kwargs``:
float32, eager, a 512-token context, ``max_num_seqs`` and a KV cache sized for the
config's ``max_batch_size`` rows as Ballast sizes its own), requests to
``POST /v1/completions`` that run to ``--max-tokens`` greedily (``ignore_eos``, so every
stack does the same work per answer), after the others, one engine alive at a time:

- ``llm``: plain ``ray.serve.llm`` (``build_openai_app``) with its defaults: its OpenAI
  ingress and LLM server both take any number of requests and queue without a bound;
- ``llm-bounded``: the same as a careful user sets it: the ingress bounded at the
  engine's ``max_num_seqs`` in flight and ``max_queued_requests`` at
  ``--llm-queue-factor`` x C x SLO (``bounded_queue``), 503 + Retry-After beyond it.
  The pair is fixed, not searched as plain-bounded's is: every redeploy restarts the
  engine (Serve gives each ``serve.run`` a new code version). Its C is measured as
  configured, the bound set from llm's C (or a provisional C with a queue that bounds
  nothing);
- ``ballast-vllm``: Ballast with ``model.backend: vllm`` on the same directory and engine
  settings, one model replica, a watchdog memory limit that fits vLLM's three processes.

Each row also prints the CPU the processes in front of the model used (Serve's proxy
actors, Ballast's routers or ray.serve.llm's ingress, HAProxy: ``ServerCpu``, psutil), per
second and per refusal (``refusal_cpu_ms``); a cost section prints, per phase, the p50 and
p99 of the 200s and every role's CPU per answer (``loadtest.stack_cpu``: edge, proxy,
router, the model replica's front, vLLM's engine, Ballast's guards, ...). Where plain
``ray.serve.llm`` ran, Ballast on vLLM is offered one more phase at llm's C: the same
requests at the same rate, its latency beside llm's at 1 C. The run ends with Ballast's
targets (``check_targets``; on vLLM ``check_vllm_targets``, issue 47's).
The host's own speed is timed around C's probes and each phase (``machine``:
loadtest/machine_speed.py, the replica's batch in a process of its own): on this
shared host it drifts 10-20 % within minutes, which a goodput / C ratio would
otherwise read as the stack's doing.
All get identical requests, including ``X-Request-Timeout-Ms``
set to the SLO (plain Serve has no use for it). Latency runs from each request's
scheduled send time, so a slow client does not hide queueing; the generator is
``loadtest.lean_http`` on uvloop (httpx cost ~2.8 ms of client CPU per request here,
which at 4 C took a third of a core from the server it was measuring), and each row
prints the p99 of how late it sent (``lag p99 ms``) so a lagging client shows.
With ``--sdk`` a third set of rows sends the same requests through the SDK
(``ballast.client``, httpx): not by default, because on this machine the SDK's
httpx costs ~2.8 ms of CPU per request on the cores the server runs on (a third of
a core at 4 C), so those rows measured the client's cost more than Ballast's.

``--engine-cpu own`` gives the engine a core of its own, away from the generator and the
front (``loadtest.engine_cores``): vLLM's worker bound there for both vLLM stacks, the model
replica pinned there by ``model.cpus`` for Ballast (on either engine, vLLM's engine core
with it) and plain Serve, everything else on the other cores; ray.serve.llm's LLM server
and engine core stay where the kernel puts them (its deployment takes no core list). The
default, ``shared``, leaves it all to the kernel, so that the rows can be read both ways.

The default mix keeps critical traffic (critical_plus + critical) at 20 % of what
is offered: at 4 C that is 0.8 C, which a stack sized for its critical traffic
can serve. Loopback only; bounded in count and time. Run:
``make bench-overload`` (``ARGS=--no-vllm`` leaves the vLLM stacks out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from ballast.names import ROUTER_DEPLOYMENT
from ballast.ops.status_text import model_view, sole_model
from loadtest import stack_cpu
from loadtest.bench_router import _pct
from loadtest.engine_cores import ENGINE_CPU, engine_cpu
from loadtest.lean_http import LeanClient, LeanHttpError, LeanResponse, install_uvloop
from loadtest.machine_speed import SpeedProbeProcess

PORT = 8124
BASE = f"http://127.0.0.1:{PORT}"
BENCH_KEY = "bench-key-overload"  # a tenant of its own: no token quota, so only overload policy acts
CRITICALITIES = ("critical_plus", "critical", "sheddable_plus", "sheddable")
CRITICAL_CLASSES = ("critical_plus", "critical")
DEFAULT_MIX = {"critical_plus": 0.05, "critical": 0.15, "sheddable_plus": 0.30, "sheddable": 0.50}
MULTIPLES = (1.0, 2.0, 4.0, 10.0)
VLLM_STACKS = ("llm", "llm-bounded", "ballast-vllm")
STACK_NAMES = ("plain", "plain-bounded", "ballast", "ballast+sdk") + VLLM_STACKS
SESSIONS = ("plain", "ballast", "llm", "ballast-vllm")  # in run order: each a Ray of its own
BALLAST_SESSIONS = ("ballast", "ballast-vllm")
# Both vLLM stacks' engine settings; the rows and KV cache come from vllm_engine_kwargs.
VLLM_ENGINE_KWARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "enable_prefix_caching": True}
VLLM_RSS_LIMIT_MB = 6000  # the watchdog's limit for the replica, vLLM's engine core and its worker together
LLM_NUM_CPUS = 8  # logical: ray.serve.llm's ingress is scheduled beside the engine's placement group
LLM_INGRESS_DEPLOYMENT = "OpenAiIngress"  # ray.serve.llm's ingress: in front of the model, as Ballast's router
CLIENT_TIMEOUT_S = 10.0  # the longest any one request is waited for: runs end by themselves
MAX_IN_FLIGHT = 4000  # client-side bound; arrivals beyond it are counted as client drops
IDLE_S = 5.0  # how long the server's idle CPU is read before a stack's phases


@dataclass
class Outcome:
    criticality: str
    status: int  # 0: no HTTP answer (timeout, connection error, client drop)
    code: str
    latency_s: float
    sent_s: float = 0.0  # scheduled send time, from the phase's start


@dataclass
class Phase:
    rate: float
    duration_s: float
    slo_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)  # Ballast's /v1/status, sampled
    # How late the generator sent each request: (scheduled send time from the phase's start, lag), s
    send_lags: list[tuple[float, float]] = field(default_factory=list)
    server_cpu_s: float | None = None  # CPU time of the processes in front of the model (ServerCpu)
    idle_cores: float = 0.0  # what those processes use with no traffic (their timers, metrics), per second
    edge_refused: int = 0  # refusals HAProxy answered (X-Ballast-Edge: refused), before the router
    client_cpu_s: float | None = None  # CPU time of this process (the load generator, its Ray driver too)
    machine_rps: float | None = None  # the machine's speed around the phase (loadtest.machine_speed), rows/s
    stack_cpu: dict[str, float] = field(default_factory=dict)  # CPU s by role on the path (loadtest.stack_cpu)

    def answered(self) -> int:
        return sum(1 for o in self.outcomes if o.status == 200)

    def refused(self) -> int:
        """Refusals the server answered (429/503): the ones whose cost the overload targets bound."""
        return sum(1 for o in self.outcomes if o.status in (429, 503))

    def send_lag_p99_ms(self) -> float:
        return _pct([lag * 1000.0 for _, lag in self.send_lags], 0.99)

    def good(self, criticality: str | None = None) -> int:
        return sum(
            1
            for o in self.outcomes
            if o.status == 200 and o.latency_s <= self.slo_s and (criticality is None or o.criticality == criticality)
        )

    def count(self, criticality: str | None = None) -> int:
        return sum(1 for o in self.outcomes if criticality is None or o.criticality == criticality)

    def good_fraction(self, criticality: str | None = None) -> float:
        n = self.count(criticality)
        return self.good(criticality) / n if n else float("nan")

    def goodput(self) -> float:
        return self.good() / self.duration_s

    def admitted_p99_ms(self) -> float:
        return _pct([o.latency_s * 1000.0 for o in self.outcomes if o.status == 200], 0.99)

    def admitted_p50_ms(self) -> float:
        return _pct([o.latency_s * 1000.0 for o in self.outcomes if o.status == 200], 0.50)

    def answer_p99_ms(self) -> float:
        """p99 of every answer the server gave (200, refusals, 504s): each request carries
        the SLO as its deadline (X-Request-Timeout-Ms), so Ballast's stays within it + 100 ms."""
        return _pct([o.latency_s * 1000.0 for o in self.outcomes if o.status != 0], 0.99)

    def codes(self) -> Counter:
        return Counter(o.code for o in self.outcomes)

    def per_second(self) -> list[dict[str, Any]]:
        """By second of scheduled send time: offered, good, critical good/offered, the codes
        of critical misses, the generator's longest send lag (ms: a stall of this host shows
        here as in the service), and Ballast's level and gate (last /v1/status sample in it)."""
        rows: dict[int, dict[str, Any]] = {}
        for o in self.outcomes:
            row = rows.setdefault(
                int(o.sent_s), {"sent": 0, "good": 0, "crit": 0, "crit_good": 0, "crit_miss": Counter()}
            )
            good = o.status == 200 and o.latency_s <= self.slo_s
            row["sent"] += 1
            row["good"] += good
            if o.criticality in CRITICAL_CLASSES:
                row["crit"] += 1
                row["crit_good"] += good
                if not good:
                    row["crit_miss"][o.code if o.status != 200 else "LATE"] += 1
        for sent_s, lag in self.send_lags:
            row = rows.get(int(sent_s))
            if row is not None:
                row["lag_ms"] = max(row.get("lag_ms", 0.0), 1000.0 * lag)
        for t in self.trace:
            row = rows.get(int(t.get("_t", -1)))
            if row is not None:
                row["status"] = t
        return [{"s": s, **rows[s]} for s in sorted(rows)]


@dataclass
class Stack:
    name: str
    url: str
    headers: dict[str, str]
    body: Callable[[str], dict[str, Any]]
    # When set, requests go through Ballast's SDK (ballast/client/) made by this:
    # one client for all the phases, as a long-lived caller has, so its per-criticality
    # adaptive throttle (2-minute window) carries what it learnt from one phase into the next.
    sdk: Callable[[], Any] | None = None
    # Name each request's class in X-Ballast-Criticality too (Ballast's edge reads it;
    # plain Serve has no use for it, and its HAProxy is the same one).
    class_header: bool = False

    @property
    def path(self) -> str:
        return urlsplit(self.url).path

    @property
    def completions(self) -> bool:
        """An OpenAI ``/v1/completions`` route: its answer's text is ``choices[0].text``."""
        return self.path.endswith("/v1/completions")


def feasible_shares(mix: dict[str, float], multiple: float) -> dict[str, float]:
    """The share of each class's demand that strict class order lets through at ``multiple`` × C.

    Classes are served most critical first: each gets what is left of C after the
    classes above it, at most its own demand (``mix[c] × multiple``, in units of C).
    At 10 C with the default mix, critical_plus (0.5 C) gets all it asks, critical
    (1.5 C) the remaining 0.5 C, a third, and the sheddable classes nothing.
    """
    if multiple <= 0:
        raise ValueError(f"multiple: must be > 0, got {multiple!r}")
    left = 1.0
    out = {}
    for c in CRITICALITIES:
        demand = mix.get(c, 0.0) * multiple
        allowed = min(demand, left)
        left -= allowed
        if left < 1e-9:  # what rounding leaves over is nothing (2 C: 0.1 + 0.3 + 0.6 fills C)
            left = 0.0
        out[c] = allowed / demand if demand > 0 else float("nan")
    return out


def share_of_feasible(got: float, feasible: float) -> float | None:
    """What a class got over what strict order allowed it; None where it was allowed nothing."""
    if not feasible or feasible != feasible:  # 0 or nan: nothing to get a share of
        return None
    return got / feasible


def criticality_sequence(n: int, mix: dict[str, float], seed: int) -> list[str]:
    """``n`` criticalities drawn from ``mix`` (seeded: both stacks get the same sequence)."""
    rng = random.Random(seed)
    names = list(mix)
    return rng.choices(names, weights=[mix[c] for c in names], k=n)


def _client(stack: Stack, max_connections: int) -> LeanClient:
    u = urlsplit(stack.url)
    return LeanClient(
        u.hostname or "127.0.0.1", u.port or 80, max_connections=max_connections, timeout_s=CLIENT_TIMEOUT_S
    )


async def offer(
    stack: Stack,
    rate: float,
    duration_s: float,
    slo_s: float,
    mix: dict[str, float],
    seed: int,
    sdk: Any = None,
    times: list[float] | None = None,
) -> Phase:
    """Open loop: ``rate`` requests per second, evenly spaced, for ``duration_s``, or at
    ``times`` (seconds from the start, ascending; ``rate`` then their mean) when given;
    through ``sdk``, a client made by ``stack.sdk``, when given."""
    phase = Phase(rate, duration_s, slo_s)
    if times is None:
        times = [i / rate for i in range(max(1, int(rate * duration_s)))]
    crits = criticality_sequence(len(times), mix, seed)
    in_flight = 0

    async def one(client: LeanClient, crit: str, scheduled: float) -> None:
        nonlocal in_flight
        in_flight += 1
        try:
            if sdk is not None:
                await _one_sdk(sdk, stack, crit, scheduled, scheduled - t0, phase)
                return
            headers = {**stack.headers, "X-Ballast-Criticality": crit} if stack.class_header else stack.headers
            r = await client.post_json(stack.path, stack.body(crit), headers)
            status, code = _judge(r, stack.completions)
            if r.headers.get("x-ballast-edge") == "refused":
                phase.edge_refused += 1
            phase.outcomes.append(Outcome(crit, status, code, time.perf_counter() - scheduled, scheduled - t0))
        except LeanHttpError as e:
            phase.outcomes.append(Outcome(crit, 0, e.kind, time.perf_counter() - scheduled, scheduled - t0))
        finally:
            in_flight -= 1

    async with _client(stack, MAX_IN_FLIGHT) as client:
        tasks = []
        t0 = time.perf_counter()
        for at_s, crit in zip(times, crits, strict=True):
            scheduled = t0 + at_s
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if in_flight >= MAX_IN_FLIGHT:
                phase.outcomes.append(Outcome(crit, 0, "client_drop", 0.0, scheduled - t0))
                continue
            tasks.append(asyncio.create_task(one(client, crit, scheduled)))
            phase.send_lags.append((scheduled - t0, time.perf_counter() - scheduled))
        await asyncio.gather(*tasks)
    return phase


async def _one_sdk(sdk: Any, stack: Stack, crit: str, scheduled: float, sent_s: float, phase: Phase) -> None:
    from ballast.client import BallastClientError

    body = stack.body(crit)
    try:
        await sdk.generate(body["prompt"], max_tokens=body["max_tokens"], criticality=crit)
        phase.outcomes.append(Outcome(crit, 200, "OK", time.perf_counter() - scheduled, sent_s))
    except BallastClientError as e:
        phase.outcomes.append(Outcome(crit, e.status or 0, e.code, time.perf_counter() - scheduled, sent_s))


def answer_text(body: Any, completions: bool = False) -> str | None:
    """The answer's text in a 200's body, None where it carries none: ``text`` (/v1/generate,
    plain Serve), or ``choices[0].text`` for an OpenAI completion (``completions``)."""
    if completions:
        try:
            body = body["choices"][0]
        except (TypeError, KeyError, IndexError):
            return None
    text = body.get("text") if isinstance(body, dict) else None
    return text if isinstance(text, str) else None


def _judge(r: LeanResponse, completions: bool = False) -> tuple[int, str]:
    """(status, code): a 200 counts only with a body that carries text (``answer_text``);
    errors by their stable code."""
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status == 200:
        return (200, "OK") if answer_text(body, completions) is not None else (0, "malformed_200")
    try:
        return r.status, str(body["error"]["code"])
    except (TypeError, KeyError):
        return r.status, f"HTTP_{r.status}"


LADDER_RUNGS = 20  # rungs at most on the ladder (each probed at most twice)


async def measure_capacity(
    probe: Callable[[float, float, int], Awaitable[float]],
    guess: float,
    probe_s: float,
    confirm_s: float,
    settle: Callable[[], Any],
    drain: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> tuple[float, list[tuple[float, float, float]]]:
    """Highest rate with >= 90 % good: ``probe(rate, seconds, index)`` -> the good fraction.

    1. An ascending ladder (x1.12 per rung) of ``probe_s`` probes from ``guess / 2`` to the
       first rung that keeps < 90 % twice in a row (a rung that misses is probed once more:
       this host's speed moves 10-30 % within minutes, and one probe on a slow minute
       stopped a stack's ladder at a rate it then held at 2 C; every stack gets the second
       try). Ascending, so that no probe starts in the wake of an overloaded one (Ballast's
       level steps down one per stable window; waiting for it between probes would take
       minutes).
    2. The last rung that passed is offered again for ``confirm_s`` (a phase's length),
       from a settled stack; if it keeps < 90 % there, the rung below, and so on down to
       the ladder's first rung (a stack with an unbounded queue passes short probes far
       above what it sustains: plain Serve passed 22.6 req/s over 8 s and kept 0.52 of
       18.0 over 20 s, on a slow day; three rungs down was not enough). A short
       probe reads above what the stack sustains: it starts on an empty stack whose wait
       line absorbs a second of the excess (measured: 63.4 req/s kept 0.93 over 8 s, and
       0.861 over a 20 s phase at the same rate minutes later, the host as fast).

    Returns C and every probe as (rate, seconds, good fraction). C is within 12 % below
    the highest rate a ``confirm_s`` probe would pass. ``drain`` waits between probes
    (a probe's stragglers) and ``settle`` before the first and each confirmation.
    """
    probes: list[tuple[float, float, float]] = []
    rate, passed, missed = guess / 2.0, 0.0, False
    await settle()
    for i in range(2 * LADDER_RUNGS):
        frac = await probe(rate, probe_s, i)
        probes.append((rate, probe_s, frac))
        ok = frac >= 0.9
        if not ok and missed:
            break
        if ok:
            passed, rate = rate, rate * 1.12
        missed = not ok
        await drain(1.0)  # the last probe's stragglers
    if not passed:
        raise CapacityNotFound(f"even {probes[0][0]:.1f} req/s misses the SLO: {probes}", probes)
    floor, step = probes[0][0], 0
    while passed >= floor * (1.0 - 1e-9):
        await settle()
        frac = await probe(passed, confirm_s, 2 * LADDER_RUNGS + step)  # a seed of its own
        probes.append((passed, confirm_s, frac))
        if frac >= 0.9:
            return passed, probes
        passed, step = passed / 1.12, step + 1
    raise CapacityNotFound(f"no rung kept 90 % over {confirm_s:g} s: {probes}", probes)


class CapacityNotFound(RuntimeError):
    """No rate kept 90 % within the SLO; ``lowest``: the ladder's first rung (req/s), the
    rate the stack's phases are then offered multiples of (its row says so)."""

    def __init__(self, message: str, probes: list[tuple[float, float, float]]) -> None:
        super().__init__(message)
        self.probes = probes
        self.lowest = probes[0][0]


async def closed_loop_rate(stack: Stack, concurrency: int, duration_s: float) -> float:
    """Completions per second with ``concurrency`` callers: the starting guess for C."""
    done = 0
    stop = time.monotonic() + duration_s

    # No X-Request-Timeout-Ms here: every answer counts, however slow.
    headers = {k: v for k, v in stack.headers.items() if k.lower() != "x-request-timeout-ms"}

    async def worker(client: LeanClient) -> None:
        nonlocal done
        while time.monotonic() < stop:
            r = await client.post_json(stack.path, stack.body("critical"), headers)
            done += _judge(r, stack.completions)[0] == 200

    async with _client(stack, concurrency) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        return done / (time.monotonic() - t0)


async def timed_machine(
    speed: SpeedProbeProcess, work: Callable[[], Awaitable[Any]], drain_s: float
) -> tuple[Any, float]:
    """``work``'s result and the machine's speed around it (rows/s, before and after,
    averaged), the second timing ``drain_s`` after it so its stragglers are done."""
    before = await asyncio.to_thread(speed.rows_per_second)
    out = await work()
    await asyncio.sleep(drain_s)
    return out, (before + await asyncio.to_thread(speed.rows_per_second)) / 2


async def find_capacity(
    stack: Stack,
    mix: dict[str, float],
    slo_s: float,
    probe_s: float,
    confirm_s: float,
    seed: int,
    settle: Callable[[], Any],
    speed: SpeedProbeProcess,
    name: str | None = None,
) -> tuple[float, float]:
    """``stack``'s capacity C and the machine's speed while it was measured (rows/s):
    a warm-up, a closed-loop guess, then ``measure_capacity`` with ``mix`` (probe ``i``
    seeded ``seed + i``); printed with every probe, under ``name`` (default: the stack's)."""
    name = name or stack.name
    await closed_loop_rate(stack, 4, 3.0)  # warm-up
    guess = await closed_loop_rate(stack, 8, 6.0)

    async def good_fraction(rate: float, seconds: float, i: int) -> float:
        return (await offer(stack, rate, seconds, slo_s, mix, seed + i)).good_fraction()

    try:
        (cap, probes), machine_rps = await timed_machine(
            speed, lambda: measure_capacity(good_fraction, guess, probe_s, confirm_s, settle), 1.0
        )
    except CapacityNotFound as err:
        raise CapacityNotFound(f"{name}: {err}", err.probes) from None
    print(
        f"{name}: closed-loop {guess:.1f} req/s; probes "
        + ", ".join(f"{r:.1f}/s" + (f" for {t:g} s" if t != probe_s else "") + f"->{f:.2f}" for r, t, f in probes)
        + f"; C = {cap:.1f} req/s; machine {machine_rps:.1f} rows/s",
        flush=True,
    )
    return cap, machine_rps


def one_model(doc: dict[str, Any]) -> dict[str, Any]:
    """A one-model stack's ``/v1/status`` (every stack here serves one) as that model's view:
    its level, gate and breakers at this router, the controller's state under ``controller``
    (``ballast.ops.status_text.model_view``)."""
    return model_view(doc, sole_model(doc))


async def sample_status(
    url: str,
    headers: dict[str, str],
    into: list[dict[str, Any]],
    view: Callable[[dict[str, Any]], dict[str, Any]] = lambda doc: doc,
) -> None:
    """Ballast's ``/v1/status`` at ``url`` every 0.5 s into ``into`` (as ``view`` gives it: the
    whole document by default), each with ``_t`` (seconds since the first); a failed read is
    skipped. Runs until cancelled."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            try:
                r = await c.get(url, headers=headers)
                into.append({**view(r.json()), "_t": time.perf_counter() - t0})
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)


def refusal_cpu_ms(phases: list[Phase]) -> list[float | None]:
    """Server CPU per refusal, per phase, in ms: the phase's CPU less what the processes
    use idle and what its answers cost (at the first phase's CPU per answer, where
    nearly nothing is refused), over its refusals. None where a phase refused too little
    to divide by, or CPU was not read."""

    def busy_s(p: Phase) -> float:
        return max(0.0, (p.server_cpu_s or 0.0) - p.idle_cores * p.duration_s)

    first = phases[0] if phases else None
    if first is None or first.server_cpu_s is None or not first.answered():
        return [None] * len(phases)
    per_answer = busy_s(first) / first.answered()
    out: list[float | None] = []
    for p in phases:
        if p.server_cpu_s is None or p.refused() < 20:
            out.append(None)
            continue
        out.append(max(0.0, busy_s(p) - per_answer * p.answered()) / p.refused() * 1000.0)
    return out


def bounded_queue(capacity_rps: float, slo_s: float, factor: float) -> int:
    """Serve's ``max_queued_requests`` for plain Serve "as a careful user would": ``factor``
    x what the replica serves in one SLO (C x SLO; a request queued behind more than that
    cannot be answered in time); at least 1 (Serve takes -1 for unbounded)."""
    return max(1, round(factor * capacity_rps * slo_s))


def plain_serve_app(model_cfg: dict[str, Any], bounded: tuple[int, int] | None = None):
    """The same model and batching as Ballast's replica, as its own ingress.

    ``bounded=None``: Serve's defaults (``max_ongoing_requests`` 5, an unbounded queue).
    ``bounded=(max_ongoing, max_queued)``: as a careful Serve user sets it up: the
    replica takes a whole batch, the queue is bounded and a request beyond it gets
    503 + Retry-After (``BackpressureConfig``).
    """
    from ray import serve
    from ray.serve.config import BackpressureConfig
    from starlette.requests import Request

    from ballast.config import ModelConfig

    m = ModelConfig(**model_cfg)
    options: dict[str, Any] = {"name": "PlainModel"}
    if bounded is not None:
        options.update(
            max_ongoing_requests=bounded[0],
            max_queued_requests=bounded[1],
            backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        )

    @serve.deployment(**options)
    class PlainModel:
        def __init__(self, cfg: dict[str, Any]) -> None:
            from ballast.model.engine import build_engine

            self._m = ModelConfig(**cfg)
            if self._m.cpus:  # the engine's own cores (--engine-cpu own), as Ballast's replica pins itself
                from ballast.model.niceness import pin_to_cores

                pin_to_cores(self._m.cpus)
            self._backend = build_engine(self._m)
            self._backend.warmup()

        @serve.batch(max_batch_size=m.max_batch_size, batch_wait_timeout_s=m.batch_wait_timeout_s)
        async def _batched(self, items: list[tuple[str, int]]) -> list[dict[str, Any]]:
            prompts, maxes = [p for p, _ in items], [n for _, n in items]

            def run() -> list[str]:
                texts = [""] * len(items)
                for chunk in self._backend.generate_chunks(prompts, maxes, self._m.stream_chunk_tokens):
                    texts = [t + c for t, c in zip(texts, chunk)]
                return texts

            texts = await asyncio.to_thread(run)
            return [{"text": t, "tokens_generated": n} for t, n in zip(texts, maxes)]

        async def __call__(self, request: Request) -> dict[str, Any]:
            body = await request.json()
            return await self._batched((str(body["prompt"]), int(body["max_tokens"])))

    return PlainModel.bind(model_cfg)


class ServerCpu:
    """CPU time (user + system) of the processes that answer or refuse before the model:
    Serve's proxy actors, Ballast's router replicas or ray.serve.llm's OpenAI ingress
    replicas, and the stack's HAProxy (found by its per-port config directory). Read with
    psutil; a process gone since ``pids`` were taken counts what it had used when last read."""

    def __init__(self, haproxy_dir: str | None) -> None:
        self.haproxy_dir = haproxy_dir  # the stack's HAProxy config directory; None: no HAProxy
        self.pids: dict[int, str] = {}
        self._last: dict[int, float] = {}

    def find(self) -> dict[str, int]:
        """Look the processes up again (after a deploy); how many of each kind."""
        import psutil
        import ray

        pids: dict[int, str] = {}
        for a in ray.util.list_named_actors(all_namespaces=True):
            name = a["name"]
            role = (
                "proxy"
                if name.startswith("SERVE_PROXY_ACTOR")
                else "router"
                if f"#{ROUTER_DEPLOYMENT}#" in name
                else "ingress"
                if f"#{LLM_INGRESS_DEPLOYMENT}#" in name
                else None
            )
            if role is None:
                continue
            try:
                handle = ray.get_actor(name, namespace=a["namespace"])
                pids[ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=10)] = role
            except Exception:  # noqa: BLE001 - an actor going away between list and call
                continue
        for p in psutil.process_iter(["name", "cmdline"]) if self.haproxy_dir else ():
            if p.info["name"] == "haproxy" and any(self.haproxy_dir in c for c in p.info["cmdline"] or ()):
                pids[p.pid] = "haproxy"
        self.pids = pids
        return dict(Counter(pids.values()))

    def total_s(self) -> float:
        import psutil

        for pid in self.pids:
            try:
                t = psutil.Process(pid).cpu_times()
                self._last[pid] = t.user + t.system
            except psutil.Error:
                pass
        return sum(self._last.get(pid, 0.0) for pid in self.pids)


def format_trace(phase: Phase) -> str:
    """``Phase.per_second`` as lines. Where Ballast's status was sampled: the level, the
    gate's limit, ceiling (the model's slots or the rows its engine runs usefully, this
    router's share) and rows curve's knee (vLLM), waiters and mean service at the second's
    last sample, the generator's longest send lag in the second (``lag``, ms), critical_plus'
    p90 wait in the gate's line (``cp wait``, ms, its last 64 admitted), and, since the
    previous line, the limit's decreases by signal (missed/slow/wait, and slow ones undone) and the gate's
    refusals by reason (only those that happened)."""
    lines = [
        f"    {'s':>3} {'sent':>5} {'good':>5} {'crit':>9}  {'lvl':>3} {'limit':>5} {'ceil':>4} {'knee':>4} "
        f"{'wait':>4} {'svc ms':>6} {'lag':>4} {'cp wait':>7}  "
        "critical misses | limit decreases | gate refusals"
    ]
    prev: dict[str, Any] = next((t["gate"] for t in phase.trace if t.get("gate")), {})  # counts before the phase
    for row in phase.per_second():
        st = row.get("status") or {}
        gate = st.get("gate") or {}
        misses = " ".join(f"{k}:{v}" for k, v in sorted(row["crit_miss"].items()))
        dec = _delta(_cuts(gate), _cuts(prev))
        ref = _delta(gate.get("refused") or {}, prev.get("refused") or {})
        if gate:
            prev = gate
        lines.append(
            f"    {row['s']:>3} {row['sent']:>5} {row['good']:>5} {row['crit_good']:>4}/{row['crit']:<4}  "
            f"{st.get('level', '-'):>3} {gate.get('limit', '-'):>5} {_or_dash(gate.get('ceiling')):>4} "
            f"{_or_dash((gate.get('rows_curve') or {}).get('rows')):>4} "
            f"{gate.get('waiting', '-'):>4} "
            f"{gate.get('expected_service_ms', '-'):>6} {row.get('lag_ms', 0.0):>4.0f} "
            f"{_or_dash((gate.get('wait_p90_ms') or {}).get('critical_plus')):>7}  "
            f"{misses} | {dec} | {ref}".rstrip(" |")
        )
    return "\n".join(lines)


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def _cuts(gate: dict[str, Any]) -> dict[str, int]:
    """The limit's decreases by signal, and the slow ones undone (they made service no faster)."""
    return {**(gate.get("decreases_by") or {}), "undone": int(gate.get("slow_cuts_undone") or 0)}


def _delta(now: dict[str, int], before: dict[str, int]) -> str:
    return " ".join(f"{k}:{v - before.get(k, 0)}" for k, v in now.items() if v - before.get(k, 0) > 0)


def reason_kind(reason: str | None) -> str | None:
    """A level reason without its numbers: "up 2->3: error_rate=0.11>=0.1 (n=211)" -> "up 2->3: error_rate"."""
    if reason is None:
        return None
    return reason.split("=")[0].split(" for ")[0]


def bench_config(path: str, model_replicas: int = 1, cpus: list[int] | None = None) -> Any:
    """The config at ``path`` plus a quota-free tenant, with a fixed number of model replicas.

    Fixed, like plain Serve's one replica: capacity is then one number to compare, and
    no replica starts or stops mid-phase (on two cores a replica loading its model takes
    the CPU the other one is serving with). Autoscaling is measured elsewhere. ``cpus``:
    the model's cores (``model.cpus``: its replica pins itself there), None: the config's.
    """
    from ballast.config import load_config

    data = bench_data(path, model_replicas)
    if cpus is not None:
        data.setdefault("model", {})["cpus"] = list(cpus)
    return load_config(data)


def bench_data(path: str, model_replicas: int) -> dict[str, Any]:
    """The config file's mapping with ``bench_config``'s changes, before it is validated."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    data.setdefault("tenants", {})["bench"] = {
        "description": "overload benchmark: no token quota, criticality as sent",
        "max_concurrent": 100000,
        "max_criticality": "critical_plus",  # granted in writing: the default cap is critical
    }
    data.setdefault("auth", {}).setdefault("demo_keys", {})[BENCH_KEY] = "bench"
    model = data.setdefault("deployments", {}).setdefault("model", {})
    model.update(min_replicas=model_replicas, max_replicas=model_replicas, initial_replicas=model_replicas)
    data.setdefault("http", {})["port"] = PORT  # HAProxy's files and ports follow it: beside `make serve`
    return data


def bench_vllm_config(
    path: str, model_dir: str, model_replicas: int = 1, prefix_affinity: bool = True, cpus: list[int] | None = None
) -> Any:
    """``bench_config`` with the primary model ``model_dir`` served by vLLM: the engine
    settings both vLLM stacks run with (``vllm_engine_kwargs``, for the config's
    ``max_batch_size`` rows), and a watchdog memory limit that fits the replica, vLLM's
    engine core and its worker together (one built-in process is what the file sizes it for).
    ``cpus``: the model replica's cores (``model.cpus``), and so its engine's, which it starts."""
    from ballast.config import load_config, with_model_dir

    data = with_model_dir(bench_data(path, model_replicas), model_dir, "vllm")
    data["model"].setdefault("routing", {})["prefix_affinity"] = prefix_affinity
    if cpus is not None:
        data["model"]["cpus"] = list(cpus)
    data.setdefault("watchdog", {})["rss_limit_mb"] = VLLM_RSS_LIMIT_MB
    m = load_config(data).model
    data["model"]["engine_kwargs"] = vllm_engine_kwargs(str(m.path), m.max_batch_size)
    return load_config(data)


def vllm_engine_kwargs(model_dir: str, rows: int) -> dict[str, Any]:
    """vLLM's settings for both vLLM stacks: ``VLLM_ENGINE_KWARGS`` with room for ``rows``
    requests and, on CPU, a KV cache for ``rows`` full contexts, as Ballast's replica sizes
    it (``default_engine_kwargs``; ``VLLM_CPU_KVCACHE_SPACE``, where set, sizes it instead)."""
    from ballast.model.vllm_engine import default_engine_kwargs

    return default_engine_kwargs(model_dir, dict(VLLM_ENGINE_KWARGS), rows)


def llm_serve_app(
    model_id: str, model_dir: str, engine_kwargs: dict[str, Any], bounded: tuple[int, int] | None = None
) -> Any:
    """Plain ``ray.serve.llm``: its OpenAI app on one vLLM engine for ``model_dir``.

    ``bounded=None``: its defaults (ingress and LLM server take any number of requests,
    queues unbounded). ``bounded=(max_ongoing, max_queued)``: the ingress, where the HTTP
    proxy hands requests over, holds at most ``max_ongoing`` and queues at most
    ``max_queued``, 503 + Retry-After beyond (``BackpressureConfig``); a bound on the LLM
    server alone would refuse inside the ingress, which answers that as an error.
    """
    from ray.serve.config import BackpressureConfig
    from ray.serve.llm import LLMConfig, build_openai_app

    llm_config = LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_dir},
        accelerator_type=None,
        engine_kwargs=dict(engine_kwargs),
        placement_group_config={"bundles": [{"CPU": 1}]},
    )
    builder: dict[str, Any] = {"llm_configs": [llm_config]}
    if bounded is not None:
        builder["ingress_deployment_config"] = {
            "max_ongoing_requests": bounded[0],
            "max_queued_requests": bounded[1],
            "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=1),
        }
    return build_openai_app(builder)


def machine_ratio(result: dict[str, Any], phase: Phase) -> str:
    """The host's speed around ``phase`` over its speed while C was measured, as a table
    cell; the phase's own rows/s where C was given, "-" where it was not timed."""
    if phase.machine_rps is None:
        return "-"
    at_c = result.get("machine_at_c")
    return f"{phase.machine_rps / at_c:.2f}" if at_c else f"{phase.machine_rps:.0f}/s"


def machine_adjusted(result: dict[str, Any]) -> list[float | None]:
    """Each phase's goodput over C scaled to the host's speed around the phase: what
    goodput / C would read had the machine run as fast as while C was measured.
    Printed beside the targets, never instead of them (the probe times the model
    alone; it says how much the host drifted, not how the stack shares it)."""
    at_c = result.get("machine_at_c")
    return [
        p.goodput() / (result["C"] * p.machine_rps / at_c) if at_c and p.machine_rps else None for p in result["phases"]
    ]


GOODPUT_TARGET = 0.95  # issue 47: the guard costs at most 5 % of what the stack serves
C_SHARE_TARGET = 0.95  # Ballast on vLLM's C over plain ray.serve.llm's on the same engine
LATENCY_RATIO_TARGET = 1.1  # Ballast on vLLM's p50 and p99 over ray.serve.llm's, the same rate
CRITICAL_PLUS_TARGET = 0.999
FEASIBLE_TARGET = 0.9
REFUSAL_CPU_TARGET_MS = 0.2
DEADLINE_SLACK_MS = 100.0


def check_targets(
    result: dict[str, Any], multiples: tuple[float, ...], mix: dict[str, float], peer: dict[str, Any] | None = None
) -> list[tuple[str, bool, str]]:
    """The overload targets (issue 21) for one stack's run: (target, met, figures)."""
    phases = result["phases"]
    out = [_goodput_target(result, multiples), _critical_plus_target(result, multiples, mix)]
    out.append(_nominal_target(result, multiples))
    worst: list[str] = []
    met = True
    for k, p in zip(multiples, phases):
        feasible = feasible_shares(mix, k)
        for c in CRITICALITIES[1:]:
            share = share_of_feasible(p.good_fraction(c), feasible[c])
            if share is not None and share < FEASIBLE_TARGET:
                met = False
                worst.append(f"{k:g}C {c}:{share:.3f}")
    out.append((f"every other class >= {FEASIBLE_TARGET} of its feasible share", met, " ".join(worst) or "all met"))
    costs = [(k, c) for k, c in zip(multiples, refusal_cpu_ms(phases)) if c is not None]
    out.append(
        (
            f"a refusal <= {REFUSAL_CPU_TARGET_MS} ms of server CPU",
            bool(costs) and all(c <= REFUSAL_CPU_TARGET_MS for _, c in costs),
            " ".join(f"{k:g}C:{c:.2f}ms" for k, c in costs) or "no phase refused enough to tell",
        )
    )
    late = [(k, p.answer_p99_ms()) for k, p in zip(multiples, phases)]
    out.append(
        (
            f"every answer within its deadline + {DEADLINE_SLACK_MS:g} ms at p99",
            all(ms <= p.slo_s * 1000.0 + DEADLINE_SLACK_MS for (_, ms), p in zip(late, phases)),
            " ".join(f"{k:g}C:{ms:.0f}ms" for k, ms in late),
        )
    )
    if peer is not None:
        out.append(_ahead_target(result, peer, multiples, "plain Serve with a bounded queue"))
    return out


def check_vllm_targets(
    result: dict[str, Any],
    multiples: tuple[float, ...],
    mix: dict[str, float],
    llm: dict[str, Any] | None = None,
    llm_bounded: dict[str, Any] | None = None,
) -> list[tuple[str, bool, str]]:
    """The targets for Ballast on vLLM (issue 47): goodput >= 0.95 C at every multiple,
    critical_plus where its demand fits, nothing refused and level 0 at 1 C; against plain
    ``ray.serve.llm`` (``llm``, where it ran) C >= 0.95 x its C, p50 and p99 within 1.1x of
    its own at its 1 C (Ballast offered the same rate: ``at_llm_c``), and ahead of it and of
    the bounded one in answers within the SLO per second at every multiple."""
    out = [
        _goodput_target(result, multiples),
        _critical_plus_target(result, multiples, mix),
        _nominal_target(result, multiples),
    ]
    if llm is not None:
        share = result["C"] / llm["C"] if llm["C"] else float("nan")
        out.append(
            (
                f"C >= {C_SHARE_TARGET} x plain ray.serve.llm's",
                share >= C_SHARE_TARGET,
                f"{result['C']:.1f} / {llm['C']:.1f} req/s = {share:.3f}",
            )
        )
        out.append(_latency_target(result, llm, multiples))
        out.append(_ahead_target(result, llm, multiples, "plain ray.serve.llm"))
    if llm_bounded is not None:
        out.append(_ahead_target(result, llm_bounded, multiples, "ray.serve.llm, bounded"))
    return out


def _nominal_target(result: dict[str, Any], multiples: tuple[float, ...]) -> tuple[str, bool, str]:
    """At 1 C (where the run has it): no request refused and the level 0 in every sample."""
    what = "nothing refused and level 0 at 1 C"
    if 1.0 not in multiples:
        return what, True, "no 1 C phase"
    p = result["phases"][multiples.index(1.0)]
    levels = sorted({int(t["level"]) for t in p.trace if "level" in t})
    return what, p.refused() == 0 and max(levels, default=0) == 0, f"{p.refused()} refused, levels {levels or '-'}"


def _latency_target(result: dict[str, Any], llm: dict[str, Any], multiples: tuple[float, ...]) -> tuple[str, bool, str]:
    """Ballast at ray.serve.llm's C (``at_llm_c``, the same requests at the same rate) against
    ray.serve.llm at its 1 C: the p50 and p99 of the 200s, each within 1.1x."""
    what = f"p50 and p99 within {LATENCY_RATIO_TARGET}x of plain ray.serve.llm's at its 1 C"
    ours: Phase | None = result.get("at_llm_c")
    if ours is None or 1.0 not in multiples:
        return what, False, "not measured (no phase at ray.serve.llm's C)"
    theirs = llm["phases"][multiples.index(1.0)]
    r50 = ours.admitted_p50_ms() / theirs.admitted_p50_ms()
    r99 = ours.admitted_p99_ms() / theirs.admitted_p99_ms()
    return (
        what,
        r50 <= LATENCY_RATIO_TARGET and r99 <= LATENCY_RATIO_TARGET,
        f"at {theirs.rate:.1f} req/s: p50 {ours.admitted_p50_ms():.0f} / {theirs.admitted_p50_ms():.0f} ms = "
        f"{r50:.2f}, p99 {ours.admitted_p99_ms():.0f} / {theirs.admitted_p99_ms():.0f} ms = {r99:.2f}",
    )


def _goodput_target(result: dict[str, Any], multiples: tuple[float, ...]) -> tuple[str, bool, str]:
    goodputs = [p.goodput() / result["C"] for p in result["phases"]]
    return (
        f"goodput >= {GOODPUT_TARGET} C at every multiple",
        all(g >= GOODPUT_TARGET for g in goodputs),
        " ".join(f"{k:g}C:{g:.3f}" for k, g in zip(multiples, goodputs)),
    )


def _critical_plus_target(
    result: dict[str, Any], multiples: tuple[float, ...], mix: dict[str, float]
) -> tuple[str, bool, str]:
    cp = [
        (k, p.good_fraction("critical_plus"))
        for k, p in zip(multiples, result["phases"])
        if mix["critical_plus"] * k <= 1.0
    ]
    return (
        f"critical_plus >= {CRITICAL_PLUS_TARGET} where its demand fits in C",
        all(f >= CRITICAL_PLUS_TARGET for _, f in cp),
        " ".join(f"{k:g}C:{f:.4f}" for k, f in cp),
    )


def _ahead_target(
    result: dict[str, Any], peer: dict[str, Any], multiples: tuple[float, ...], peer_name: str
) -> tuple[str, bool, str]:
    """Ahead of ``peer`` in requests a second answered within the SLO at the same multiple of
    each stack's own C (the offered rate is the higher one wherever C is), not on goodput / C:
    a bounded queue's C probe stops where Poisson bursts overflow its small queue (>= 10 %
    503s), below the rate it serves once the queue is always full, so its ratio passes
    1.2-1.4 past 1 C and would reward a C probed short. The ratios are printed beside."""
    cap = result["C"]
    ahead = [
        (k, p.goodput() / cap, q.goodput() / peer["C"], p.goodput(), q.goodput())
        for k, p, q in zip(multiples, result["phases"], peer["phases"])
    ]
    return (
        f"ahead of {peer_name} at every multiple (answers within the SLO per second)",
        all(x > y for _, _, _, x, y in ahead),
        " ".join(f"{k:g}C:{x:.1f}/{y:.1f} req/s (goodput/C {a:.3f}/{b:.3f})" for k, a, b, x, y in ahead),
    )


@dataclass(frozen=True)
class _Settings:
    """The command line, read and checked: the flags as given, the lists parsed."""

    args: argparse.Namespace
    multiples: tuple[float, ...]
    queue_factors: tuple[float, ...]
    ongoing_options: tuple[int, ...]
    mix: dict[str, float] = field(default_factory=lambda: DEFAULT_MIX)

    @property
    def names(self) -> list[str]:
        """The stacks to run, in order."""
        args = self.args
        if args.only:
            only = args.only.split(",")
            return [n for n in STACK_NAMES if n in only]
        return (
            ["plain", "plain-bounded", "ballast"]
            + (["ballast+sdk"] if args.sdk else [])
            + ([] if args.no_vllm else list(VLLM_STACKS))
        )

    @property
    def vllm(self) -> bool:
        """Whether a vLLM stack runs (their model directory and engine settings are needed)."""
        return any(n in VLLM_STACKS for n in self.names)


def session_of(name: str) -> str:
    """The session (one Ray each, ``SESSIONS``) a stack runs in."""
    if name.startswith("plain"):
        return "plain"
    if name.startswith("llm"):
        return "llm"
    return "ballast-vllm" if name == "ballast-vllm" else "ballast"


def sessions(names: list[str]) -> list[tuple[str, list[str]]]:
    """``names`` grouped by session, the sessions in run order, those with no stack left out."""
    grouped = [(s, [n for n in names if session_of(n) == s]) for s in SESSIONS]
    return [(s, members) for s, members in grouped if members]


def is_ballast(name: str) -> bool:
    """A Ballast stack: it has a level to settle to 0 and a /v1/status to sample."""
    return session_of(name) in BALLAST_SESSIONS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="cluster/local.yaml")
    parser.add_argument("--slo-s", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--probe-s",
        type=float,
        default=8.0,
        help="length of each capacity probe on the ladder (the last passing rung is confirmed over --phase-s)",
    )
    parser.add_argument("--phase-s", type=float, default=20.0, help="length of each phase (1/2/4/10 C by default)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated stacks to run (in the usual order), of: " + ", ".join(STACK_NAMES),
    )
    parser.add_argument(
        "--no-vllm", action="store_true", help="leave out the vLLM stacks (llm, llm-bounded, ballast-vllm)"
    )
    parser.add_argument(
        "--vllm-model",
        default="models/demo",
        help="the vLLM stacks' Hugging Face directory (make demo-model writes models/demo)",
    )
    parser.add_argument(
        "--llm-queue-factor",
        type=float,
        default=0.25,
        help="llm-bounded: max_queued_requests as a factor of C x SLO (bounded_queue), fixed",
    )
    parser.add_argument(
        "--queue-factors",
        default="0.1,0.25,0.5",
        help="plain-bounded: max_queued_requests tried at 4 C, as factors of C x SLO "
        "(bounded_queue); the best pair with --ongoing is kept for its phases",
    )
    parser.add_argument(
        "--ongoing", default="8,16,32", help="plain-bounded: max_ongoing_requests tried at 4 C with each queue bound"
    )
    parser.add_argument(
        "--sdk", action="store_true", help="also run the Ballast rows through the SDK (its httpx shares the cores)"
    )
    parser.add_argument(
        "--capacity",
        type=float,
        default=None,
        help="take C as given (req/s) instead of measuring it: for quick re-runs of the phases",
    )
    parser.add_argument(
        "--multiples",
        default=",".join(f"{k:g}" for k in MULTIPLES),
        help="the phases, as multiples of C (comma-separated, ascending), e.g. 2,4 for a quick re-run",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print each phase second by second: sent, good, critical misses by code, level and gate",
    )
    parser.add_argument(
        "--model-replicas", type=int, default=1, help="Ballast's model replicas, fixed (plain Serve has 1)"
    )
    parser.add_argument(
        "--no-prefix-affinity",
        action="store_true",
        help="Ballast on vLLM routes by load alone (model.routing.prefix_affinity: false)",
    )
    parser.add_argument(
        "--engine-cpu",
        choices=ENGINE_CPU,
        default="shared",
        help="own: every stack's engine on a core of its own, away from the generator and the front "
        "(loadtest.engine_cores); shared: where the kernel puts it",
    )
    parser.add_argument(
        "--slow-host",
        type=int,
        default=0,
        help="a deliberately slowed host: this many busy processes, each pinned to one core, for the whole run "
        "(loadtest.slow_host); the machine column shows the speed the host had",
    )
    return parser


def _comma_list(
    parser: argparse.ArgumentParser,
    flag: str,
    raw: str,
    cast: Callable[[str], Any],
    kind: str,
    valid: Callable[[tuple[Any, ...]], bool],
    need: str,
) -> tuple[Any, ...]:
    """``raw`` split on commas and cast; a usage error naming ``flag`` where it is not ``valid``."""
    try:
        values = tuple(cast(v) for v in raw.split(","))
    except ValueError:
        parser.error(f"{flag}: not a comma-separated list of {kind}: {raw!r}")
    if not values or not valid(values):
        parser.error(f"{flag}: need {need}, got {raw!r}")
    return values


def parse_settings(argv: list[str] | None = None) -> _Settings:
    """The command line, checked before anything starts (Ray, the speed probe)."""
    parser = _parser()
    args = parser.parse_args(argv)
    multiples = _comma_list(
        parser,
        "--multiples",
        args.multiples,
        float,
        "numbers",
        lambda ks: all(k > 0 for k in ks) and list(ks) == sorted(ks),
        "positive multiples in ascending order",
    )
    queue_factors = _comma_list(
        parser,
        "--queue-factors",
        args.queue_factors,
        float,
        "numbers",
        lambda fs: all(f > 0 for f in fs),
        "positive factors",
    )
    ongoing_options = _comma_list(
        parser, "--ongoing", args.ongoing, int, "integers", lambda ns: all(n >= 1 for n in ns), "positive integers"
    )
    unknown = [n for n in (args.only or "").split(",") if args.only and n not in STACK_NAMES]
    if unknown:
        parser.error(f"--only: {', '.join(map(repr, unknown))} is no stack; choose from {', '.join(STACK_NAMES)}")
    if not args.llm_queue_factor > 0:
        parser.error(f"--llm-queue-factor: need a positive factor, got {args.llm_queue_factor!r}")
    if args.slow_host:
        from loadtest.slow_host import cores_for

        try:
            cores_for(args.slow_host)
        except ValueError as e:
            parser.error(str(e))
    settings = _Settings(args, multiples, queue_factors, ongoing_options)
    if settings.vllm and not os.path.isfile(os.path.join(args.vllm_model, "config.json")):
        parser.error(f"--vllm-model: no config.json in {args.vllm_model!r} (make demo-model writes models/demo)")
    return settings


PROMPT = "The quick brown fox jumps over the lazy dog"


def completion_body(model: str, max_tokens: int, crit: str) -> dict[str, Any]:
    """A ``/v1/completions`` request as the vLLM stacks get it: greedy and to ``max_tokens``
    (``ignore_eos``, vLLM's extension, which Ballast passes on), so that every answer is the
    same work whichever stack serves it; ``criticality`` is Ballast's (vLLM ignores it)."""
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "criticality": crit,
    }


def _stacks(cfg: Any, args: argparse.Namespace, model: str | None = None) -> dict[str, Stack]:
    """The stacks under test, each sending the same requests (the SDK's through its client);
    the vLLM stacks (``model``: the name they serve their directory as) theirs to /v1/completions."""
    timeout_header = {"X-Request-Timeout-Ms": str(int(args.slo_s * 1000))}
    prefix = f"{BASE}{cfg.route_prefix.rstrip('/')}"
    key = {"Authorization": f"Bearer {BENCH_KEY}"}

    def body(crit: str) -> dict[str, Any]:
        return {"prompt": PROMPT, "max_tokens": args.max_tokens, "criticality": crit}

    def completion(crit: str) -> dict[str, Any]:
        return completion_body(model or "", args.max_tokens, crit)

    def sdk_client() -> Any:
        from ballast.client import AsyncBallastClient, ClientConfig

        return AsyncBallastClient(
            ClientConfig(
                base_url=prefix,
                api_key=BENCH_KEY,
                max_attempts=1,
                request_timeout_ms=int(args.slo_s * 1000),
                connect_timeout_s=CLIENT_TIMEOUT_S,
                read_timeout_s=CLIENT_TIMEOUT_S,
            )
        )

    return {
        "plain": Stack("plain", f"{BASE}/plain", dict(timeout_header), body),
        "plain-bounded": Stack("plain-bounded", f"{BASE}/plain-bounded", dict(timeout_header), body),
        "ballast": Stack("ballast", f"{prefix}/v1/generate", {**key, **timeout_header}, body, class_header=True),
        "ballast+sdk": Stack("ballast+sdk", f"{prefix}/v1/generate", {}, body, sdk=sdk_client),
        "llm": Stack("llm", f"{BASE}/llm/v1/completions", dict(timeout_header), completion),
        "llm-bounded": Stack("llm-bounded", f"{BASE}/llm-bounded/v1/completions", dict(timeout_header), completion),
        "ballast-vllm": Stack(
            "ballast-vllm", f"{prefix}/v1/completions", {**key, **timeout_header}, completion, class_header=True
        ),
    }


class _Bench:
    """One run of the benchmark: the stacks, the speed probe, the server's CPU and the results.

    ``run_sessions`` starts one Ray per session and, in it, takes each stack through the
    module docstring's steps (``_one_stack``): its capacity C, its idle CPU, then each
    multiple of C offered and printed as it ends. ``results`` holds, per stack, C, its
    phases, the queue bound it was given (plain-bounded, llm-bounded) and the machine's
    speed at C.
    """

    def __init__(self, s: _Settings, core: int | None = None) -> None:
        from ballast.router.ingress import ingress_env

        self.s, self.args, self.mix = s, s.args, s.mix
        # ``core``: the engine's own core (loadtest.engine_cores): the built-in model's
        # replicas, Ballast's and plain Serve's alike, pin themselves there (model.cpus).
        cpus = [core] if core is not None else None
        self.cfg = cfg = bench_config(self.args.config, self.args.model_replicas, cpus)
        self.speed = SpeedProbeProcess(cfg.model.architecture.model_dump(), cfg.model.seed)
        # Ballast on vLLM; its model, name and engine settings are the llm stacks' too.
        self.vllm_cfg = (
            bench_vllm_config(
                self.args.config,
                self.args.vllm_model,
                self.args.model_replicas,
                not self.args.no_prefix_affinity,
                cpus,
            )
            if s.vllm
            else None
        )
        self.stacks = _stacks(cfg, self.args, self.vllm_cfg.model.name if self.vllm_cfg else None)
        if self.vllm_cfg is not None:
            m = self.vllm_cfg.model
            print(f"vLLM stacks: {m.path} as {m.name!r}, engine {m.engine_kwargs}", flush=True)
        self.model_cfg = cfg.model.model_dump(mode="json")
        self.max_ongoing = cfg.deployments.model.max_ongoing_requests  # Ballast's replica's (C is measured with it)
        haproxy_cfg = ingress_env(cfg).get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC")
        self.cpu = ServerCpu(os.path.dirname(haproxy_cfg) if haproxy_cfg else None)
        self.roles = stack_cpu.StackCpu()
        self.admin = {"Authorization": f"Bearer {cfg.auth.demo_admin_token}"}
        self.status_url = f"{BASE}{cfg.route_prefix.rstrip('/')}/v1/status"
        self.results: dict[str, dict[str, Any]] = {}
        self.machine_at_c: dict[str, float] = {}  # each stack's machine speed while its C was measured
        self.unmeasured: dict[str, str] = {}  # stack: why its C, or its whole row, is not what it says

    # -- sessions: one Ray per stack kind ------------------------------------------------------
    def run_sessions(self) -> None:
        """One Ray per stack kind, because the ingress is chosen when Ray starts: plain Ray Serve
        and plain ray.serve.llm with Serve's defaults (the Python proxy actor), Ballast with its
        configured ingress (ballast.router.ingress), on the built-in model then on vLLM. The
        SDK rows use the same Ballast server as the plain HTTP rows."""
        try:
            for session, members in sessions(self.s.names):
                try:
                    self._session(session, members)
                except Exception as err:  # the other sessions still run, and the report prints
                    for name in members:
                        if name not in self.results:
                            self.unmeasured[name] = f"not measured: {type(err).__name__}: {err}"
                    print(f"session {session} failed: {type(err).__name__}: {err}", flush=True)
        finally:
            self.speed.close()

    def _session(self, session: str, members: list[str]) -> None:
        import ray
        from ray import serve

        from ballast.ops.app import shutdown

        self._session_env(session)
        # ray.serve.llm's ingress is scheduled beside its engine's placement group: logical CPUs.
        cpus = {"num_cpus": LLM_NUM_CPUS} if session == "llm" else {}
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False, **cpus)
        try:
            self._start_session(session, members)
            install_uvloop()
            asyncio.run(self.run(members))
        finally:
            try:
                if session in BALLAST_SESSIONS:
                    shutdown(self._ballast_cfg(session))
                else:
                    serve.shutdown()
            finally:
                ray.shutdown()

    def _start_session(self, session: str, members: list[str]) -> None:
        """Ballast's app, or Serve with the session's first app (a bounded one deploys itself)."""
        from ray import serve

        from ballast.ops.app import start

        if session in BALLAST_SESSIONS:
            start(self._ballast_cfg(session), "127.0.0.1", PORT)
            return
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        if session == "plain" and "plain" in members:
            self.swap_plain_app(None)
        elif session == "llm" and "llm" in members:
            self.swap_llm_app(None)

    def _ballast_cfg(self, session: str) -> Any:
        return self.vllm_cfg if session == "ballast-vllm" else self.cfg

    def _session_env(self, session: str) -> None:
        from ballast.router.ingress import FAST_PATH_ENV, WORKER_NICENESS_ENV, ingress_env

        if session in ("plain", "llm"):  # Serve's defaults: its proxy actor, no fast path
            for key in (*FAST_PATH_ENV, *ingress_env(self.cfg)):  # nothing of a Ballast session before
                os.environ.pop(key, None)
            os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
            # Ray's workers at the normal CPU priority as in Ballast's session (Ray's own
            # default is nice 15, behind this generator): priority is not what is compared.
            os.environ.update(WORKER_NICENESS_ENV)
        else:
            os.environ.update(ingress_env(self._ballast_cfg(session)))

    # -- per stack: capacity, idle CPU, the multiples --------------------------------------------
    async def run(self, members: list[str]) -> None:
        for name in members:
            await self._one_stack(name)

    async def _one_stack(self, name: str) -> None:
        stack = self.stacks[name]
        settle = self._settler(name)
        cap, queue = await self._stack_capacity(stack, settle)
        idle_cores = await self._idle_cores(name, settle)
        phases = await self._offer_multiples(stack, cap, idle_cores, settle)
        self.results[name] = {"C": cap, "phases": phases, "queue": queue, "machine_at_c": self.machine_at_c.get(name)}
        if name == "ballast-vllm" and "llm" in self.results:
            # The same requests at the same rate as ray.serve.llm's 1 C: latency side by side.
            await settle()
            llm_c = self.results["llm"]["C"]
            at = self.results[name]["at_llm_c"] = await self._phase(stack, llm_c, None)
            print(
                f"  {name} at llm's C ({llm_c:.1f} req/s): 200s p50 {at.admitted_p50_ms():.0f} ms, "
                f"p99 {at.admitted_p99_ms():.0f} ms",
                flush=True,
            )

    async def _stack_capacity(self, stack: Stack, settle: Callable[[], Any]) -> tuple[float, dict[str, Any] | None]:
        """C as given, as Ballast's (the SDK rows), or measured; plain-bounded's and
        llm-bounded's queue bound with it."""
        name = stack.name
        if self.args.capacity is not None:
            cap = self.args.capacity
            print(f"{name}: C = {cap:.1f} req/s, as given (--capacity)", flush=True)
        elif stack.sdk is not None and "ballast" in self.results:
            cap = self.results["ballast"]["C"]  # the same server: its capacity, measured above
            print(f"{name}: the same Ballast stack through the SDK; C = {cap:.1f} req/s", flush=True)
        elif name == "llm-bounded" and "llm" in self.results:
            cap = self.results["llm"]["C"]  # the same engine with no bound: the provisional C
            print(f"{name}: provisional C = {cap:.1f} req/s, llm's", flush=True)
        else:
            # The bounded stacks: a provisional C with a queue that bounds nothing below C.
            if name == "plain-bounded":
                await asyncio.to_thread(self.swap_plain_app, 100_000)
            elif name == "llm-bounded":
                await asyncio.to_thread(self.swap_llm_app, 100_000)
            cap = await self.capacity(stack, settle)
        queue = None
        if name in ("plain-bounded", "llm-bounded"):
            # Its bound (plain-bounded: the best at 4 x the provisional C), then its C again
            # with that bound: each stack is measured against its own C, as it is configured.
            if name == "plain-bounded":
                queue = await self.choose_queue(stack, cap, settle)
            else:
                queue = await asyncio.to_thread(self.bound_llm_app, cap)
            if self.args.capacity is None:
                cap = await self.capacity(stack, settle)
        return cap, queue

    async def _idle_cores(self, name: str, settle: Callable[[], Any]) -> float:
        """What the processes in front of the model use with no traffic, per second."""
        found = self.cpu.find()
        await settle()
        idle0 = self.cpu.total_s()
        await asyncio.sleep(IDLE_S)
        idle_cores = (self.cpu.total_s() - idle0) / IDLE_S
        print(f"  {name}: server CPU read from {found}; {idle_cores:.3f} cores with no traffic", flush=True)
        return idle_cores

    async def _offer_multiples(
        self, stack: Stack, cap: float, idle_cores: float, settle: Callable[[], Any]
    ) -> list[Phase]:
        """Each multiple of C, from a settled stack, through one SDK client for all of them."""
        phases = []
        sdk = stack.sdk() if stack.sdk is not None else None
        try:
            for k in self.s.multiples:
                if k == self.s.multiples[0]:
                    await settle()
                phase = await self._phase(stack, k * cap, sdk)
                phase.idle_cores = idle_cores
                phases.append(phase)
                self._print_phase(stack.name, k, cap, phase)
        finally:
            if sdk is not None:
                await sdk.aclose()
        return phases

    async def _phase(self, stack: Stack, rate: float, sdk: Any) -> Phase:
        """One phase at ``rate``, with its server and client CPU, the machine's speed around it
        and (Ballast) its /v1/status sampled."""
        args = self.args
        trace: list[dict[str, Any]] = []
        sampler = asyncio.create_task(self.sample_status(trace)) if is_ballast(stack.name) else None

        async def one_phase() -> Phase:
            cpu0, client0, roles0 = self.cpu.total_s(), time.process_time(), self.roles.read()
            p = await offer(stack, rate, args.phase_s, args.slo_s, self.mix, args.seed + 100, sdk)
            p.server_cpu_s, p.client_cpu_s = self.cpu.total_s() - cpu0, time.process_time() - client0
            p.stack_cpu = stack_cpu.delta(self.roles.read(), roles0)
            return p

        phase, machine_rps = await self.timed_machine(one_phase, 2.0)
        phase.machine_rps = machine_rps
        if sampler is not None:
            sampler.cancel()
        phase.trace = trace
        return phase

    def _print_phase(self, name: str, k: float, cap: float, phase: Phase) -> None:
        """A phase as it ends: goodput / C and codes per class; Ballast's levels, gate and breakers."""
        by_crit = {c: dict(Counter(o.code for o in phase.outcomes if o.criticality == c)) for c in self.mix}
        print(
            f"  {name} {k:g} C: goodput/C {phase.goodput() / cap:.3f} {by_crit}; "
            f"send lag p99 {phase.send_lag_p99_ms():.0f} ms",
            flush=True,
        )
        trace = phase.trace
        if trace:
            levels = Counter(t["level"] for t in trace)
            limits = [t["gate"]["limit"] for t in trace if t.get("gate")]
            print(
                f"    levels {dict(sorted(levels.items()))}; "
                f"gate limit {min(limits, default=0)}..{max(limits, default=0)}; "
                f"last gate {trace[-1].get('gate')}",
                flush=True,
            )
            reasons = Counter(reason_kind((t.get("controller") or {}).get("reason")) for t in trace)
            breakers = Counter(
                f"{role}:{b.get('state')}" for t in trace for role, b in (t.get("breakers") or {}).items()
            )
            print(f"    level reasons {dict(reasons)}; breakers {dict(breakers)}", flush=True)
        if self.args.trace:
            print(format_trace(phase), flush=True)

    # -- capacity and plain-bounded's queue ------------------------------------------------------
    async def capacity(self, stack: Stack, settle: Callable[[], Any]) -> float:
        """C as ``find_capacity`` measures it; where no rate keeps 90 % within the SLO, the
        ladder's first rung, the stack marked (``unmeasured``) and the run going on."""
        args = self.args
        probe = self.stacks["ballast"] if stack.sdk is not None else stack  # capacity is the server's
        try:
            cap, self.machine_at_c[stack.name] = await find_capacity(
                probe, self.mix, args.slo_s, args.probe_s, args.phase_s, args.seed, settle, self.speed, name=stack.name
            )
        except CapacityNotFound as err:
            self.unmeasured[stack.name] = (
                f"C not found ({err}); its phases are offered multiples of the lowest rung, {err.lowest:.1f} req/s"
            )
            print(f"{stack.name}: {self.unmeasured[stack.name]}", flush=True)
            return err.lowest
        return cap

    def swap_plain_app(self, queue: int | None, ongoing: int | None = None) -> None:
        """The plain Serve app under test: Serve's defaults (None) or bounded at ``queue``
        (``ongoing`` defaults to Ballast's replica's ``max_ongoing_requests``)."""
        from ray import serve

        if queue is None:
            serve.run(plain_serve_app(self.model_cfg), name="plain", route_prefix="/plain", blocking=False)
            return
        if "plain" in serve.status().applications:
            serve.delete("plain")  # one model replica at a time: they would share the cores
        bounded = (self.max_ongoing if ongoing is None else ongoing, queue)
        serve.run(
            plain_serve_app(self.model_cfg, bounded=bounded),
            name="plain-bounded",
            route_prefix="/plain-bounded",
            blocking=False,
        )

    def swap_llm_app(self, queue: int | None) -> None:
        """The ray.serve.llm app under test: its defaults (None, deployed as "llm") or, as
        "llm-bounded", its ingress bounded at the engine's ``max_num_seqs`` in flight and
        ``queue`` queued. The other app goes first: one engine at a time (two would share
        the cores). Returns once the engine answers (Serve's app RUNNING)."""
        from ray import serve

        for old in ("llm", "llm-bounded"):
            if old in serve.status().applications:
                serve.delete(old)
        m = self.vllm_cfg.model
        name, bounded = ("llm", None) if queue is None else ("llm-bounded", (self.llm_ongoing, queue))
        t0 = time.monotonic()
        serve.run(
            llm_serve_app(m.name, str(m.path), m.engine_kwargs, bounded),
            name=name,
            route_prefix=f"/{name}",
            blocking=False,
        )
        print(
            f"  {name}: ray.serve.llm on vLLM ready in {time.monotonic() - t0:.0f} s"
            + (f" (max_ongoing_requests {bounded[0]}, max_queued_requests {bounded[1]})" if bounded else ""),
            flush=True,
        )

    @property
    def llm_ongoing(self) -> int:
        """llm-bounded's ``max_ongoing_requests``: the rows the engine runs at once."""
        return int(self.vllm_cfg.model.engine_kwargs["max_num_seqs"])

    def bound_llm_app(self, cap: float) -> dict[str, Any]:
        """llm-bounded at its fixed bound: ``--llm-queue-factor`` x ``cap`` x SLO queued."""
        factor = self.args.llm_queue_factor
        q = bounded_queue(cap, self.args.slo_s, factor)
        self.swap_llm_app(q)
        return {"max_ongoing_requests": self.llm_ongoing, "max_queued_requests": q, "factor": factor}

    async def choose_queue(self, stack: Stack, cap: float, settle: Callable[[], Any]) -> dict[str, Any]:
        """The (max_ongoing_requests, max_queued_requests) that give plain Serve its best
        goodput at 4 C: each pair of ``ongoing_options`` x ``queue_factors`` tried for a
        half-length phase; the best stays deployed."""
        args = self.args
        tried = []
        for ongoing in self.s.ongoing_options:
            for f in self.s.queue_factors:
                q = bounded_queue(cap, args.slo_s, f)
                await asyncio.to_thread(self.swap_plain_app, q, ongoing)
                await settle()
                phase = await offer(stack, 4 * cap, args.phase_s / 2, args.slo_s, self.mix, args.seed + 50)
                tried.append((phase.goodput() / cap, ongoing, q))
                print(
                    f"  plain-bounded at 4 C, max_ongoing_requests {ongoing}, max_queued_requests {q} "
                    f"({f:g} x C x SLO): goodput/C {tried[-1][0]:.3f}",
                    flush=True,
                )
        best = max(tried)
        await asyncio.to_thread(self.swap_plain_app, best[2], best[1])
        return {"max_ongoing_requests": best[1], "max_queued_requests": best[2], "tried": tried}

    # -- Ballast's status, settling and the machine's speed --------------------------------------
    async def level(self) -> int:
        async with httpx.AsyncClient(timeout=5) as c:
            r = await c.get(self.status_url, headers=self.admin)
            return int(one_model(r.json())["level"])

    async def sample_status(self, into: list[dict[str, Any]]) -> None:
        await sample_status(self.status_url, self.admin, into, one_model)

    def _settler(self, name: str) -> Callable[[], Any]:
        async def settle() -> None:
            # Each probe and phase starts from a quiet stack: backlog drained, Ballast at level 0.
            await asyncio.sleep(2.0)
            if is_ballast(name):
                stop = time.monotonic() + 180.0
                while time.monotonic() < stop and await self.level() != 0:
                    await asyncio.sleep(1.0)

        return settle

    async def timed_machine(self, work: Callable[[], Awaitable[Any]], drain_s: float) -> tuple[Any, float]:
        return await timed_machine(self.speed, work, drain_s)


# -- the report: each section a function of the results, printed in order --------------------------
def _print_settings(results: dict[str, dict[str, Any]], s: _Settings) -> None:
    args, mix = s.args, s.mix
    print(
        f"\noverload: SLO {args.slo_s:g} s, max_tokens {args.max_tokens}, {args.phase_s:g} s per phase, "
        f"mix " + "/".join(f"{c} {mix[c]:.0%}" for c in CRITICALITIES)
    )


def _print_results(results: dict[str, dict[str, Any]], s: _Settings) -> None:
    """One row per stack and multiple: goodput / C, success by class, latency and CPU."""
    head = (
        f"{'stack':<13} {'C req/s':>8} {'offered':>8} {'goodput/C':>9} "
        + " ".join(f"{c[:10]:>10}" for c in CRITICALITIES)
        + f" {'adm p99 ms':>10} {'ans p99 ms':>10} {'lag p99 ms':>10} {'cli cores':>9} {'srv cores':>9} "
        f"{'ms/refusal':>10} {'at edge':>7} {'machine':>7}"
    )
    print(head)
    for name, r in results.items():
        costs = refusal_cpu_ms(r["phases"])
        for k, phase, cost in zip(s.multiples, r["phases"], costs):
            cores = "-" if phase.server_cpu_s is None else f"{phase.server_cpu_s / phase.duration_s:.2f}"
            client = "-" if phase.client_cpu_s is None else f"{phase.client_cpu_s / phase.duration_s:.2f}"
            print(
                f"{name:<13} {r['C']:>8.1f} {k:>7g}C {phase.goodput() / r['C']:>9.3f} "
                + " ".join(f"{phase.good_fraction(c):>10.3f}" for c in CRITICALITIES)
                + f" {phase.admitted_p99_ms():>10.0f} {phase.answer_p99_ms():>10.0f} {phase.send_lag_p99_ms():>10.0f} "
                f"{client:>9} {cores:>9} "
                + f"{'-' if cost is None else format(cost, '.2f'):>10} "
                + f"{'-' if not phase.refused() else format(phase.edge_refused / phase.refused(), '.2f'):>7} "
                + f"{machine_ratio(r, phase):>7}"
            )
    print(
        "adm p99: of the 200s; ans p99: of every answer (200, 429/503, 504), each request's deadline being the SLO; "
        "cli cores: the load generator's CPU per second (it shares the host); srv cores: CPU of the processes "
        "in front of the model (proxy, routers or ray.serve.llm's ingress, HAProxy) per second of the phase; "
        "ms/refusal: their CPU less their idle use and the answers' (at the first phase's cost each), over the "
        "429/503 refusals; at edge: the share of those HAProxy answered (Ballast's edge); machine: the host's speed "
        "around the phase over its speed while C was measured (loadtest.machine_speed: the replica's batch "
        "in a process of its own; rows/s where C was given)"
    )


def _print_feasible(results: dict[str, dict[str, Any]], s: _Settings) -> None:
    """Each class's success over what strict class order allows it (``feasible_shares``)."""
    print("\nshare of the feasible (what strict class order allows each class; - where it allows nothing)")
    print(f"{'stack':<13} {'offered':>8} " + " ".join(f"{c[:10]:>10}" for c in CRITICALITIES))
    for name, r in results.items():
        for k, phase in zip(s.multiples, r["phases"]):
            feasible = feasible_shares(s.mix, k)
            cells = []
            for c in CRITICALITIES:
                share = share_of_feasible(phase.good_fraction(c), feasible[c])
                cells.append(f"{'-' if share is None else format(share, '.3f'):>10}")
            print(f"{name:<13} {k:>7g}C " + " ".join(cells))


def _print_bounded(results: dict[str, dict[str, Any]], s: _Settings) -> None:
    """The queue bound plain-bounded ran with, and every pair it was chosen from; llm-bounded's."""
    bounded = results.get("plain-bounded")
    if bounded is not None and bounded.get("queue"):
        q = bounded["queue"]
        print(
            f"\nplain-bounded: max_ongoing_requests {q['max_ongoing_requests']}, max_queued_requests "
            f"{q['max_queued_requests']}: the best goodput/C at 4 C of (ongoing, queued) "
            + ", ".join(f"({n}, {qq}) -> {g:.3f}" for g, n, qq in q["tried"])
        )
    llm = results.get("llm-bounded")
    if llm is not None and llm.get("queue"):
        q = llm["queue"]
        print(
            f"\nllm-bounded: the ingress's max_ongoing_requests {q['max_ongoing_requests']} (the engine's "
            f"max_num_seqs), max_queued_requests {q['max_queued_requests']} ({q['factor']:g} x C x SLO, fixed)"
        )


def _print_cost(results: dict[str, dict[str, Any]], s: _Settings) -> None:
    """What an answer costs on the path and beside it (``loadtest.stack_cpu``): the
    latency of the 200s, each role's CPU per answer and in cores, and how long its threads
    waited for a core (seconds a second: on a host short of cores, who is slowed)."""
    roles = stack_cpu.ROLES
    print("\ncost of an answer: latency of the 200s (ms), then each role's CPU per answer (ms) and in cores")
    print(f"{'stack':<13} {'offered':>8} {'adm p50':>8} {'adm p99':>8}  " + " ".join(f"{r:>8}" for r in roles))
    for name, r in results.items():
        for k, phase in zip(s.multiples, r["phases"]):
            if not phase.stack_cpu:
                continue
            answered = max(1, phase.answered())
            per = " ".join(f"{phase.stack_cpu.get(role, 0.0) * 1000.0 / answered:>8.2f}" for role in roles)
            cores = " ".join(f"{phase.stack_cpu.get(role, 0.0) / phase.duration_s:>8.2f}" for role in roles)
            waits = " ".join(
                f"{phase.stack_cpu.get(stack_cpu.wait_key(role), 0.0) / phase.duration_s:>8.2f}" for role in roles
            )
            print(f"{name:<13} {k:>7g}C {phase.admitted_p50_ms():>8.0f} {phase.admitted_p99_ms():>8.0f}  {per}")
            print(f"{'':<13} {'cores':>8} {'':>8} {'':>8}  {cores}")
            print(f"{'':<13} {'waiting':>8} {'':>8} {'':>8}  {waits}")
            if name in VLLM_STACKS and not phase.stack_cpu.get("engine"):  # seen once, cause not found
                print(f"{'':<13} {'':>8} vLLM's processes (VLLM::*) were not found: its engine cells are not measured")
    print(
        "roles: edge HAProxy; proxy Serve's proxies; router Ballast's routers or ray.serve.llm's ingress; front the "
        "model replica around the engine (the built-in engine's forward pass too); engine vLLM's engine core and "
        "worker; guards Ballast's watchdogs and controller; serve Serve's controller; ray Ray's daemons. "
        "waiting: the seconds a second the role's threads were runnable and waited for a core"
    )


def _print_targets(results: dict[str, dict[str, Any]], s: _Settings) -> None:
    """Ballast's targets (``check_targets``), against plain-bounded where it ran; on vLLM
    (``check_vllm_targets``) against llm; and goodput / C at the host's speed while C was
    measured (not a target)."""
    bounded = results.get("plain-bounded")
    for name in ("ballast", "ballast+sdk"):
        if name not in results:
            continue
        print(f"\n{name}: targets")
        for what, ok, detail in check_targets(results[name], s.multiples, s.mix, bounded):
            print(f"  [{'ok' if ok else 'MISSED'}] {what}: {detail}")
        _print_adjusted(results[name], s)
    if "ballast-vllm" in results:
        print("\nballast-vllm: targets")
        checks = check_vllm_targets(
            results["ballast-vllm"], s.multiples, s.mix, results.get("llm"), results.get("llm-bounded")
        )
        for what, ok, detail in checks:
            print(f"  [{'ok' if ok else 'MISSED'}] {what}: {detail}")
        _print_adjusted(results["ballast-vllm"], s)


def _print_adjusted(result: dict[str, Any], s: _Settings) -> None:
    adjusted = machine_adjusted(result)
    if any(a is not None for a in adjusted):
        print(
            "  (not a target) goodput / C at the speed the host had while C was measured: "
            + " ".join(f"{k:g}C:{a:.3f}" for k, a in zip(s.multiples, adjusted) if a is not None)
        )


REPORT = (_print_settings, _print_results, _print_feasible, _print_bounded, _print_cost, _print_targets)


def report(results: dict[str, dict[str, Any]], s: _Settings, unmeasured: dict[str, str]) -> int:
    """Every section of ``REPORT`` over the stacks that ran, then each stack whose C was not
    found or whose session failed, and why; 1 when there is one (after everything printed)."""
    for section in REPORT:
        section(results, s)
    if unmeasured:
        print("\nnot as measured (the table's C for these is not a capacity):")
        for name, why in unmeasured.items():
            print(f"  {name}: {why}")
    return 1 if unmeasured else 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line; per stack, measure C, offer the multiples and collect the
    phases (``_Bench``); then print the report and Ballast's targets (``report``)."""
    from loadtest.slow_host import slowed

    settings = parse_settings(argv)
    with slowed(settings.args.slow_host), engine_cpu(settings.args.engine_cpu) as where:
        print(where.words, flush=True)
        bench = _Bench(settings, where.core)
        bench.run_sessions()
    return report(bench.results, settings, bench.unmeasured)


if __name__ == "__main__":
    raise SystemExit(main())
