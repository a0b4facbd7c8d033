"""The comparison as markdown: one row per arm, then SLO and sheds per criticality."""

from __future__ import annotations

from collections.abc import Sequence

from .config import SimConfig, fleet_scaled_settings
from .engine import Result
from .model import CLASSES


def _pct(x: float, digits: int = 3) -> str:
    return f"{100.0 * x:.{digits}f} %"


def _int(x: float) -> str:
    return f"{int(round(x)):,}"


def summary_table(results: Sequence[Result]) -> str:
    head = (
        "| arm | SLO attainment | goodput (req/s) | shed | timed out | lost in crashes "
        "| replica-hours | good req per replica-h | recycles | OOM crashes | hard failures | peak replicas "
        "| time at level 1–4 (s) |"
    )
    rows = [head, "|" + "---|" * 13]
    for r in results:
        good = r.total("served_in_slo")
        levels = "/".join(_int(s) for s in r.level_seconds[1:])
        rows.append(
            f"| {r.arm} | {_pct(r.slo_attainment)} | {r.goodput_per_s:,.0f} | {_int(r.total('shed'))} "
            f"| {_int(r.total('timed_out'))} | {_int(r.total('failed'))} | {r.replica_hours:,.0f} "
            f"| {good / r.replica_hours:,.0f} | {r.recycles} | {r.oom_crashes} | {r.hard_failures} "
            f"| {r.peak_replicas} | {levels} |"
        )
    return "\n".join(rows)


def class_table(results: Sequence[Result]) -> str:
    names = [c.value for c in CLASSES]
    rows = ["| arm | " + " | ".join(f"{n}: SLO / shed" for n in names) + " |", "|" + "---|" * (len(names) + 1)]
    for r in results:
        cells = []
        for n in names:
            c = r.by_class(n)
            shed = c.shed / c.arrivals if c.arrivals else 0.0
            cells.append(f"{_pct(c.slo_attainment)} / {_pct(shed, 2)}")
        rows.append(f"| {r.arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render(cfg: SimConfig, results: Sequence[Result], seed: int) -> str:
    scaled = ", ".join(f"{k} = {v}" for k, v in fleet_scaled_settings(cfg).items())
    reasons = "; ".join(
        f"{r.arm}: " + ", ".join(f"{k} {v}" for k, v in r.recycles_by_reason) for r in results if r.recycles
    )
    lines = [
        f"## Fleet simulation: {cfg.hours:g} h, noon peak = {cfg.replicas_peak:,} replicas "
        f"(max {cfg.max_replicas:,}), seed {seed}, tick {cfg.tick_s:g} s",
        "",
        f"Arrivals {results[0].arrivals:,} (mix {'/'.join(f'{m:.0%}' for m in cfg.mix)} by criticality); "
        f"SLO {cfg.slo_s:g} s end to end, client timeout {cfg.timeout_s:g} s. "
        "SLO attainment counts sheds, timeouts and crash losses as misses.",
        "",
        summary_table(results),
        "",
        class_table(results),
        "",
        f"Ballast settings scaled to the fleet: {scaled}.",
        f"Baselines: Ray Serve target_ongoing_requests = {cfg.target_ongoing_requests:g}, upscale/downscale "
        f"delay {cfg.ray_upscale_delay_s:g}/{cfg.ray_downscale_delay_s:g} s, look-back {cfg.ray_look_back_s:g} s; "
        f"HPA target utilization {cfg.hpa_target():.1f} % (the same operating point), sync {cfg.hpa_sync_s:g} s, "
        f"downscale stabilization {cfg.hpa_stabilization_s:g} s, tolerance {cfg.hpa_tolerance:.0%}.",
    ]
    if reasons:
        lines.append(f"Recycles by reason: {reasons}.")
    return "\n".join(lines)
