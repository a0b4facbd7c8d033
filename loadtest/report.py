"""The soak report: tables and plots from Locust's CSV files and the sampled ``/v1/status``.

``build(out_dir)`` reads what a soak (``loadtest/soak.py``) left in ``out_dir``:

* ``locust_stats.csv`` — Locust's totals per request name. Names are
  ``"<tenant> <plain|stream>"`` (answers and failures) and
  ``"<tenant> <plain|stream> shed:<CODE>"`` (expected refusals, see
  ``loadtest/locustfile.py``), plus Locust's ``Aggregated`` row.
* ``locust_stats_history.csv`` — the same per second (``--csv-full-history``):
  current requests/s, failures/s and rolling-window percentiles over time.
* ``locust_failures.csv`` — failures by name and error (the top ones are listed).
* ``status.jsonl`` — one compact sample of ``GET /v1/status`` + ``GET /admin/replicas``
  per line (``status_sample`` below writes that shape): the level of the model at the
  highest one and its inputs, desired
  and running replicas, per-replica RSS/age/readiness, recent recycle events.
* ``report.json`` — the locustfile's refusal counts by tenant × criticality × code
  and the fault runner's records.
* ``run.json`` — the soak's settings (time scale, peak users, faults, start time).

and writes ``report.md`` beside them with PNG plots (``requests.png``,
``latency.png``, ``level.png``, ``replicas.png``, ``rss.png``, ``sheds.png``).

Definitions used in the tables:

* requests — every request of that tenant and kind: answers, failures and sheds.
* ok — answered and valid (the base name's count minus its failures).
* success ratio — ok / requests (a shed is not a success here; it is counted apart).
* p50/p95/p99 — Locust's percentiles of the base name: answers and failures, not
  sheds (a refusal is fast and would flatter the latency).
* goodput — ok per second over the run's duration (Locust's history span).
* time at a level — each status sample's level holds until the next sample.

Every table is a pure function of parsed rows (tested on recorded sample data in
``tests/unit/data/soak_sample``); plotting is isolated in ``write_plots`` and uses
matplotlib's Agg backend (no display). A missing or unreadable file becomes a line
in the report saying what is missing, never a traceback.

Written with the standard ``csv``/``json`` modules rather than pandas: the inputs
are a few thousand rows and the project does not otherwise need pandas.

Run: ``python -m loadtest.report <out_dir>`` (regenerates the report).
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

MB = 1024 * 1024  # as ballast.control.watchdog: "MB" is MiB throughout the project
STATS_CSV = "locust_stats.csv"
HISTORY_CSV = "locust_stats_history.csv"
FAILURES_CSV = "locust_failures.csv"
STATUS_JSONL = "status.jsonl"
REPORT_JSON = "report.json"
RUN_JSON = "run.json"
REPORT_MD = "report.md"
PLOTS = ("requests.png", "latency.png", "level.png", "replicas.png", "rss.png", "sheds.png")

#: Limits that keep one status sample small (soak.py writes one every few seconds).
MAX_SAMPLE_REPLICAS = 64
MAX_SAMPLE_EVENTS = 10
MAX_FAILURE_ROWS = 10
#: Lines of status.jsonl read at most (a 24 h soak samples every ~30 s: ~3,000 lines).
MAX_STATUS_LINES = 200_000

_NAME = re.compile(r"^(?P<tenant>\S+) (?P<kind>plain|stream)(?: shed:(?P<code>\S+))?$")
_STATS_COLUMNS = ("Type", "Name", "Request Count", "Failure Count", "Requests/s", "50%", "95%", "99%")
_HISTORY_COLUMNS = ("Timestamp", "User Count", "Name", "Requests/s", "Failures/s", "50%", "95%", "99%")


class ReportError(Exception):
    """The report cannot be built at all (``path`` says where, ``reason`` why)."""

    def __init__(self, path: str, reason: str):
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


# =========================================================================== parsing (pure)


def _num(raw: Any) -> float | None:
    """A CSV/JSON number; None for '', 'N/A', missing or non-finite."""
    if raw is None or isinstance(raw, bool):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _int(raw: Any) -> int:
    value = _num(raw)
    return int(value) if value is not None else 0


def parse_name(name: str) -> tuple[str, str, str | None] | None:
    """``"gold plain shed:OVERLOADED"`` → ``("gold", "plain", "OVERLOADED")``; None for other names."""
    m = _NAME.match(name.strip())
    if m is None:
        return None
    return m.group("tenant"), m.group("kind"), m.group("code")


@dataclass(frozen=True)
class StatsRow:
    """One row of ``locust_stats.csv`` (times in ms)."""

    name: str
    requests: int
    failures: int
    rps: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class HistoryRow:
    """One row of ``locust_stats_history.csv``: current rates and rolling-window percentiles."""

    t_s: float
    users: int
    name: str
    rps: float
    fail_per_s: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


def _check_header(fieldnames: Sequence[str] | None, needed: Sequence[str], what: str) -> None:
    missing = [c for c in needed if c not in (fieldnames or ())]
    if missing:
        raise ValueError(f"{what}: not Locust's layout, missing columns {missing}")


def parse_stats(lines: Iterable[str]) -> list[StatsRow]:
    """``locust_stats.csv`` → rows (the ``Aggregated`` row included, named so)."""
    reader = csv.DictReader(lines)
    _check_header(reader.fieldnames, _STATS_COLUMNS, STATS_CSV)
    return [
        StatsRow(
            name=r["Name"],
            requests=_int(r["Request Count"]),
            failures=_int(r["Failure Count"]),
            rps=_num(r["Requests/s"]),
            p50_ms=_num(r["50%"]),
            p95_ms=_num(r["95%"]),
            p99_ms=_num(r["99%"]),
        )
        for r in reader
        if r.get("Name")
    ]


def parse_history(lines: Iterable[str]) -> list[HistoryRow]:
    """``locust_stats_history.csv`` → rows, in file order ("N/A" percentiles → None)."""
    reader = csv.DictReader(lines)
    _check_header(reader.fieldnames, _HISTORY_COLUMNS, HISTORY_CSV)
    rows = []
    for r in reader:
        t_s = _num(r["Timestamp"])
        if t_s is None or not r.get("Name"):
            continue
        rows.append(
            HistoryRow(
                t_s=t_s,
                users=_int(r["User Count"]),
                name=r["Name"],
                rps=_num(r["Requests/s"]) or 0.0,
                fail_per_s=_num(r["Failures/s"]) or 0.0,
                p50_ms=_num(r["50%"]),
                p95_ms=_num(r["95%"]),
                p99_ms=_num(r["99%"]),
            )
        )
    return rows


def parse_failures(lines: Iterable[str]) -> list[dict[str, Any]]:
    """``locust_failures.csv`` → ``[{"name", "error", "occurrences"}]``, most frequent first."""
    reader = csv.DictReader(lines)
    _check_header(reader.fieldnames, ("Name", "Error", "Occurrences"), FAILURES_CSV)
    rows = [{"name": r["Name"], "error": r["Error"], "occurrences": _int(r["Occurrences"])} for r in reader]
    return sorted(rows, key=lambda r: (-r["occurrences"], r["name"], r["error"]))


def parse_status_lines(lines: Iterable[str], max_lines: int = MAX_STATUS_LINES) -> tuple[list[dict[str, Any]], int]:
    """``status.jsonl`` → (samples sorted by time, number of unreadable lines).

    A soak stopped hard can leave a cut last line; such lines are counted, not fatal.
    """
    samples: list[dict[str, Any]] = []
    bad = 0
    for i, line in enumerate(lines):
        if i >= max_lines:
            break
        line = line.strip()
        if not line:
            continue
        try:
            sample = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(sample, dict) or _num(sample.get("t_s")) is None:
            bad += 1
            continue
        samples.append(sample)
    samples.sort(key=lambda s: float(s["t_s"]))
    return samples, bad


# =========================================================================== status samples (pure)


def lost_capacity(samples: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The last sample's lost-capacity counters ({} when none was ever non-zero)."""
    for sample in reversed(samples):
        lost = sample.get("lost_capacity") or {}
        if any(lost.values()):
            return dict(lost)
    return {}


