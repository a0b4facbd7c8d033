"""Batch on spare capacity: a compressed day of interactive traffic, alone and beside a backlog
of batch lines, in one run.

``python -m loadtest.bench_batch [--day-s 480] [--capacity C] [--smoke]`` (``make bench-batch``)

One Ray, one stack (the config, ``cluster/local.yaml`` by default, with the overload bench's
changes: ``bench_overload.bench_data``, one model replica, port 8124), and the Batch API's
store: an ``EmbeddedRedis`` in a temporary directory, named in ``batch.store_url`` and
``batch.store_password_file``.

1. C: the model's capacity in interactive requests per second, measured as
   ``bench_overload.find_capacity`` does (the highest open-loop rate at which 90 % get a 200
   within ``--slo-s``, with the overload bench's criticality mix and requests), or given
   (``--capacity``). In tokens, C times the completion tokens of an interactive answer.
   The probe runs on a stack of its own, shut down after it; the days run on a fresh one.
   Batch dispatch keeps the rows interactive traffic would hold at its high over the last
   ``batch.reference_s`` (a day) as the level batch may fill the valley to: a probe that
   overloads the stack for minutes would be, in a day compressed into minutes, a large
   part of that window, where in a real day a few minutes of overload are not.
2. Two days, the same day twice: ``DayPlan``, the soak's diurnal profile compressed into
   ``--day-s`` real seconds (``TimeScale``), ``--peak-ratio`` x C at the noon peak (0.9: near
   C, where a stack without batch still refuses almost nothing, so that the refusals' delta
   is batch's doing), 0.07 C in the 03:00 valley. Open loop, the send times of
   ``DayPlan.arrivals`` and the criticality sequence the same both days, to
   ``/v1/completions`` (``--max-tokens``, the overload bench's prompt), without a deadline
   header: a slowdown shows in the latency, not as 504s. First the day **without** the
   backlog, then the day **with** it. Not alternating halves: a day's halves are different
   loads (the valley, the peak), and the backlog must be there from the day's start; the
   baseline goes first so that it runs on a stack that has never run batch work and has no
   lines left over. The host's drift between the days shows in each row's machine speed
   (``loadtest.machine_speed``, timed before and after each day).
3. The backlog, submitted with the official ``openai`` client just before the second day
   starts (``files.create(purpose="batch")``, ``batches.create(endpoint="/v1/completions",
   completion_window="24h")``), by a tenant of its own: ``backlog_lines`` lines, ``--backlog-factor``
   (1.5) times the requests the day's spare capacity holds (the integral of C less the day's
   rate), so the backlog outlasts the day and spare_used measures the scheduler, not the
   backlog's size; the same prompt and ``max_tokens`` as the interactive requests, split
   over ``--batches`` files. Should the backlog run out before the day ends, the run says
   when: spare_used is then capped by the backlog.
4. Each second of a day (``--interval-s``) one poll reads the batches' ``request_counts``
   (``batches.list``) and the model's level (``/v1/status``). ``spare_accounting`` turns the
   polls into ``SpareMeter`` intervals (``ballast.policies.spare``): between two polls the
   spare tokens are C's tokens over the interval less the interactive completion tokens
   whose answers came in it (never below 0), the batch tokens the lines completed in it
   times the output files' mean completion tokens per line. spare_used is their sums'
   ratio. Prompt tokens are in neither: both kinds send the same prompt.
5. After the day: the backlog is drained with no interactive traffic for at most
   ``--drain-s`` (so that most batches complete and every one of their lines must be in a
   file), then the batches still running are cancelled and waited for (``--cancel-wait-s``).
   Their output and error files are read back (``files.content``) and counted against the
   input (``count_lines``): lines_done the lines in the output files, lines_twice a
   custom_id in both files or twice in one, lines_lost an input line in neither. A
   cancelled batch's lines in neither file are cancelled, not lost (OpenAI's files leave
   out the lines a cancelled batch never ran); they are printed apart. A batch that never
   ended counts all its lines lost.

It prints both days in one table (requests, ok, refused, other failures, p50/p99 of the
answers, the generator's send lag, batch lines completed during the day, spare_used,
seconds at a level above 0, the machine's speed), the targets, and ends with one line a
script reads (``BatchLine``; one line, folded here)::

    batch: lines_done=<n> lines_lost=<n> lines_twice=<n> spare_used=<x>
           interactive_p99_ratio=<x> interactive_refused_delta=<n>

Targets on this machine: lines_lost = lines_twice = 0, spare_used >= 0.7, p99 ratio (with
backlog / without) <= 1.2 (on a GPU <= 1.05), refused delta (with - without) <= 0.5 % of the
day's interactive requests. Exit 1 where a line was lost, written twice or stray, or the run failed.
Every answer and poll of both days goes to ``<--out>/days.json`` (``day_record``), to look
at a day second by second.

``--smoke``: a 60 s day, a handful of lines in two batches, C from a short closed-loop run
instead of the ladder, a 60 s drain: the path end to end in about 4 minutes, figures not
meant to meet the targets. Loopback only; bounded in time: every wait has a limit, and the
default run takes about 25 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from openai import APIStatusError, AsyncOpenAI

from ballast.batch.embedded import EmbeddedRedis
from ballast.config import load_config
from ballast.policies.spare import SpareMeter
from ballast.policies.validation import check_int, check_non_negative, check_positive
from loadtest.bench_overload import (
    BASE,
    BENCH_KEY,
    DEFAULT_MIX,
    PROMPT,
    Stack,
    answer_text,
    bench_data,
    closed_loop_rate,
    criticality_sequence,
    find_capacity,
    one_model,
)
from loadtest.bench_router import _pct, local_stack
from loadtest.lean_http import LeanClient, LeanHttpError, LeanResponse, install_uvloop
from loadtest.machine_speed import SpeedProbeProcess
from loadtest.shapes import DAY_S, DEFAULT_DIURNAL, DiurnalProfile, TimeScale

REPO = Path(__file__).resolve().parent.parent
BATCH_TENANT = "bench-batch"  # the backlog's tenant: no token quota, as the interactive one
BATCH_KEY = "bench-key-batch"
DAY_CLIENT_TIMEOUT_S = 40.0  # above the stack's 30 s default deadline: the server answers first
MAX_IN_FLIGHT = 4000  # client-side bound; arrivals beyond it are client drops
ARRIVAL_STEP_S = 0.05  # the day's rate is integrated in steps this long
SETTLE_LIMIT_S = 180.0  # waiting for level 0 before a day
FINAL_INT_KEYS = ("lines_done", "lines_lost", "lines_twice", "interactive_refused_delta")
FINAL_KEYS = (
    "lines_done",
    "lines_lost",
    "lines_twice",
    "spare_used",
    "interactive_p99_ratio",
    "interactive_refused_delta",
)
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


# =========================================================================== the day (pure)


@dataclass(frozen=True)
class DayPlan:
    """A compressed day of interactive open-loop traffic: at real second ``t`` of ``day_s``,
    ``peak_ratio`` x ``capacity_rps`` x the profile's fraction at that simulated time of day
    (midnight at ``t`` = 0). ``peak_ratio`` is at most 1, so the rate never passes C."""

    capacity_rps: float
    day_s: float
    peak_ratio: float = 0.9
    profile: DiurnalProfile = DEFAULT_DIURNAL

    def __post_init__(self) -> None:
        check_positive("capacity_rps", self.capacity_rps)
        check_positive("day_s", self.day_s)
        if not 0 < self.peak_ratio <= 1:
            raise ValueError(f"peak_ratio: must be within (0, 1], got {self.peak_ratio!r}")
        TimeScale(DAY_S / self.day_s)  # checks the scale

    @property
    def time_scale(self) -> TimeScale:
        return TimeScale(DAY_S / self.day_s)

    def rate_at(self, t_s: float) -> float:
        """Requests per second at real second ``t_s`` of the day."""
        check_non_negative("t_s", t_s)
        return self.capacity_rps * self.peak_ratio * self.profile.fraction(self.time_scale.sim_s(t_s))

    def _steps(self, step_s: float) -> Iterable[tuple[float, float, float]]:
        """(start, end, requests expected in it) for each step of the day (trapezoids: the
        profile is linear between its points, so this is exact but where a step holds one)."""
        check_positive("step_s", step_s)
        a, rate_a = 0.0, self.rate_at(0.0)
        for i in range(1, math.ceil(self.day_s / step_s) + 1):
            b = min(self.day_s, i * step_s)
            rate_b = self.rate_at(b)
            yield a, b, (rate_a + rate_b) / 2 * (b - a)
            a, rate_a = b, rate_b

    def expected_requests(self, step_s: float = ARRIVAL_STEP_S) -> float:
        return math.fsum(n for _, _, n in self._steps(step_s))

    def spare_requests(self, step_s: float = ARRIVAL_STEP_S) -> float:
        """The requests C could serve in the day beyond the day's own: C x day - expected."""
        return self.capacity_rps * self.day_s - self.expected_requests(step_s)

    def arrivals(self, step_s: float = ARRIVAL_STEP_S) -> list[float]:
        """Send times (s from the day's start): the k-th (k = 0, 1, ...) where the requests
        expected since the start reach k + 1/2 (linear within a step). Deterministic, so both
        days send the same; in a stretch at rate r they are 1/r apart."""
        out: list[float] = []
        done, target = 0.0, 0.5
        for a, b, n in self._steps(step_s):
            while done + n >= target:
                out.append(a + (b - a) * (target - done) / n)
                target += 1.0
            done += n
        return out


