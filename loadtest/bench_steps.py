"""Flash crowds: a step from 1 C to 10 C and back, with no settling between (``make bench-steps``).

A real crowd does not ramp through 2 C and 4 C first: it arrives in one second (a launch, a
retry storm, a batch job pointed at the wrong endpoint), and the traffic that must never
fail arrives with it. Per stack (``--only``: ``ballast`` on the built-in engine,
``ballast-vllm`` on vLLM, each a Ray of its own as in ``loadtest.bench_overload``):

1. its capacity C, measured as the overload bench measures it (a ladder of probes, the
   last passing rung confirmed over a phase's length), or given (``--capacity``);
2. from a settled stack (level 0), one open-loop run through ``--steps`` (default
   1,10,1,4,1: multiples of C), ``--step-s`` seconds each, back to back: the send times
   are evenly spaced within each step (``send_times``), with the overload bench's mix and
   requests (the SLO as each request's deadline), and ``/v1/status`` sampled every 0.5 s.

Printed per stack (``step_figures``): critical_plus's share answered within the SLO over
the whole run; the requests refused (429/503) among those sent in the 1 C steps; for each
step, second by second from 2 s before it to 5 s after, what was sent, refused, and
critical_plus sent and missed, with Ballast's level; for each step up, the time from the
step to the first refusal sent after it, and for each step down the time from the step to
the first status sample at level 0. The run ends with one line per stack a script reads::

    steps <engine>: critical_plus=<x> refused_1c=<n> first_refusal_s=<x> level0_after_s=<x>

(``<engine>``: builtin or vllm; ``first_refusal_s`` the slowest step up's, ``level0_after_s``
the slowest step down's; ``nan`` where none came.) ``--engine-cpu own`` (the default)
gives the engine a core of its own, away from the generator and the front
(``loadtest.engine_cores``), for every stack alike; ``shared`` leaves it to the kernel.
Loopback only; bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from loadtest.bench_overload import (
    _Bench,
    _parser,
    offer,
    parse_settings,
    reason_kind,
)
from loadtest.engine_cores import engine_cpu

STEPS = (1.0, 10.0, 1.0, 4.0, 1.0)
STEP_STACKS = ("ballast", "ballast-vllm")
ENGINE_OF = {"ballast": "builtin", "ballast-vllm": "vllm"}
REFUSED = (429, 503)
AROUND_S = (-2, 5)  # the seconds printed around each step


def send_times(rates: list[float], step_s: float) -> list[float]:
    """Send times (seconds from the start) of ``rates[i]`` requests per second for ``step_s``
    each, back to back, evenly spaced within each step."""
    out: list[float] = []
    for i, rate in enumerate(rates):
        n = max(1, round(rate * step_s))
        out += [i * step_s + j * step_s / n for j in range(n)]
    return out


@dataclass
class StepRow:
    """One second around a step: what was sent in it and how it ended."""

    s: int  # seconds from the step (negative: before it)
    sent: int = 0
    refused: int = 0
    plus_sent: int = 0
    plus_missed: int = 0
    plus_codes: dict[str, int] = field(default_factory=dict)  # critical_plus's misses: code, or LATE (a late 200)
    level: int | None = None  # the last status sample in that second
    reason: str | None = None  # ... and the controller's reason, its kind (queue_wait_p95_ms, demand_now, ...)


@dataclass
class Step:
    """A step from ``before`` to ``after`` (multiples of C) at ``at_s``, its seconds, and
    the time to its first refusal (up) or back to level 0 (down); None: none came."""

    at_s: float
    before: float
    after: float
    rows: list[StepRow] = field(default_factory=list)
    first_refusal_s: float | None = None
    level0_after_s: float | None = None


@dataclass
class StepFigures:
    critical_plus: float
    refused_1c: int
    steps: list[Step]
    # The 1 C steps' refusals by the second they were sent in (from the start), where any.
    refused_1c_at: dict[int, int] = field(default_factory=dict)
    moves: list[str] = field(default_factory=list)  # level_moves

    def slowest(self, attr: str) -> float:
        values = [getattr(s, attr) for s in self.steps if getattr(s, attr) is not None]
        return max(values) if values else math.nan

    def final_line(self, engine: str) -> str:
        return (
            f"steps {engine}: critical_plus={self.critical_plus:.4f} refused_1c={self.refused_1c} "
            f"first_refusal_s={self.slowest('first_refusal_s'):.2f} "
            f"level0_after_s={self.slowest('level0_after_s'):.2f}"
        )


def step_figures(phase: Any, multiples: list[float], step_s: float, trace: list[dict[str, Any]]) -> StepFigures:
    """The run's figures (the module docstring) from its outcomes (each with ``sent_s``,
    ``status``, ``criticality``, ``latency_s``) and its status samples (``_t``, ``level``)."""

    def segment(t: float) -> int:
        return min(int(t // step_s), len(multiples) - 1)

    outcomes = phase.outcomes
    at_1c = [o for o in outcomes if o.status in REFUSED and multiples[segment(o.sent_s)] == 1.0]
    refused_at: dict[int, int] = {}
    for o in at_1c:
        refused_at[int(o.sent_s)] = refused_at.get(int(o.sent_s), 0) + 1
    steps = []
    for j in range(1, len(multiples)):
        at = j * step_s
        step = Step(at, multiples[j - 1], multiples[j])
        rows = {s: StepRow(s) for s in range(AROUND_S[0], AROUND_S[1] + 1)}
        for o in outcomes:
            s = math.floor(o.sent_s - at)
            row = rows.get(s)
            if row is None:
                continue
            row.sent += 1
            row.refused += o.status in REFUSED
            if o.criticality == "critical_plus":
                row.plus_sent += 1
                if not (o.status == 200 and o.latency_s <= phase.slo_s):
                    row.plus_missed += 1
                    code = "LATE" if o.status == 200 else o.code
                    row.plus_codes[code] = row.plus_codes.get(code, 0) + 1
        for t in trace:
            row = rows.get(math.floor(float(t["_t"]) - at))
            if row is not None and "level" in t:
                row.level = int(t["level"])
                row.reason = reason_kind((t.get("controller") or {}).get("reason"))
        step.rows = list(rows.values())
        end = at + step_s
        if step.after > step.before:
            first = min((o.sent_s for o in outcomes if o.status in REFUSED and at <= o.sent_s < end), default=None)
            step.first_refusal_s = None if first is None else first - at
        else:
            zero = min(
                (float(t["_t"]) for t in trace if at <= float(t["_t"]) < end and t.get("level") == 0), default=None
            )
            step.level0_after_s = None if zero is None else zero - at
        steps.append(step)
    return StepFigures(
        phase.good_fraction("critical_plus"), len(at_1c), steps, dict(sorted(refused_at.items())), level_moves(trace)
    )


#: The controller's inputs a level move is read with (LoadSignals' names).
MOVE_INPUTS = ("queue_wait_p95_ms", "queue_length", "kv_util_pct", "error_rate", "capacity_rps")


def level_moves(trace: list[dict[str, Any]]) -> list[str]:
    """Each status sample whose level differs from the last one's: when, to what, the
    controller's whole reason and the inputs it read (what moved it, when the per-second
    table shows only the last reason of a second)."""
    out, last = [], 0
    for t in trace:
        level = t.get("level")
        if level is None or level == last:
            continue
        ctl = t.get("controller") or {}
        inputs = ctl.get("inputs") or {}
        shown = {k: inputs[k] for k in MOVE_INPUTS if inputs.get(k) is not None}
        demand = inputs.get("demand_sustained_rps") or {}
        if demand:
            shown["demand_sustained"] = round(sum(demand.values()), 1)
        out.append(f"{float(t['_t']):7.2f} s: {last} -> {level}: {ctl.get('reason')} {shown}")
        last = level
    return out


def print_steps(name: str, cap: float, figures: StepFigures) -> None:
    print(
        f"\n{name}: C {cap:.1f} req/s; critical_plus within the SLO {figures.critical_plus:.4f}; "
        f"refused in the 1 C steps {figures.refused_1c}"
        + (f" (by second sent: {figures.refused_1c_at})" if figures.refused_1c_at else ""),
        flush=True,
    )
    if figures.moves:
        print("  level moves (status sample time from the run's start):")
        for line in figures.moves:
            print("    " + line)
    for step in figures.steps:
        what = (
            f"first refusal {step.first_refusal_s:.2f} s after"
            if step.first_refusal_s is not None
            else (f"level 0 {step.level0_after_s:.2f} s after" if step.level0_after_s is not None else "")
        )
        print(f"  step {step.before:g} C -> {step.after:g} C at {step.at_s:g} s; {what or 'none came'}")
        print(f"    {'s':>3} {'sent':>5} {'refused':>7} {'cp sent':>7} {'cp missed':>9} {'level':>5}  why")
        for r in step.rows:
            why = " ".join(filter(None, [r.reason, str(r.plus_codes) if r.plus_codes else None]))
            print(
                f"    {r.s:>3} {r.sent:>5} {r.refused:>7} {r.plus_sent:>7} {r.plus_missed:>9} "
                f"{'-' if r.level is None else r.level:>5}  {why}"
            )


class StepBench(_Bench):
    """The overload bench's sessions, with one step run per stack in place of its multiples."""

    def __init__(self, settings: Any, steps: list[float], step_s: float, core: int | None) -> None:
        super().__init__(settings, core)
        self.steps, self.step_s = steps, step_s
        self.figures: dict[str, tuple[float, StepFigures]] = {}

    async def _one_stack(self, name: str) -> None:
        stack = self.stacks[name]
        settle = self._settler(name)
        cap, _ = await self._stack_capacity(stack, settle)
        await settle()
        rates = [k * cap for k in self.steps]
        times = send_times(rates, self.step_s)
        total = self.step_s * len(rates)
        trace: list[dict[str, Any]] = []
        sampler = asyncio.create_task(self.sample_status(trace))
        try:
            phase = await offer(
                stack, len(times) / total, total, self.args.slo_s, self.mix, self.args.seed + 100, times=times
            )
        finally:
            sampler.cancel()
        figures = step_figures(phase, self.steps, self.step_s, trace)
        self.figures[name] = (cap, figures)
        self.results[name] = {"C": cap, "phases": [phase], "queue": None}
        print_steps(name, cap, figures)