def status_sample(
    t_s: float, status: Mapping[str, Any] | None, replicas: Mapping[str, Any] | None, error: str | None = None
) -> dict[str, Any]:
    """One compact ``status.jsonl`` line from ``GET /v1/status`` and ``GET /admin/replicas``.

    Keeps only what the report uses, bounded (``MAX_SAMPLE_REPLICAS`` replicas,
    ``MAX_SAMPLE_EVENTS`` events), so that a day of samples stays a few MB. Either
    answer may be None (its call failed; ``error`` says why).
    """
    out: dict[str, Any] = {"t_s": round(float(t_s), 3)}
    if status:
        # One model a line: the one at the highest level the router acts on (the first of them),
        # its level, where it comes from, and the controller's target, reason and inputs for it.
        models = status.get("models") or {}
        name = max(models, key=lambda n: models[n].get("level") or 0, default=None)
        mine = models.get(name) or {}
        state = ((status.get("snapshot") or {}).get("models") or {}).get(name) or {}
        out["model"] = name
        out["level"] = mine.get("level")
        out["source"] = mine.get("source")
        out["target_level"] = state.get("target_level")
        out["reason"] = str(state.get("reason") or "")[:200]
        inputs = state.get("inputs") or {}
        out["inputs"] = {
            k: v for k, v in inputs.items() if isinstance(v, (int, float, type(None))) and not isinstance(v, bool)
        }
        out["deployments"] = {
            str(dep): {"desired": d.get("desired"), "running": d.get("running")}
            for dep, d in (status.get("replicas") or {}).items()
            if isinstance(d, Mapping)
        }
        recycle = status.get("recycle") or {}
        out["recycles_in_flight"] = len(recycle.get("in_flight") or ())
        avail = recycle.get("availability") or {}
        out["availability"] = {k: avail.get(k) for k in ("expected", "measured") if k in avail}
        lost: dict[str, int] = {}  # every model's
        for m in models.values():
            for k, v in (m.get("lost_capacity") or {}).items():
                if isinstance(v, int):
                    lost[k] = lost.get(k, 0) + v
        out["lost_capacity"] = lost
    if replicas:
        rows = []
        for r in (replicas.get("replicas") or ())[:MAX_SAMPLE_REPLICAS]:
            wd = r.get("watchdog") or {}
            rss = _num(wd.get("rss_bytes"))
            rows.append(
                {
                    "id": str(r.get("replica_id")),
                    "deployment": r.get("deployment"),
                    "rss_mb": None if rss is None else round(rss / MB, 1),
                    "age_s": r.get("age_s"),
                    "ready": r.get("ready"),
                    "draining": r.get("draining"),
                }
            )
        out["replicas"] = rows
        events = list(replicas.get("events") or ())[-MAX_SAMPLE_EVENTS:]
        out["events"] = [
            {k: e.get(k) for k in ("at_s", "outcome", "replica_id", "deployment", "reason", "duration_s") if k in e}
            for e in events
            if isinstance(e, Mapping)
        ]
    if error:
        out["error"] = error[:300]
    return out


# =========================================================================== tables (pure)