def poll_times(day_s: float, interval_s: float) -> list[float]:
    """When a day is polled (s from its start): every ``interval_s``, the last at its end."""
    check_positive("day_s", day_s)
    check_positive("interval_s", interval_s)
    n = math.ceil(day_s / interval_s - 1e-9)
    return [min(day_s, k * interval_s) for k in range(1, n + 1)]


def backlog_lines(plan: DayPlan, factor: float) -> int:
    """Batch lines for the day: ``factor`` x the requests its spare capacity holds, rounded up."""
    check_positive("factor", factor)
    return math.ceil(factor * plan.spare_requests())


def batch_sizes(total: int, batches: int, max_lines: int) -> list[int]:
    """``total`` lines over ``batches`` files as evenly as can be (the first ones a line more);
    ValueError where a file would pass ``max_lines`` (``batch.max_file_lines``)."""
    check_int("total", total, minimum=1)
    check_int("batches", batches, minimum=1, maximum=total)
    check_int("max_lines", max_lines, minimum=1)
    if math.ceil(total / batches) > max_lines:
        raise ValueError(f"{total} lines over {batches} batches pass {max_lines} lines a file: give more batches")
    q, r = divmod(total, batches)
    return [q + (i < r) for i in range(batches)]


def batch_input(index: int, size: int, model: str, prompt: str, max_tokens: int) -> tuple[list[str], bytes]:
    """Batch ``index``'s input file: ``size`` /v1/completions lines, custom_id ``b<index>-<n>``;
    its custom_ids and its JSONL bytes."""
    ids = [f"b{index}-{i:06d}" for i in range(size)]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    lines = (
        json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}, separators=(",", ":"))
        for cid in ids
    )
    return ids, ("\n".join(lines) + "\n").encode()