def _steps_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("--steps", default=",".join(f"{k:g}" for k in STEPS), help="multiples of C, back to back")
    p.add_argument("--step-s", type=float, default=20.0, help="seconds each step lasts")
    return p


def parse_steps(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This bench's own flags, and the rest for the overload bench's parser."""
    p = _steps_parser()
    own, rest = p.parse_known_args(argv)
    try:
        own.steps = [float(k) for k in own.steps.split(",")]
    except ValueError:
        p.error(f"--steps: not a comma-separated list of numbers: {own.steps!r}")
    if len(own.steps) < 2 or any(not 0 < k <= 50 for k in own.steps):
        p.error("--steps: at least two multiples, each in (0, 50]")
    if not 1.0 <= own.step_s <= 600.0:
        p.error("--step-s: 1-600")
    return own, rest


def main(argv: list[str] | None = None) -> int:
    own, rest = parse_steps(argv)
    if not any(a == "--only" or a.startswith("--only=") for a in rest):
        rest = [*rest, "--only", ",".join(STEP_STACKS)]
    if not any(a == "--engine-cpu" or a.startswith("--engine-cpu=") for a in rest):
        rest = [*rest, "--engine-cpu", "own"]  # this bench's default: the engine on a core of its own
    settings = parse_settings(rest)
    unknown = [n for n in settings.names if n not in STEP_STACKS]
    if unknown:
        _parser().error(f"--only: the step scenario runs {', '.join(STEP_STACKS)}, not {', '.join(unknown)}")
    with engine_cpu(settings.args.engine_cpu) as where:
        print(where.words, flush=True)
        bench = StepBench(settings, own.steps, own.step_s, where.core)
        bench.run_sessions()
    for why in bench.unmeasured.values():
        print(why, flush=True)
    for name in settings.names:
        if name in bench.figures:
            print(bench.figures[name][1].final_line(ENGINE_OF[name]), flush=True)
    return 0 if all(n in bench.figures for n in settings.names) else 1


if __name__ == "__main__":
    raise SystemExit(main())