@dataclass(frozen=True)
class TenantKindRow:
    tenant: str
    kind: str  # "plain", "stream" or "all"
    requests: int
    ok: int
    shed: int
    failed: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    goodput_per_s: float | None

    @property
    def success_ratio(self) -> float | None:
        return self.ok / self.requests if self.requests else None

    @property
    def shed_ratio(self) -> float | None:
        return self.shed / self.requests if self.requests else None


def tenant_kind_table(rows: Sequence[StatsRow], duration_s: float | None) -> list[TenantKindRow]:
    """Per tenant and kind, then one ``"all"`` row per tenant and an ``("all", "all")`` total.

    Percentiles come from the base name's row; the ``all`` rows have none (Locust's
    percentiles cannot be merged from the CSV, and its Aggregated row mixes in sheds).
    """
    base: dict[tuple[str, str], StatsRow] = {}
    sheds: dict[tuple[str, str], int] = defaultdict(int)
    for r in rows:
        parsed = parse_name(r.name)
        if parsed is None:
            continue
        tenant, kind, code = parsed
        if code is None:
            base[(tenant, kind)] = r
        else:
            sheds[(tenant, kind)] += r.requests

    def goodput(ok: int) -> float | None:
        return ok / duration_s if duration_s and duration_s > 0 else None

    out: list[TenantKindRow] = []
    keys = sorted(set(base) | set(sheds))
    for tenant, kind in keys:
        b = base.get((tenant, kind))
        answered = b.requests if b else 0
        failed = b.failures if b else 0
        ok = answered - failed
        shed = sheds.get((tenant, kind), 0)
        has_latency = b is not None and b.requests > 0
        out.append(
            TenantKindRow(
                tenant,
                kind,
                answered + shed,
                ok,
                shed,
                failed,
                b.p50_ms if has_latency else None,
                b.p95_ms if has_latency else None,
                b.p99_ms if has_latency else None,
                goodput(ok),
            )
        )

    def total(tenant: str, part: list[TenantKindRow]) -> TenantKindRow:
        ok = sum(r.ok for r in part)
        return TenantKindRow(
            tenant,
            "all",
            sum(r.requests for r in part),
            ok,
            sum(r.shed for r in part),
            sum(r.failed for r in part),
            None,
            None,
            None,
            goodput(ok),
        )

    per_tenant = list(out)
    for tenant in sorted({r.tenant for r in per_tenant}):
        out.append(total(tenant, [r for r in per_tenant if r.tenant == tenant]))
    if per_tenant:
        out.append(total("all", per_tenant))
    return out


@dataclass(frozen=True)
class ShedRow:
    code: str
    tenant: str
    kind: str
    count: int


def shed_rows(rows: Sequence[StatsRow]) -> list[ShedRow]:
    """Sheds by reason, tenant and kind from the ``shed:<CODE>`` names; largest first."""
    out = []
    for r in rows:
        parsed = parse_name(r.name)
        if parsed is None or parsed[2] is None or r.requests <= 0:
            continue
        tenant, kind, code = parsed
        out.append(ShedRow(code, tenant, kind, r.requests))
    return sorted(out, key=lambda s: (-s.count, s.code, s.tenant, s.kind))


def shed_totals(rows: Sequence[StatsRow]) -> dict[str, int]:
    """Sheds per reason (code → count), largest first."""
    totals: dict[str, int] = defaultdict(int)
    for s in shed_rows(rows):
        totals[s.code] += s.count
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


def sheds_by_criticality(report: Mapping[str, Any] | None) -> dict[str, dict[str, int]]:
    """``report.json``'s sheds as criticality → code → count (summed over tenants)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for s in (report or {}).get("sheds") or ():
        if not isinstance(s, Mapping):
            continue
        crit, code, n = s.get("criticality"), s.get("code"), _int(s.get("count"))
        if isinstance(crit, str) and isinstance(code, str) and n > 0:
            out[crit][code] += n
    order = ("critical_plus", "critical", "sheddable_plus", "sheddable")
    keys = sorted(out, key=lambda c: (order.index(c) if c in order else len(order), c))
    return {c: dict(sorted(out[c].items())) for c in keys}


def run_duration_s(history: Sequence[HistoryRow], stats: Sequence[StatsRow]) -> float | None:
    """The run's length: the history's span, else the Aggregated count over its rate."""
    if history:
        span = max(h.t_s for h in history) - min(h.t_s for h in history)
        if span > 0:
            return span
    for r in stats:
        if r.name == "Aggregated" and r.rps:
            return r.requests / r.rps
    return None


@dataclass(frozen=True)
class LevelSummary:
    seconds_by_level: dict[int, float]
    changes: int
    max_level: int | None
    samples: int

    @property
    def total_s(self) -> float:
        return math.fsum(self.seconds_by_level.values())


def level_summary(samples: Sequence[Mapping[str, Any]]) -> LevelSummary:
    """Time at each level: a sample's level holds until the next sample's time.

    Samples without a level (a failed poll) are skipped: the previous level runs on.
    """
    points = [
        (float(s["t_s"]), int(s["level"]))
        for s in samples
        if isinstance(s.get("level"), int) and not isinstance(s.get("level"), bool)
    ]
    seconds: dict[int, float] = defaultdict(float)
    changes = 0
    for (t0, lvl), (t1, nxt) in zip(points, points[1:]):
        seconds[lvl] += max(0.0, t1 - t0)
        if nxt != lvl:
            changes += 1
    if points:
        seconds.setdefault(points[-1][1], 0.0)
    return LevelSummary(
        dict(sorted(seconds.items())), changes, max((level for _, level in points), default=None), len(points)
    )


def recycle_events(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Recycle events seen in any sample, once each (by time, outcome, replica), in time order."""
    seen: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for s in samples:
        for e in s.get("events") or ():
            if not isinstance(e, Mapping):
                continue
            key = (e.get("at_s"), e.get("outcome"), e.get("replica_id"))
            seen.setdefault(key, dict(e))
    return sorted(seen.values(), key=lambda e: (_num(e.get("at_s")) or 0.0, str(e.get("outcome"))))