# =========================================================================== accounting (pure)


@dataclass(frozen=True)
class Answer:
    """One interactive request: its class, status (0: no HTTP answer), stable code, latency
    from its scheduled send, when its answer came (s from the day's start) and its completion
    tokens (0 unless a 200)."""

    criticality: str
    status: int
    code: str
    latency_s: float
    done_s: float
    tokens: int = 0


@dataclass(frozen=True)
class Poll:
    """One poll during a day: when (s from the day's start), the backlog's lines completed
    and failed so far (request_counts summed; None: the read failed), the model's level."""

    t_s: float
    completed: int | None
    failed: int | None
    level: int | None


def spare_accounting(
    polls: Sequence[Poll], answers: Sequence[Answer], capacity_tokens_per_s: float, tokens_per_line: float
) -> SpareMeter:
    """A ``SpareMeter`` over the day, one interval per poll (from the previous one, the first
    from the day's start): interactive tokens whose answers came in the interval, batch tokens
    of the lines completed in it (``tokens_per_line`` each; rounded on the running total, so
    the sum is exact). A poll whose read failed adds its interval's lines to the next one."""
    check_non_negative("tokens_per_line", tokens_per_line)
    times = iter([0.0, *(p.t_s for p in polls)])
    meter = SpareMeter(clock=lambda: next(times))
    done = sorted((a.done_s, a.tokens) for a in answers if a.tokens)
    i, prev_s, prev_batch = 0, 0.0, 0
    last_completed = 0
    for p in polls:
        if p.t_s < prev_s:
            raise ValueError(f"polls: out of order at {p.t_s}")
        interactive = 0
        while i < len(done) and done[i][0] <= p.t_s:
            interactive += done[i][1]
            i += 1
        if p.completed is not None:
            last_completed = max(last_completed, p.completed)
        batch_total = round(last_completed * tokens_per_line)
        meter.record(capacity_tokens_per_s, interactive, batch_total - prev_batch)
        prev_s, prev_batch = p.t_s, batch_total
    return meter