@dataclass(frozen=True)
class RssRow:
    replica_id: str
    deployment: str
    samples: int
    min_mb: float
    max_mb: float
    last_mb: float
    first_seen_s: float
    last_seen_s: float
    max_age_s: float | None

    @property
    def growth_mb(self) -> float:
        return self.max_mb - self.min_mb


def rss_table(samples: Sequence[Mapping[str, Any]]) -> list[RssRow]:
    """RSS min/max/last per replica (replicas in order of first appearance)."""
    acc: dict[str, dict[str, Any]] = {}
    for s in samples:
        t_s = float(s["t_s"])
        for r in s.get("replicas") or ():
            rss = _num(r.get("rss_mb"))
            if rss is None or not r.get("id"):
                continue
            a = acc.setdefault(
                r["id"],
                {
                    "deployment": str(r.get("deployment") or "?"),
                    "n": 0,
                    "min": rss,
                    "max": rss,
                    "first": t_s,
                    "age": None,
                },
            )
            a["n"] += 1
            a["min"], a["max"], a["last"], a["last_t"] = min(a["min"], rss), max(a["max"], rss), rss, t_s
            age = _num(r.get("age_s"))
            if age is not None:
                a["age"] = age if a["age"] is None else max(a["age"], age)
    return [
        RssRow(rid, a["deployment"], a["n"], a["min"], a["max"], a["last"], a["first"], a["last_t"], a["age"])
        for rid, a in acc.items()
    ]


@dataclass(frozen=True)
class ReplicaCountRow:
    deployment: str
    desired_min: int | None
    desired_max: int | None
    running_min: int | None
    running_max: int | None
    short_s: float  # time with running < desired


def replica_count_table(samples: Sequence[Mapping[str, Any]]) -> list[ReplicaCountRow]:
    """Desired vs running per deployment; ``short_s``: time running below desired (held until the next sample)."""
    series: dict[str, list[tuple[float, int | None, int | None]]] = defaultdict(list)
    for s in samples:
        for dep, d in (s.get("deployments") or {}).items():
            desired, running = d.get("desired"), d.get("running")
            series[dep].append(
                (
                    float(s["t_s"]),
                    desired if isinstance(desired, int) else None,
                    running if isinstance(running, int) else None,
                )
            )
    out = []
    for dep in sorted(series):
        pts = series[dep]
        desired = [d for _, d, _ in pts if d is not None]
        running = [r for _, _, r in pts if r is not None]
        short = math.fsum(
            t1 - t0 for (t0, d, r), (t1, _, _) in zip(pts, pts[1:]) if d is not None and r is not None and r < d
        )
        out.append(
            ReplicaCountRow(
                dep,
                min(desired, default=None),
                max(desired, default=None),
                min(running, default=None),
                max(running, default=None),
                short,
            )
        )
    return out


def aggregated_timeline(history: Sequence[HistoryRow]) -> list[HistoryRow]:
    """The ``Aggregated`` rows of the history, in time order."""
    return sorted((h for h in history if h.name == "Aggregated"), key=lambda h: h.t_s)


def outcome_timeline(history: Sequence[HistoryRow]) -> dict[str, list[tuple[float, float]]]:
    """Per second: ok/s, shed/s and failed/s (current rates) summed over tenants and kinds."""
    by_t: dict[float, dict[str, float]] = defaultdict(lambda: {"ok": 0.0, "shed": 0.0, "failed": 0.0})
    for h in history:
        parsed = parse_name(h.name)
        if parsed is None:
            continue
        slot = by_t[h.t_s]
        if parsed[2] is not None:
            slot["shed"] += h.rps
        else:
            slot["ok"] += max(0.0, h.rps - h.fail_per_s)
            slot["failed"] += h.fail_per_s
    return {k: [(t, by_t[t][k]) for t in sorted(by_t)] for k in ("ok", "shed", "failed")}


def latency_by_name(history: Sequence[HistoryRow], attr: str = "p99_ms") -> dict[str, list[tuple[float, float]]]:
    """Per base name (``"<tenant> <kind>"``, sheds excluded): (time, percentile ms) where known and > 0."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for h in sorted(history, key=lambda h: h.t_s):
        parsed = parse_name(h.name)
        value = getattr(h, attr)
        if parsed is not None and parsed[2] is None and value:
            out[h.name].append((h.t_s, value))
    return dict(sorted(out.items()))


def shed_timeline(history: Sequence[HistoryRow]) -> dict[str, list[tuple[float, float]]]:
    """Per reason: (time, current sheds/s) summed over tenants and kinds."""
    by_code: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for h in history:
        parsed = parse_name(h.name)
        if parsed is not None and parsed[2] is not None:
            by_code[parsed[2]][h.t_s] += h.rps
    return {code: sorted(pts.items()) for code, pts in sorted(by_code.items())}


# =========================================================================== loading


@dataclass
class SoakData:
    """Everything read from an output folder; ``notes`` says what was missing or odd."""

    out_dir: Path
    stats: list[StatsRow] = field(default_factory=list)
    history: list[HistoryRow] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] | None = None
    run: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def t0_s(self) -> float | None:
        """The run's start (wall clock): run.json's, else the earliest timestamp seen."""
        start = _num(self.run.get("started_at_s"))
        if start is not None:
            return start
        times = [h.t_s for h in self.history] + [float(s["t_s"]) for s in self.samples]
        return min(times) if times else None

    @property
    def time_scale(self) -> float | None:
        return _num(self.run.get("time_scale"))


def _read_text(path: Path, notes: list[str], what: str) -> list[str] | None:
    if not path.is_file():
        notes.append(f"`{path.name}` is missing: {what} not available.")
        return None
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        notes.append(f"`{path.name}` could not be read ({e.strerror or e}): {what} not available.")
        return None


def _read_csv(path: Path, notes: list[str], what: str, parse: Callable[[list[str]], T]) -> T | None:
    """``parse`` of the file's lines; None, with a note, when it is missing, unreadable or malformed."""
    lines = _read_text(path, notes, what)
    if lines is None:
        return None
    try:
        return parse(lines)
    except (ValueError, csv.Error) as e:
        notes.append(f"`{path.name}` could not be parsed ({e}).")
        return None


def _read_json(path: Path, notes: list[str], what: str) -> dict[str, Any] | None:
    lines = _read_text(path, notes, what)
    if lines is None:
        return None
    try:
        data = json.loads("\n".join(lines))
    except ValueError as e:
        notes.append(f"`{path.name}` is not valid JSON ({e}): {what} not available.")
        return None
    if not isinstance(data, dict):
        notes.append(f"`{path.name}` is not a JSON object: {what} not available.")
        return None
    return data


def load(out_dir: Path | str) -> SoakData:
    """Read a soak's output folder; missing or malformed files become notes."""
    out = Path(out_dir)
    if not out.is_dir():
        raise ReportError(str(out), "no such directory (a soak writes its files there: python -m loadtest.soak)")
    data = SoakData(out)
    notes = data.notes
    data.stats = _read_csv(out / STATS_CSV, notes, "per-tenant requests, latency and sheds", parse_stats) or []
    data.history = _read_csv(out / HISTORY_CSV, notes, "requests and latency over time", parse_history) or []
    data.failures = _read_csv(out / FAILURES_CSV, notes, "the failure list", parse_failures) or []
    lines = _read_text(out / STATUS_JSONL, notes, "level, replicas, RSS and recycle events")
    if lines is not None:
        data.samples, bad = parse_status_lines(lines)
        if bad:
            notes.append(f"`{STATUS_JSONL}`: {bad} unreadable line(s) skipped.")
        failed = sum(1 for s in data.samples if s.get("error"))
        if failed:
            notes.append(f"`{STATUS_JSONL}`: {failed} of {len(data.samples)} sample(s) recorded a failed poll.")
    data.report = _read_json(out / REPORT_JSON, notes, "sheds by criticality and the fault records")
    data.run = _read_json(out / RUN_JSON, notes, "the run's settings") or {}
    if data.stats and not any(parse_name(r.name) for r in data.stats):
        notes.append(
            f'`{STATS_CSV}` has no Ballast request names ("<tenant> <plain|stream>"): '
            "did Locust run the Ballast locustfile?"
        )
    return data


# =========================================================================== markdown


def _fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}{suffix}"


def _pct(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio * 100:.2f} %"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |" for row in rows]
    return lines


def _span(lo: int | None, hi: int | None) -> str:
    return "—" if lo is None or hi is None else f"{lo}–{hi}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = float(seconds)
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def _offset(data: SoakData, t_s: float | None) -> str:
    """A wall time as ``+real offset`` (and the simulated hour when the time scale is known)."""
    t0 = data.t0_s
    if t_s is None or t0 is None:
        return "—"
    real = float(t_s) - t0
    text = f"+{_duration(max(0.0, real))}"
    if data.time_scale:
        text += f" (sim {(real * data.time_scale) / 3600.0:05.2f} h)"
    return text


def render_markdown(data: SoakData, plots: Mapping[str, str | None]) -> str:
    """The report's text; ``plots`` maps each PNG name to None (written) or why it was not."""
    duration_s = run_duration_s(data.history, data.stats)
    lines = _settings_section(data, duration_s)
    for section in SECTIONS:
        lines += section(data, plots, duration_s)
    return "\n".join(lines)


def _settings_section(data: SoakData, duration_s: float | None) -> list[str]:
    """The title, the run's settings and the inputs that were missing."""
    lines = ["# Ballast soak report", ""]
    run = data.run
    settings = [
        ("output", f"`{data.out_dir}`"),
        ("time scale", _fmt(data.time_scale, 0, "× (simulated s per real s)") if data.time_scale else "—"),
        ("peak users", run.get("peak_users", "—")),
        ("faults", run.get("faults", "—")),
        ("config", f"`{run['config']}`" if run.get("config") else "—"),
        ("duration (Locust history)", _duration(duration_s)),
        ("simulated", _duration(duration_s * data.time_scale) if duration_s and data.time_scale else "—"),
        ("stopped by", run.get("stop_reason", "—")),
        ("Locust exit code", run.get("locust_rc", "—")),
        ("status samples", len(data.samples)),
    ]
    lines += _table(("setting", "value"), settings)
    lines.append("")
    if data.notes:
        lines += ["**Missing or incomplete inputs:**", ""] + [f"- {n}" for n in data.notes] + [""]
    return lines


def _section(
    title: str, body: list[str], empty: str, plots: Mapping[str, str | None], *drawn: tuple[str, str]
) -> list[str]:
    """A report section: its heading, ``body`` (the ``empty`` line when there is none),
    then a line per plot in ``drawn`` (its file name and what it shows), a blank line last."""
    lines = [f"## {title}", ""] + (body or [empty])
    for name, what in drawn:
        lines += ["", _plot_line(plots, name, what)]
    return lines + [""]