@dataclass(frozen=True)
class LineCount:
    """A backlog's lines against its output and error files."""

    total: int = 0  # input lines
    done: int = 0  # input lines in an output file
    failed: int = 0  # input lines in an error file only
    lost: int = 0  # input lines in neither, their batch not cancelled (or never ended)
    cancelled: int = 0  # input lines in neither, their batch cancelled
    twice: int = 0  # custom_ids in both files, or twice in one
    stray: int = 0  # file lines whose custom_id is in no input, or that do not parse
    tokens: int = 0  # completion tokens in the output files' usage

    def __add__(self, other: LineCount) -> LineCount:
        return LineCount(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def tokens_per_line(self) -> float:
        return self.tokens / self.done if self.done else 0.0


def _file_ids(text: str) -> tuple[list[str], int, int]:
    """A result file's custom_ids in order, the lines that do not parse, and the completion
    tokens in its lines' ``response.body.usage``."""
    ids: list[str] = []
    bad = tokens = 0
    for raw in text.splitlines():
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            cid = line["custom_id"]
        except (ValueError, TypeError, KeyError):
            bad += 1
            continue
        if not isinstance(cid, str):
            bad += 1
            continue
        ids.append(cid)
        try:
            tokens += int(line["response"]["body"]["usage"]["completion_tokens"])
        except (TypeError, KeyError, ValueError):
            pass
    return ids, bad, tokens


def count_lines(input_ids: Sequence[str], output_text: str, error_text: str, status: str | None) -> LineCount:
    """One batch's input custom_ids against its output and error files (JSONL text, empty where
    the batch has none) and its final ``status`` (None: it never ended, so its files are
    none and every line is lost)."""
    if status is None:
        output_text = error_text = ""
    expected = set(input_ids)
    out_ids, out_bad, tokens = _file_ids(output_text)
    err_ids, err_bad, _ = _file_ids(error_text)
    seen = Counter(out_ids) + Counter(err_ids)
    in_out, in_err = set(out_ids) & expected, set(err_ids) & expected
    missing = len(expected - in_out - in_err)
    stray = out_bad + err_bad + sum(n for cid, n in seen.items() if cid not in expected)
    return LineCount(
        total=len(input_ids),
        done=len(in_out),
        failed=len(in_err - in_out),
        lost=0 if status == "cancelled" else missing,
        cancelled=missing if status == "cancelled" else 0,
        twice=sum(1 for cid, n in seen.items() if n > 1 and cid in expected),
        stray=stray,
        tokens=tokens,
    )


# =========================================================================== a day's figures (pure)


@dataclass(frozen=True)
class DayFigures:
    """One day's row in the table."""

    name: str
    requests: int
    ok: int
    refused: int  # 429 and 503: refusals the server answered
    other: int  # every other outcome: 504, other 5xx, no answer, client drops
    p50_ms: float
    p99_ms: float
    lag_p99_ms: float  # how late the generator sent
    batch_lines: int  # backlog lines completed while the day ran
    spare_used: float | None
    level_s: float  # seconds polled at a level above 0
    machine_rps: float | None

    @staticmethod
    def of(
        name: str,
        answers: Sequence[Answer],
        polls: Sequence[Poll],
        meter: SpareMeter,
        send_lags_s: Sequence[float],
        machine_rps: float | None,
    ) -> DayFigures:
        ok = [a.latency_s * 1000.0 for a in answers if a.status == 200]
        refused = sum(1 for a in answers if a.status in (429, 503))
        level_s, prev = 0.0, 0.0
        for p in polls:
            level_s += (p.t_s - prev) if (p.level or 0) > 0 else 0.0
            prev = p.t_s
        lines = max((p.completed for p in polls if p.completed is not None), default=0)
        return DayFigures(
            name=name,
            requests=len(answers),
            ok=len(ok),
            refused=refused,
            other=len(answers) - len(ok) - refused,
            p50_ms=_pct(ok, 0.5),
            p99_ms=_pct(ok, 0.99),
            lag_p99_ms=_pct([lag * 1000.0 for lag in send_lags_s], 0.99),
            batch_lines=lines,
            spare_used=meter.spare_used(),
            level_s=level_s,
            machine_rps=machine_rps,
        )


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None or x != x else format(x, spec)


def table(days: Sequence[DayFigures]) -> list[str]:
    """The days side by side, one row each."""
    head = (
        f"{'day':<16} {'requests':>8} {'ok':>7} {'refused':>7} {'other':>6} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'lag p99':>7} {'batch done':>10} {'spare used':>10} {'lvl>0 s':>7} {'machine':>7}"
    )
    rows = [head]
    for d in days:
        rows.append(
            f"{d.name:<16} {d.requests:>8} {d.ok:>7} {d.refused:>7} {d.other:>6} {_num(d.p50_ms, '.1f'):>8} "
            f"{_num(d.p99_ms, '.1f'):>8} {_num(d.lag_p99_ms, '.0f'):>7} {d.batch_lines:>10} "
            f"{_num(d.spare_used, '.3f'):>10} {d.level_s:>7.0f} {_num(d.machine_rps, '.1f'):>7}"
        )
    return rows


def day_record(run: DayRun) -> dict[str, Any]:
    """A day's raw figures as JSON can hold them: every answer ``[criticality, status, code,
    latency_s, done_s, tokens]``, every poll ``[t_s, completed, failed, level]``, the send lags'
    p99, the machine's speed, when the backlog ran out."""
    return {
        "answers": [
            [a.criticality, a.status, a.code, round(a.latency_s, 4), round(a.done_s, 3), a.tokens] for a in run.answers
        ],
        "polls": [[round(p.t_s, 3), p.completed, p.failed, p.level] for p in run.polls],
        "send_lag_p99_ms": _pct([lag * 1000.0 for lag in run.send_lags_s], 0.99),
        "machine_rps": run.machine_rps,
        "backlog_out_s": run.backlog_out_s,
    }


# =========================================================================== the final line (pure)


@dataclass(frozen=True)
class BatchLine:
    """The run's last line, for scripts: ``render`` writes it, ``parse`` reads it back (None for
    a figure that is not a number: no spare, or no answers to take a p99 of)."""

    lines_done: int
    lines_lost: int
    lines_twice: int
    spare_used: float | None
    interactive_p99_ratio: float | None
    interactive_refused_delta: int

    def render(self) -> str:
        parts = []
        for key in FINAL_KEYS:
            value = getattr(self, key)
            if key in FINAL_INT_KEYS:
                parts.append(f"{key}={value:d}")
            else:
                parts.append(f"{key}={'nan' if value is None or value != value else format(value, '.3f')}")
        return "batch: " + " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> BatchLine:
        """The last ``batch:`` line of ``text`` (a run's whole output will do)."""
        lines = [ln for ln in text.splitlines() if ln.startswith("batch: ")]
        if not lines:
            raise ValueError("no 'batch: ' line")
        pairs = dict(kv.split("=", 1) for kv in lines[-1][len("batch: ") :].split())
        if tuple(pairs) != FINAL_KEYS:
            raise ValueError(f"keys {tuple(pairs)}, expected {FINAL_KEYS}")
        values: dict[str, Any] = {}
        for key, raw in pairs.items():
            if key in FINAL_INT_KEYS:
                values[key] = int(raw)
            else:
                x = float(raw)
                values[key] = None if x != x else x
        return cls(**values)


def p99_ratio(with_backlog: DayFigures, without: DayFigures) -> float | None:
    r = with_backlog.p99_ms / without.p99_ms if without.p99_ms else float("nan")
    return None if r != r else r


def check_targets(line: BatchLine, interactive_requests: int, gpu: bool) -> list[tuple[str, bool, str]]:
    """(target, met, figure) for each of the issue's targets; the p99 one is 1.05 on a GPU."""
    p99_max = 1.05 if gpu else 1.2
    refused_max = 0.005 * interactive_requests
    ratio = line.interactive_p99_ratio
    lost_ok = line.lines_lost == 0 and line.lines_twice == 0
    return [
        ("lines_lost = lines_twice = 0", lost_ok, f"{line.lines_lost}, {line.lines_twice}"),
        ("spare_used >= 0.7", line.spare_used is not None and line.spare_used >= 0.7, _num(line.spare_used, ".3f")),
        (f"interactive p99 ratio <= {p99_max:g}", ratio is not None and ratio <= p99_max, _num(ratio, ".3f")),
        (
            f"interactive refused delta <= 0.5 % of {interactive_requests} = {refused_max:.1f}",
            line.interactive_refused_delta <= refused_max,
            str(line.interactive_refused_delta),
        ),
    ]


# =========================================================================== the run


@dataclass
class DayRun:
    """What one day collected, before it is summed up."""

    answers: list[Answer] = field(default_factory=list)
    polls: list[Poll] = field(default_factory=list)
    send_lags_s: list[float] = field(default_factory=list)
    machine_rps: float | None = None
    backlog_out_s: float | None = None  # when the backlog had no line left to run, if it ran out


@dataclass(frozen=True)
class Submitted:
    batch_id: str
    input_ids: list[str]


def _judge(r: LeanResponse) -> tuple[int, str, int]:
    """(status, code, completion tokens) of an answer: a 200 counts with a completion's text."""
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status == 200:
        if answer_text(body, completions=True) is None:
            return 0, "malformed_200", 0
        try:
            return 200, "OK", int(body["usage"]["completion_tokens"])
        except (TypeError, KeyError, ValueError):
            return 200, "OK", 0
    try:
        return r.status, str(body["error"]["code"]), 0
    except (TypeError, KeyError):
        return r.status, f"HTTP_{r.status}", 0


class _Bench:
    """One run: the stack's clients, C, the two days, the backlog's files."""

    def __init__(self, cfg: Any, args: argparse.Namespace, speed: Any) -> None:
        self.cfg, self.args, self.speed = cfg, args, speed
        self.prompt = PROMPT
        self.prefix = f"{BASE}{cfg.route_prefix.rstrip('/')}"
        self.key = BENCH_KEY
        self.status_url = f"{self.prefix}/v1/status"
        self.admin = {"Authorization": f"Bearer {cfg.auth.demo_admin_token}"}

    def body(self, crit: str) -> dict[str, Any]:
        """An interactive /v1/completions body: the model, the prompt, ``--max-tokens``, its class."""
        return {
            "model": self.cfg.model.name,
            "prompt": self.prompt,
            "max_tokens": self.args.max_tokens,
            "criticality": crit,
        }

    def stack(self, slo_s: float | None) -> Stack:
        headers = {"Authorization": f"Bearer {self.key}"}
        if slo_s is not None:
            headers["X-Request-Timeout-Ms"] = str(int(slo_s * 1000))
        return Stack("ballast", f"{self.prefix}/v1/completions", headers, self.body, class_header=True)

    async def level(self) -> int | None:
        try:
            async with httpx.AsyncClient(timeout=5) as c:
                r = await c.get(self.status_url, headers=self.admin)
                return int(one_model(r.json())["level"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    async def settle(self) -> None:
        """A quiet stack: stragglers done, the level back to 0 (at most ``SETTLE_LIMIT_S``)."""
        await asyncio.sleep(2.0)
        stop = time.monotonic() + SETTLE_LIMIT_S
        while time.monotonic() < stop and await self.level() != 0:
            await asyncio.sleep(1.0)

    async def capacity(self) -> float:
        a = self.args
        if a.capacity is not None:
            return float(a.capacity)
        stack = self.stack(a.slo_s)
        if a.smoke:
            await closed_loop_rate(stack, 4, 3.0)  # warm-up
            return await closed_loop_rate(stack, 8, 6.0)
        cap, _ = await find_capacity(
            stack, DEFAULT_MIX, a.slo_s, a.probe_s, a.confirm_s, a.seed, self.settle, self.speed
        )
        return cap

    async def machine(self) -> float:
        return float(await asyncio.to_thread(self.speed.rows_per_second))

    async def day(self, plan: DayPlan, backlog: list[Submitted], openai: AsyncOpenAI) -> DayRun:
        """One day: the machine timed, the arrivals sent open loop while ``poll`` reads the
        backlog's counts and the level every ``--interval-s`` (the last poll at the day's end),
        every answer waited for, the machine timed again."""
        run = DayRun()
        before = await self.machine()
        arrivals = plan.arrivals()
        crits = criticality_sequence(len(arrivals), DEFAULT_MIX, self.args.seed)
        stack = self.stack(None)
        in_flight = 0
        t0 = time.perf_counter()

        async def one(client: LeanClient, crit: str, scheduled: float) -> None:
            nonlocal in_flight
            in_flight += 1
            headers = {**stack.headers, "X-Ballast-Criticality": crit}
            try:
                status, code, tokens = _judge(await client.post_json(stack.path, stack.body(crit), headers))
            except LeanHttpError as e:
                status, code, tokens = 0, e.kind, 0
            finally:
                in_flight -= 1
            now = time.perf_counter()
            run.answers.append(Answer(crit, status, code, now - scheduled, now - t0, tokens))

        u = urlsplit(stack.url)
        client = LeanClient(u.hostname or "127.0.0.1", u.port or 80, MAX_IN_FLIGHT, DAY_CLIENT_TIMEOUT_S)
        async with client:
            polling = asyncio.create_task(self.poll(run, plan.day_s, t0, backlog, openai))
            tasks = []
            for at, crit in zip(arrivals, crits):
                scheduled = t0 + at
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if in_flight >= MAX_IN_FLIGHT:
                    run.answers.append(Answer(crit, 0, "client_drop", 0.0, at))
                    continue
                tasks.append(asyncio.create_task(one(client, crit, scheduled)))
                run.send_lags_s.append(time.perf_counter() - scheduled)
            await polling
            await asyncio.gather(*tasks)
        run.machine_rps = (before + await self.machine()) / 2
        return run

    async def poll(self, run: DayRun, day_s: float, t0: float, backlog: list[Submitted], openai: AsyncOpenAI) -> None:
        """Every ``--interval-s`` until the day's end (``poll_times``): the backlog's counts
        summed over its batches (``batches.list``; a failed read is a gap) and the level."""
        ids = {s.batch_id for s in backlog}
        total_lines = sum(len(s.input_ids) for s in backlog)
        for at in poll_times(day_s, self.args.interval_s):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            completed = failed = 0 if not ids else None
            if ids:
                try:
                    page = await openai.batches.list(limit=100)
                    counts = [b.request_counts for b in page.data if b.id in ids and b.request_counts]
                    if len(counts) == len(ids):
                        completed, failed = sum(c.completed for c in counts), sum(c.failed for c in counts)
                except Exception as e:  # noqa: BLE001 - a failed read is a gap, not the end of the day
                    print(f"... poll at {at:.0f} s: {type(e).__name__}: {e}", flush=True)
            t_s = time.perf_counter() - t0
            run.polls.append(Poll(t_s, completed, failed, await self.level()))
            placed = (completed or 0) + (failed or 0)
            if total_lines and run.backlog_out_s is None and placed >= total_lines:
                run.backlog_out_s = t_s

    async def submit(self, openai: AsyncOpenAI, sizes: Sequence[int]) -> list[Submitted]:
        out = []
        for i, size in enumerate(sizes):
            ids, data = batch_input(i, size, self.cfg.model.name, self.prompt, self.args.max_tokens)
            f = await openai.files.create(file=(f"backlog-{i}.jsonl", data), purpose="batch")
            b = await openai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            out.append(Submitted(b.id, ids))
        return out

    async def finish(self, openai: AsyncOpenAI, backlog: list[Submitted]) -> tuple[LineCount, dict[str, str | None]]:
        """Drain for at most ``--drain-s``, cancel what still runs, wait for every batch to end
        (at most ``--cancel-wait-s``), then count each one's files against its input."""
        a = self.args
        status: dict[str, str | None] = {s.batch_id: None for s in backlog}

        async def read_all() -> dict[str, Any]:
            got = {}
            for s in backlog:
                try:
                    got[s.batch_id] = await openai.batches.retrieve(s.batch_id)
                except Exception:  # noqa: BLE001 - read again on the next round
                    continue
            return got

        async def wait_terminal(limit_s: float) -> dict[str, Any]:
            stop = time.monotonic() + limit_s
            while True:
                got = await read_all()
                for bid, b in got.items():
                    status[bid] = b.status if b.status in TERMINAL else None
                if all(status.values()) or time.monotonic() >= stop:
                    return got
                await asyncio.sleep(1.0)

        got = await wait_terminal(a.drain_s)
        for s in backlog:
            if status[s.batch_id] is None:
                try:
                    await openai.batches.cancel(s.batch_id)
                except Exception as e:  # noqa: BLE001 - it may have ended meanwhile: the wait says
                    print(f"... cancel {s.batch_id}: {type(e).__name__}: {e}", flush=True)
        if not all(status.values()):
            got = await wait_terminal(a.cancel_wait_s)
        total = LineCount()
        for s in backlog:
            b = got.get(s.batch_id)
            texts = []
            for file_id in (getattr(b, "output_file_id", None), getattr(b, "error_file_id", None)):
                texts.append((await openai.files.content(file_id)).text if file_id and status[s.batch_id] else "")
            total = total + count_lines(s.input_ids, texts[0], texts[1], status[s.batch_id])
        return total, status

    async def preflight(self, openai: AsyncOpenAI) -> None:
        """The Batch API answers for the backlog's tenant, before minutes are spent on C and a day."""
        try:
            await openai.files.list(limit=1)
        except APIStatusError as e:
            raise SystemExit(
                f"bench-batch: GET /v1/files answered {e.status_code}: this stack serves no Batch API"
            ) from None

    async def run(
        self, cap: float
    ) -> tuple[float, DayPlan, list[DayFigures], LineCount, dict[str, str | None], list[DayRun]]:
        a = self.args
        openai = AsyncOpenAI(base_url=f"{self.prefix}/v1", api_key=BATCH_KEY, max_retries=0, timeout=60.0)
        try:
            await self.preflight(openai)
            plan = DayPlan(cap, a.day_s, a.peak_ratio)
            lines = a.smoke_lines if a.smoke else backlog_lines(plan, a.backlog_factor)
            sizes = batch_sizes(lines, min(a.batches, lines), self.cfg.batch.max_file_lines)
            print(
                f"bench-batch: C = {cap:.1f} req/s; a day of {a.day_s:g} s, peak {a.peak_ratio:g} C, "
                f"{len(plan.arrivals())} interactive requests, spare for {plan.spare_requests():.0f}; "
                f"backlog {lines} lines in {len(sizes)} batches",
                flush=True,
            )
            await self.settle()
            without = await self.day(plan, [], openai)
            print("... the day without the backlog is over", flush=True)
            await self.settle()
            backlog = await self.submit(openai, sizes)
            with_backlog = await self.day(plan, backlog, openai)
            print("... the day with the backlog is over; draining", flush=True)
            counted, status = await self.finish(openai, backlog)
        finally:
            await openai.close()
        cap_tokens = cap * _tokens_per_answer(without.answers, a.max_tokens)
        figures = []
        for name, day, tpl in (
            ("without backlog", without, 0.0),
            ("with backlog", with_backlog, counted.tokens_per_line),
        ):
            meter = spare_accounting(day.polls, day.answers, cap_tokens, tpl)
            figures.append(DayFigures.of(name, day.answers, day.polls, meter, day.send_lags_s, day.machine_rps))
        return cap, plan, figures, counted, status, [without, with_backlog]


def _tokens_per_answer(answers: Sequence[Answer], default: int) -> float:
    """The mean completion tokens of the 200s (``default`` where none came)."""
    tokens = [a.tokens for a in answers if a.status == 200 and a.tokens]
    return sum(tokens) / len(tokens) if tokens else float(default)


def bench_batch_data(path: str, store_url: str, password_file: str) -> dict[str, Any]:
    """The overload bench's config (``bench_data``: its quota-free tenant, one model replica,
    port 8124) with the backlog's tenant and the store."""
    data = bench_data(path, 1)
    data["tenants"][BATCH_TENANT] = {
        "description": "batch benchmark's backlog: no token quota",
        "max_concurrent": 100000,
    }
    data["auth"]["demo_keys"][BATCH_KEY] = BATCH_TENANT
    batch = data.setdefault("batch", {})
    batch.update(enabled=True, store_url=store_url, store_password_file=password_file)
    return data


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", default="cluster/local.yaml")
    p.add_argument("--day-s", type=float, default=480.0, help="real seconds of one compressed day (each of two)")
    p.add_argument("--peak-ratio", type=float, default=0.9, help="the day's peak rate as a share of C")
    p.add_argument("--capacity", type=float, default=None, help="take C (req/s) as given instead of measuring it")
    p.add_argument("--slo-s", type=float, default=1.0, help="C's SLO: 90 %% answered within it")
    p.add_argument("--probe-s", type=float, default=8.0)
    p.add_argument("--confirm-s", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=32, help="every request's and batch line's max_tokens")
    p.add_argument("--backlog-factor", type=float, default=1.5, help="batch lines over the day's spare requests")
    p.add_argument("--batches", type=int, default=4, help="the backlog's batches (files)")
    p.add_argument("--interval-s", type=float, default=1.0, help="poll interval: the spare meter's intervals")
    p.add_argument("--drain-s", type=float, default=300.0, help="after the day, the backlog's time to finish")
    p.add_argument("--cancel-wait-s", type=float, default=60.0, help="after the cancels, their time to end")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="where days.json goes (default .run/bench-batch/<UTC time>)")
    p.add_argument("--smoke", action="store_true", help="a 60 s day, a handful of lines: the path end to end")
    p.add_argument("--smoke-lines", type=int, default=24, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything starts."""
    p = _parser()
    a = p.parse_args(argv)
    if a.smoke:
        a.day_s, a.drain_s, a.batches = 60.0, min(a.drain_s, 60.0), 2
    for name in ("day_s", "interval_s", "backlog_factor", "slo_s", "probe_s", "confirm_s"):
        if not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')}: must be > 0")
    if not 0 < a.peak_ratio <= 1:
        p.error("--peak-ratio: must be within (0, 1]")
    if a.capacity is not None and not a.capacity > 0:
        p.error("--capacity: must be > 0")
    for name in ("max_tokens", "batches", "smoke_lines"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    if a.drain_s < 0 or a.cancel_wait_s < 0:
        p.error("--drain-s, --cancel-wait-s: must be >= 0")
    if a.day_s > 3600:
        p.error("--day-s: at most 3600 (the run is bounded)")
    return a


def report(
    cap: float,
    plan: DayPlan,
    figures: list[DayFigures],
    counted: LineCount,
    status: dict[str, str | None],
    with_run: DayRun,
    gpu: bool,
    print_: Callable[[str], None] = print,
) -> int:
    """The table, the backlog, the targets, then the one line; 0 unless a line was lost, written
    twice, or a file held a line of no input (stray)."""
    without, with_backlog = figures
    print_(f"\nbatch on spare capacity: C {cap:.1f} req/s, a {plan.day_s:g} s day at peak {plan.peak_ratio:g} C")
    for row in table(figures):
        print_(row)
    ended = Counter(s or "never ended" for s in status.values())
    print_(
        f"backlog: {counted.total} lines in {len(status)} batches ({', '.join(f'{n} {s}' for s, n in ended.items())}); "
        f"done {counted.done}, failed {counted.failed}, cancelled {counted.cancelled}, lost {counted.lost}, "
        f"twice {counted.twice}, stray {counted.stray}; {counted.tokens_per_line:.1f} tokens a line"
    )
    if with_run.backlog_out_s is not None:
        print_(
            f"the backlog ran out {with_run.backlog_out_s:.0f} s into the day: spare_used is capped by it "
            "(raise --backlog-factor)"
        )
    line = BatchLine(
        lines_done=counted.done,
        lines_lost=counted.lost,
        lines_twice=counted.twice,
        spare_used=with_backlog.spare_used,
        interactive_p99_ratio=p99_ratio(with_backlog, without),
        interactive_refused_delta=with_backlog.refused - without.refused,
    )
    for name, met, figure in check_targets(line, with_backlog.requests, gpu):
        print_(f"target {name}: {figure} {'met' if met else 'MISSED'}")
    print_(line.render())
    return 1 if line.lines_lost or line.lines_twice or counted.stray else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ballast-bench-batch-") as tmp, EmbeddedRedis(Path(tmp) / "redis") as store:
        cfg = load_config(bench_batch_data(args.config, store.url, str(store.password_file)))
        speed = SpeedProbeProcess(cfg.model.architecture.model_dump(), cfg.model.seed)
        try:
            install_uvloop()
            # C on a stack of its own: the days start on a fresh one, whose batch dispatch has
            # seen only the days' interactive traffic, not the probe's overload (module docstring)
            if args.capacity is None:
                with local_stack(cfg):
                    capacity = asyncio.run(_Bench(cfg, args, speed).capacity())
            else:
                capacity = float(args.capacity)
            with local_stack(cfg):
                cap, plan, figures, counted, status, runs = asyncio.run(_Bench(cfg, args, speed).run(capacity))
        finally:
            speed.close()
    out = args.out or REPO / ".run" / "bench-batch" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    raw = {"capacity_rps": cap, "day_s": plan.day_s, "peak_ratio": plan.peak_ratio, "lines": asdict(counted)}
    raw.update(batches=status, days={f.name: day_record(r) for f, r in zip(figures, runs)})
    (out / "days.json").write_text(json.dumps(raw), encoding="utf-8")
    print(f"bench-batch: every answer and poll in {out / 'days.json'}")
    import torch

    return report(cap, plan, figures, counted, status, runs[1], gpu=bool(torch.cuda.is_available()))


if __name__ == "__main__":
    raise SystemExit(main())