def _requests_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    table = tenant_kind_table(data.stats, duration_s)
    body = (
        [
            "requests = answers + failures + sheds; success = ok / requests; "
            "latency of answers and failures (not sheds); goodput = ok per second.",
            "",
            *_table(
                (
                    "tenant",
                    "kind",
                    "requests",
                    "ok",
                    "shed",
                    "failed",
                    "success",
                    "shed ratio",
                    "p50 ms",
                    "p95 ms",
                    "p99 ms",
                    "goodput /s",
                ),
                (
                    (
                        r.tenant,
                        r.kind,
                        r.requests,
                        r.ok,
                        r.shed,
                        r.failed,
                        _pct(r.success_ratio),
                        _pct(r.shed_ratio),
                        _fmt(r.p50_ms),
                        _fmt(r.p95_ms),
                        _fmt(r.p99_ms),
                        _fmt(r.goodput_per_s, 2),
                    )
                    for r in table
                ),
            ),
        ]
        if table
        else []
    )
    return _section(
        "Requests per tenant and kind",
        body,
        "_No request data (see the missing inputs above)._",
        plots,
        ("requests.png", "requests, sheds and failures per second"),
        ("latency.png", "latency p50/p95/p99 (rolling window)"),
    )


def _sheds_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    table = tenant_kind_table(data.stats, duration_s)
    totals = shed_totals(data.stats)
    all_requests = sum(r.requests for r in table if r.tenant == "all")
    body: list[str] = []
    if totals:
        body += _table(
            ("reason", "sheds", "share of all requests"),
            ((code, n, _pct(n / all_requests if all_requests else None)) for code, n in totals.items()),
        )
        body += ["", "By tenant and kind:", ""]
        body += _table(
            ("reason", "tenant", "kind", "sheds"), ((s.code, s.tenant, s.kind, s.count) for s in shed_rows(data.stats))
        )
    empty = "_No sheds recorded._" if data.stats else "_No request data._"
    return _section("Sheds by reason", body, empty, plots, ("sheds.png", "sheds per second by reason"))


def _criticality_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    by_crit = sheds_by_criticality(data.report)
    body: list[str] = []
    if by_crit:
        codes = sorted({c for per in by_crit.values() for c in per})
        body += _table(
            ("criticality (claimed)", *codes, "total"),
            ((crit, *(per.get(c, 0) for c in codes), sum(per.values())) for crit, per in by_crit.items()),
        )
        body += ["", "Criticality as the client claimed it (the server lowers a claim above the tenant's maximum)."]
    no_report = "_No `report.json` (the locustfile writes it when `$BALLAST_REPORT_JSON` is set)._"
    return _section("Sheds by criticality", body, no_report if data.report is None else "_No sheds recorded._", plots)


def _level_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    lvl = level_summary(data.samples)
    body: list[str] = []
    if lvl.samples:
        total = lvl.total_s
        body += _table(
            ("level", "time", "share"),
            (
                (f"L{level}", _duration(s), _pct(s / total if total else None))
                for level, s in lvl.seconds_by_level.items()
            ),
        )
        body += ["", f"Highest level: L{lvl.max_level}; level changes: {lvl.changes}; samples: {lvl.samples}."]
    return _section(
        "Degradation level",
        body,
        "_No status samples with a level._",
        plots,
        ("level.png", "degradation level over time"),
    )


def _replicas_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    counts = replica_count_table(data.samples)
    body = (
        _table(
            ("deployment", "desired min–max", "running min–max", "time running < desired"),
            (
                (
                    c.deployment,
                    _span(c.desired_min, c.desired_max),
                    _span(c.running_min, c.running_max),
                    _duration(c.short_s),
                )
                for c in counts
            ),
        )
        if counts
        else []
    )
    return _section(
        "Replicas",
        body,
        "_No replica counts in the status samples._",
        plots,
        ("replicas.png", "replicas desired vs running"),
    )


def _rss_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    rss = rss_table(data.samples)
    body = (
        _table(
            (
                "replica",
                "deployment",
                "samples",
                "min MB",
                "max MB",
                "growth MB",
                "last MB",
                "seen from",
                "seen until",
                "max age",
            ),
            (
                (
                    r.replica_id,
                    r.deployment,
                    r.samples,
                    _fmt(r.min_mb, 1),
                    _fmt(r.max_mb, 1),
                    _fmt(r.growth_mb, 1),
                    _fmt(r.last_mb, 1),
                    _offset(data, r.first_seen_s),
                    _offset(data, r.last_seen_s),
                    _duration(r.max_age_s),
                )
                for r in rss
            ),
        )
        if rss
        else []
    )
    return _section(
        "RSS per replica", body, "_No replica RSS in the status samples._", plots, ("rss.png", "RSS per replica")
    )


def _recycle_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    events = recycle_events(data.samples)
    body = (
        _table(
            ("when", "outcome", "deployment", "replica", "reason", "took"),
            (
                (
                    _offset(data, _num(e.get("at_s"))),
                    e.get("outcome", "—"),
                    e.get("deployment", "—"),
                    e.get("replica_id", "—"),
                    e.get("reason", "—"),
                    _duration(_num(e.get("duration_s"))),
                )
                for e in events
            ),
        )
        if events
        else []
    )
    return _section("Recycle events", body, "_No recycle events in the status samples._", plots)


def _lost_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    lost = lost_capacity(data.samples)
    body = (
        [
            f"{lost.get('migrated', 0)} requests sent again or carried on elsewhere after their replica went away "
            f"({lost.get('streams_carried_on', 0)} of them streams continued mid-way); "
            f"{lost.get('not_migrated', 0)} were not "
            "(the migration limit, the deadline or the retry budget: the fallback answered, else 503 `REPLICA_LOST`, "
            "counted under Failures). Counted by the router the sampler reached, since it started."
        ]
        if lost
        else []
    )
    empty = "_None: no request was in flight on a replica that went away (or no status samples)._"
    return _section("Replicas lost under requests", body, empty, plots)


def _faults_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    faults = (data.report or {}).get("faults") or []
    body = (
        _table(
            ("sim hour", "real offset", "action", "step", "status", "error"),
            (
                (
                    _fmt((_num(f.get("at_sim_s")) or 0.0) / 3600.0, 2),
                    _duration(_num(f.get("real_offset_s"))),
                    f.get("action", "—"),
                    f.get("step", "—"),
                    f.get("status") if f.get("status") is not None else "no answer",
                    (f.get("error") or "")[:120],
                )
                for f in faults
                if isinstance(f, Mapping)
            ),
        )
        if faults
        else []
    )
    return _section("Faults injected", body, "_No fault records._", plots)


def _failures_section(data: SoakData, plots: Mapping[str, str | None], duration_s: float | None) -> list[str]:
    body: list[str] = []
    if data.failures:
        body += _table(
            ("name", "error", "occurrences"),
            ((f["name"], f["error"][:160], f["occurrences"]) for f in data.failures[:MAX_FAILURE_ROWS]),
        )
        if len(data.failures) > MAX_FAILURE_ROWS:
            body += ["", f"…and {len(data.failures) - MAX_FAILURE_ROWS} more kinds in `{FAILURES_CSV}`."]
    return _section("Failures", body, "_No failures recorded._", plots)


#: The report's sections after its settings, in order.
SECTIONS = (
    _requests_section,
    _sheds_section,
    _criticality_section,
    _level_section,
    _replicas_section,
    _rss_section,
    _recycle_section,
    _lost_section,
    _faults_section,
    _failures_section,
)


def _plot_line(plots: Mapping[str, str | None], name: str, what: str) -> str:
    if name not in plots:
        return f"_Plot `{name}` not drawn._"
    why = plots[name]
    return f"![{what}]({name})" if why is None else f"_No plot of {what}: {why}._"


# =========================================================================== plots (isolated)


def _x(data: SoakData, t_s: float) -> float:
    """Plot x: simulated hours when the time scale is known, else real minutes since start."""
    real = t_s - (data.t0_s or 0.0)
    return real * data.time_scale / 3600.0 if data.time_scale else real / 60.0


def write_plots(data: SoakData) -> dict[str, str | None]:
    """Draw every PNG that has data; returns name → None (written) or the reason it was not."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display, whatever $MPLBACKEND says
        import matplotlib.pyplot as plt
    except ImportError:
        return {name: "matplotlib is not installed (pip install -e '.[load]')" for name in PLOTS}
    canvas = _Canvas(data, plt)
    for names, draw in DRAWINGS:
        why = draw(canvas)
        if why is not None:
            canvas.result.update(dict.fromkeys(names, why))
    return canvas.result


class _Canvas:
    """What each drawing needs: the data, pyplot, the x axis's label, and where PNGs go."""

    def __init__(self, data: SoakData, plt: Any) -> None:
        self.data, self.plt = data, plt
        self.xlabel = "simulated hour of the day" if data.time_scale else "minutes since start"
        self.result: dict[str, str | None] = {}

    def save(self, name: str, fig: Any) -> None:
        fig.tight_layout()
        fig.savefig(self.data.out_dir / name, dpi=100)
        self.plt.close(fig)
        self.result[name] = None


def _draw_traffic(c: _Canvas) -> str | None:
    """requests.png and latency.png from Locust's history; None when drawn, else why not."""
    data, plt, xlabel, save = c.data, c.plt, c.xlabel, c.save
    agg = aggregated_timeline(data.history)
    outcomes = outcome_timeline(data.history)
    if not agg:
        return "no Locust history"
    fig, ax = plt.subplots(figsize=(10, 4))
    if any(outcomes.values()):
        for key, color in (("ok", "tab:green"), ("shed", "tab:orange"), ("failed", "tab:red")):
            pts = outcomes[key]
            ax.plot([_x(data, t) for t, _ in pts], [v for _, v in pts], label=f"{key}/s", color=color, lw=1)
    else:
        ax.plot([_x(data, h.t_s) for h in agg], [h.rps for h in agg], label="requests/s", lw=1)
        ax.plot([_x(data, h.t_s) for h in agg], [h.fail_per_s for h in agg], label="failures/s", color="tab:red", lw=1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("per second")
    users = ax.twinx()
    users.plot([_x(data, h.t_s) for h in agg], [h.users for h in agg], color="grey", ls="--", lw=1, label="users")
    users.set_ylabel("users")
    handles = ax.get_legend_handles_labels()[0] + users.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize="small")
    ax.set_title("Requests per second by outcome")
    save("requests.png", fig)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for attr, label in (("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99")):
        pts = [(_x(data, h.t_s), getattr(h, attr)) for h in agg if getattr(h, attr)]
        top.plot([p[0] for p in pts], [p[1] for p in pts], label=label, lw=1)
    top.set_ylabel("ms")
    top.set_title("Latency, all requests (Locust's Aggregated, sheds included; rolling window)", fontsize="medium")
    per_name = latency_by_name(data.history, "p99_ms")
    for name, pts in per_name.items():
        bottom.plot([_x(data, t) for t, _ in pts], [v for _, v in pts], label=name, lw=1)
    bottom.set_ylabel("ms")
    bottom.set_title("p99 per tenant and kind (answers and failures, not sheds)", fontsize="medium")
    bottom.set_xlabel(xlabel)
    for ax in (top, bottom):
        if ax.lines:
            ax.set_yscale("log")  # a 30 s deadline next to a 100 ms median
            ax.legend(loc="upper left", fontsize="small")
    save("latency.png", fig)
    return None


def _draw_sheds(c: _Canvas) -> str | None:
    """sheds.png: sheds per second by reason and in total."""
    data, plt, xlabel, save = c.data, c.plt, c.xlabel, c.save
    sheds = shed_timeline(data.history)
    totals = shed_totals(data.stats)
    if not (sheds or totals):
        return "no sheds recorded"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    for code, pts in sheds.items():
        left.plot([_x(data, t) for t, _ in pts], [v for _, v in pts], label=code, lw=1)
    left.set_xlabel(xlabel)
    left.set_ylabel("sheds/s")
    if sheds:
        left.legend(loc="upper left", fontsize="small")
    left.set_title("Sheds per second by reason")
    right.barh(list(totals), list(totals.values()), color="tab:orange")
    right.set_title("Sheds in total")
    right.invert_yaxis()
    save("sheds.png", fig)
    return None


def _draw_level(c: _Canvas) -> str | None:
    """level.png: the degradation level over time."""
    data, plt, xlabel, save = c.data, c.plt, c.xlabel, c.save
    levels = [(float(s["t_s"]), s["level"]) for s in data.samples if isinstance(s.get("level"), int)]
    if not levels:
        return "no status samples with a level"
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.step([_x(data, t) for t, _ in levels], [lvl for _, lvl in levels], where="post", lw=1.5)
    ax.set_ylim(-0.3, 4.3)
    ax.set_yticks(range(5))
    ax.grid(axis="y", lw=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("level")
    ax.set_title("Degradation level")
    save("level.png", fig)
    return None


def _draw_replicas(c: _Canvas) -> str | None:
    """replicas.png: replicas desired vs running per deployment."""
    data, plt, xlabel, save = c.data, c.plt, c.xlabel, c.save
    deps: dict[str, list[tuple[float, Any, Any]]] = defaultdict(list)
    for s in data.samples:
        for dep, d in (s.get("deployments") or {}).items():
            deps[dep].append((_x(data, float(s["t_s"])), d.get("desired"), d.get("running")))
    if not deps:
        return "no replica counts in the status samples"
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(len(deps), 1, figsize=(10, 1.2 + 2.2 * len(deps)), sharex=True, squeeze=False)
    for ax, (dep, pts) in zip(axes[:, 0], sorted(deps.items())):
        desired = [(x, v) for x, v, _ in pts if isinstance(v, int)]
        running = [(x, v) for x, _, v in pts if isinstance(v, int)]
        if desired:  # the controller sets a target only for the deployments it scales
            ax.step(
                [x for x, _ in desired],
                [v for _, v in desired],
                where="post",
                color="tab:blue",
                ls="--",
                label="desired",
            )
        ax.step([x for x, _ in running], [v for _, v in running], where="post", color="tab:green", label="running")
        top = max([v for _, v in desired + running], default=1)
        ax.set_ylim(0, top + 0.5)  # from zero: a replica count is read against none
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("replicas")
        ax.set_title(dep, fontsize="medium")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel(xlabel)
    fig.suptitle("Replicas desired vs running")
    save("replicas.png", fig)
    return None


def _draw_rss(c: _Canvas) -> str | None:
    """rss.png: RSS per replica, recycles marked."""
    data, plt, xlabel, save = c.data, c.plt, c.xlabel, c.save
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for s in data.samples:
        for r in s.get("replicas") or ():
            if _num(r.get("rss_mb")) is not None and r.get("id"):
                series[r["id"]].append((_x(data, float(s["t_s"])), float(r["rss_mb"])))
    if not series:
        return "no replica RSS in the status samples"
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, (rid, pts) in enumerate(series.items()):
        ax.plot([x for x, _ in pts], [v for _, v in pts], lw=1, label=rid[-24:] if i < 12 else None)
    for e in recycle_events(data.samples):
        at = _num(e.get("at_s"))
        if at is not None and e.get("outcome") in ("started", "killed_hung"):
            ax.axvline(_x(data, at), color="grey", lw=0.6, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("RSS MB")
    ax.legend(loc="upper left", fontsize="x-small")
    ax.set_title("RSS per replica (dotted: recycle started / hung replica killed)")
    save("rss.png", fig)
    return None


#: Each drawing with the PNGs it writes.
DRAWINGS = (
    (("requests.png", "latency.png"), _draw_traffic),
    (("sheds.png",), _draw_sheds),
    (("level.png",), _draw_level),
    (("replicas.png",), _draw_replicas),
    (("rss.png",), _draw_rss),
)


# =========================================================================== entry points


def build(out_dir: Path | str) -> Path:
    """Read ``out_dir``, write its PNGs and ``report.md``; returns the markdown's path.

    Raises ``ReportError`` only when ``out_dir`` is not a directory; missing or broken
    files inside it are reported in the markdown.
    """
    data = load(out_dir)
    for name in PLOTS:  # a regenerated report must not show a plot left by an earlier build
        stale = data.out_dir / name
        if stale.is_file():
            stale.unlink()
    plots = write_plots(data)
    path = data.out_dir / REPORT_MD
    path.write_text(render_markdown(data, plots), encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(
            "usage: python -m loadtest.report <out_dir>   (a soak's output folder, e.g. .run/soak/<timestamp>)",
            file=sys.stderr,
        )
        return 2
    try:
        path = build(args[0])
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
