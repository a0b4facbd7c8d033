"""Leak trends, the action ladder and the hang rule, walked tick by tick on integer seconds.

Series are synthetic but shaped like allocator memory: a linear leak (or none),
a GC sawtooth (+15 MB ramp over 5 min, then a drop) and gaussian noise of 4 MB,
sampled every 10 s. Every random draw comes from ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from ballast.policies.leak import (
    SILENT,
    STALLED,
    Action,
    LadderConfig,
    LadderState,
    LeakConfig,
    LeakDetector,
    SeriesSpec,
    Trend,
    Usage,
    Verdict,
    assess,
    fit,
    fit_short,
    hang_reason,
    theil_sen,
)

MB = 1 << 20
GB = 1 << 30
SAMPLE_S = 10
WINDOW_S = 3600
RSS = SeriesSpec("rss_bytes", slope_threshold_per_h=30 * MB, limit=4 * GB)  # the project default threshold
SAWTOOTH_MB, SAWTOOTH_PERIOD_S, NOISE_MB = 15, 300, 4


def rss_bytes(t: int, leak_mb_per_h: float, rng: random.Random, *, saw: bool = True, start: float = 2 * GB) -> float:
    ramp = SAWTOOTH_MB * MB * (t % SAWTOOTH_PERIOD_S) / SAWTOOTH_PERIOD_S if saw else 0.0
    return start + leak_mb_per_h * MB * t / 3600 + ramp + rng.gauss(0, NOISE_MB * MB)


def ols_slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    return sum((t - mt) * (v - mv) for t, v in points) / sum((t - mt) ** 2 for t, _ in points)


# ----------------------------------------------------------------- config


def test_defaults_follow_the_seed() -> None:
    cfg, ladder = LeakConfig(), LadderConfig()
    assert (cfg.window_s, cfg.min_span_ratio, cfg.min_points, cfg.max_points, cfg.r2_threshold) == (
        3600.0,
        0.5,
        10,
        120,
        0.7,
    )
    assert (cfg.short_window_s, cfg.short_min_span_s, cfg.short_max_points, cfg.short_horizon_s) == (
        300.0,
        90.0,
        60,
        3600.0,
    )
    assert (ladder.warning_ratio, ladder.critical_ratio) == (0.90, 0.97)
    assert [a.value for a in Action] == ["gc_collect", "empty_cache", "stop_intake", "request_recycle"]


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (SeriesSpec, "name", ""),
        (SeriesSpec, "slope_threshold_per_h", 0),
        (SeriesSpec, "slope_threshold_per_h", math.inf),
        (SeriesSpec, "limit", -1.0),
        (LeakConfig, "window_s", 0),
        (LeakConfig, "min_span_ratio", 0.0),
        (LeakConfig, "min_span_ratio", 1.5),
        (LeakConfig, "min_points", 2),
        (LeakConfig, "min_points", 121),  # > max_points: could never be judged
        (LeakConfig, "max_points", 2.5),
        (LeakConfig, "r2_threshold", 0),
        (LeakConfig, "short_window_s", 4000.0),  # > window_s
        (LeakConfig, "short_min_span_s", 301.0),  # > short_window_s: never judged
        (LeakConfig, "short_horizon_s", 0),
        (LeakConfig, "short_max_points", 9),  # < min_points
        (LadderConfig, "step_interval_s", 0),
        (LadderConfig, "warn_tto_s", -1),
        (LadderConfig, "critical_tto_s", 7 * 3600.0),  # > warn_tto_s
        (LadderConfig, "warning_ratio", 0.98),  # > critical_ratio
        (LadderConfig, "critical_ratio", 1.1),
        (LadderState, "rung", 5),
        (LadderState, "rung", True),
        (Usage, "value", math.nan),
        (Usage, "limit", 0),
    ],
)
def test_bad_config_names_the_field(cls: type, field: str, value: object) -> None:
    required = {
        SeriesSpec: {"name": "rss_bytes", "slope_threshold_per_h": 1.0},
        Usage: {"name": "vram_bytes", "value": 1.0, "limit": 2.0},
    }.get(cls, {})
    with pytest.raises(ValueError, match=field):
        cls(**{**required, field: value})


def test_detector_rejects_duplicate_series_and_foreign_config() -> None:
    with pytest.raises(ValueError, match="specs"):
        LeakDetector([RSS, RSS], LeakConfig())
    with pytest.raises(ValueError, match="cfg"):
        LeakDetector([RSS], {"window_s": 60})  # type: ignore[arg-type]


# ----------------------------------------------------------------- theil_sen and fit


def test_theil_sen_known_answers() -> None:
    assert theil_sen([0, 1, 2, 3], [1, 3, 5, 7]) == (2.0, 1.0)
    # Two wild points out of seven leave the median slope (and intercept) on the line.
    assert theil_sen([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 300, 4, -500, 6]) == (1.0, 0.0)
    # Equal times carry no slope; a lone point has slope 0 and its value as intercept.
    assert theil_sen([5, 5, 5], [1, 2, 9]) == (0.0, 2.0)
    assert theil_sen([7], [3]) == (0.0, 3.0)
    with pytest.raises(ValueError, match="ts, vs"):
        theil_sen([1, 2], [1])


def test_fit_of_an_exact_line() -> None:
    cfg = LeakConfig()
    spec = SeriesSpec("fds", slope_threshold_per_h=10, limit=1000)
    points = [(1000.0 + 60 * i, 100.0 + 0.5 * i) for i in range(31)]  # 30/h over 1800 s
    tr = fit(points, spec, cfg)
    assert (tr.points, tr.span_s, tr.judged, tr.leaking) == (31, 1800.0, True, True)
    assert tr.slope_per_h == pytest.approx(30.0)
    assert tr.r2 == pytest.approx(1.0)
    assert tr.fitted_now == pytest.approx(115.0)
    assert tr.time_to_limit_s == pytest.approx((1000 - 115) / 30 * 3600)
    # One point short of half the window: no verdict, hence no time-to-limit.
    short = fit(points[:-1], spec, cfg)
    assert (short.judged, short.leaking, short.time_to_limit_s) == (False, False, None)
    # Enough span but fewer than min_points.
    sparse = fit(points[::4], spec, cfg)
    assert (sparse.points, sparse.judged) == (8, False)


def test_fit_edge_cases() -> None:
    cfg = LeakConfig()
    ts = [60.0 * i for i in range(40)]
    flat = fit([(t, 5.0) for t in ts], SeriesSpec("threads", 1.0, 100), cfg)
    assert (flat.slope_per_h, flat.r2, flat.leaking, flat.time_to_limit_s) == (0.0, 0.0, False, None)
    falling = fit([(t, 90 - t / 60) for t in ts], SeriesSpec("threads", 1.0, 100), cfg)
    assert falling.r2 == pytest.approx(1.0) and falling.time_to_limit_s is None
    no_limit = fit([(t, t / 60) for t in ts], SeriesSpec("threads", 1.0), cfg)
    assert no_limit.leaking and no_limit.time_to_limit_s is None
    past_limit = fit([(t, 200 + t / 60) for t in ts], SeriesSpec("threads", 1.0, 100), cfg)
    assert past_limit.time_to_limit_s == 0.0
    # Below the slope threshold: credible, not a leak, still an ETA.
    slow = fit([(t, t / 3600) for t in ts], SeriesSpec("threads", 5.0, 100), cfg)
    assert not slow.leaking and slow.time_to_limit_s is not None
    with pytest.raises(ValueError, match="points"):
        fit([], RSS, cfg)
    with pytest.raises(ValueError, match="sorted"):
        fit([(2.0, 1.0), (1.0, 1.0)], RSS, cfg)


# ----------------------------------------------------------------- detector on realistic series


@pytest.mark.parametrize("seed", [1, 2])
def test_50_mb_per_h_leak_is_detected_within_one_window_not_before_min_span(seed: int) -> None:
    rng, cfg = random.Random(seed), LeakConfig()
    det = LeakDetector([RSS], cfg)
    first_leak: int | None = None
    for t in range(0, WINDOW_S + 1, SAMPLE_S):
        det.observe(t, {"rss_bytes": rss_bytes(t, 50, rng)})
        tr = det.trends(t)["rss_bytes"]
        if tr.span_s < cfg.min_span_ratio * cfg.window_s:
            assert not tr.judged and not tr.leaking, f"verdict at t={t}s, span {tr.span_s}s"
        if tr.leaking and first_leak is None:
            first_leak = t
    assert first_leak is not None, "a 50 MB/h leak went unseen for a whole window"
    assert cfg.min_span_ratio * cfg.window_s <= first_leak <= WINDOW_S
    assert tr.leaking and tr.r2 >= 0.7  # still leaking at the end of the window
    assert tr.slope_per_h == pytest.approx(50 * MB, rel=0.1)


@pytest.mark.parametrize(("seed", "saw"), [(1, True), (2, True), (3, False)])
def test_no_trend_is_never_a_leak_over_three_windows(seed: int, saw: bool) -> None:
    rng = random.Random(seed)
    det = LeakDetector([RSS], LeakConfig())
    for t in range(0, 3 * WINDOW_S + 1, SAMPLE_S):
        det.observe(t, {"rss_bytes": rss_bytes(t, 0, rng, saw=saw)})
        if t % 120 == 0:  # every other minute: 90 verdicts, most of them over a full window
            tr = det.trends(t)["rss_bytes"]
            assert not tr.leaking, f"t={t}s: slope {tr.slope_per_h / MB:.1f} MB/h, r2 {tr.r2:.2f}"
            assert tr.time_to_limit_s is None
    assert tr.judged and tr.points == 120


def test_time_to_limit_within_ten_percent() -> None:
    rng = random.Random(7)
    det = LeakDetector([RSS], LeakConfig())
    for t in range(0, WINDOW_S + 1, SAMPLE_S):
        det.observe(t, {"rss_bytes": rss_bytes(t, 50, rng)})
    tto = det.trends(WINDOW_S)["rss_bytes"].time_to_limit_s
    # 4 GiB limit, 2 GiB + 50 MB after an hour, 50 MB/h: 39.96 h to go.
    expected_s = (4 * GB - (2 * GB + 50 * MB)) / (50 * MB) * 3600
    assert tto == pytest.approx(expected_s, rel=0.10)


def test_a_few_huge_spikes_do_not_make_a_flat_series_leak() -> None:
    rng = random.Random(11)
    det = LeakDetector([RSS], LeakConfig())
    spikes = {2900, 3100, 3300, 3500}  # late in the window, where they pull a least-squares line most
    for t in range(0, WINDOW_S + 1, SAMPLE_S):
        value = rss_bytes(t, 0, rng) + (1 * GB if t in spikes else 0)
        det.observe(t, {"rss_bytes": value})
    tr = det.trends(WINDOW_S)["rss_bytes"]
    assert not tr.leaking and abs(tr.slope_per_h) < 5 * MB
    # The same bucket points would read as a steep rise to ordinary least squares.
    points = det.points("rss_bytes", WINDOW_S)
    assert ols_slope(points) * 3600 > RSS.slope_threshold_per_h


def test_memory_is_bounded_after_100k_observations() -> None:
    rng = random.Random(5)
    specs = [RSS, SeriesSpec("threads", 10.0)]
    det = LeakDetector(specs, LeakConfig())
    t = 0.0
    for i in range(100_000):
        # Irregular sampling, a gap longer than a bucket now and then, and a clock that steps back.
        t += rng.choice((0.1, 0.5, 1.0, 45.0)) if i % 1000 else -5.0
        det.observe(t, {"rss_bytes": rng.random() * GB, "threads": 40 + rng.random()})
        if i % 10_000 == 0:
            assert det.bucket_count("rss_bytes") <= 120 and det.bucket_count("threads") <= 120
    assert det.bucket_count("rss_bytes") == det.bucket_count("threads") <= 120
    assert det.trends(t)["threads"].points <= 120


def test_buckets_average_their_samples_and_skip_what_is_missing() -> None:
    threads = SeriesSpec("threads", 10.0)
    det = LeakDetector([RSS, threads], LeakConfig(window_s=300, max_points=10))  # 30 s buckets
    det.observe(0, {"threads": 10, "rss_bytes": None, "gpu_util": 99})  # unknown name ignored
    det.observe(10, {"threads": 20, "rss_bytes": math.nan})
    det.observe(20, {"threads": 30.0})
    assert det.bucket_count("threads") == 1 and det.bucket_count("rss_bytes") == 0
    tr = det.trends(20)
    assert list(tr) == ["threads"]  # no trend for a series without points
    assert (tr["threads"].points, tr["threads"].fitted_now) == (1, 20.0)  # one bucket: mean of 10, 20, 30
    det.observe(40, {"threads": 50})
    det.observe(35, {"threads": 70})  # stepped back into an older bucket: lands in the newest
    assert det.bucket_count("threads") == 2
    assert det.trends(40)["threads"].fitted_now == pytest.approx(60.0)
    det.observe(59, {"threads": 60})
    det.observe(-600, {"threads": 60})  # a big step back: counted at the newest bucket's start
    assert det.trends(59)["threads"].span_s == pytest.approx((40 + 35 + 59 + 30) / 4 - 10)
    # Buckets 10 or more behind the clock are gone, observed again or not.
    assert det.trends(299)["threads"].points == 2
    assert det.trends(300)["threads"].points == 1
    assert det.trends(330) == {}
    det.observe(330, {"threads": 1, "rss_bytes": 1})
    det.reset("threads")
    assert (det.bucket_count("threads"), det.bucket_count("rss_bytes")) == (0, 1)
    det.reset()
    assert det.bucket_count("rss_bytes") == 0


def test_a_fast_leak_walks_the_ladder_from_the_detector() -> None:
    rng, cfg = random.Random(3), LadderConfig()
    det = LeakDetector([RSS], LeakConfig())
    state, steps = LadderState(), []
    for t in range(0, WINDOW_S + 1, SAMPLE_S):
        det.observe(t, {"rss_bytes": rss_bytes(t, 600, rng)})  # 2 GiB → 4 GiB in about 3.4 h
        if t % 30:
            continue  # one tick per bucket
        verdict, state = assess(det.trends(t), [], False, state, cfg, t)
        if verdict.actions:
            steps.append((t, verdict.severity, verdict.actions))
    assert [s[2] for s in steps] == [(Action.GC,), (Action.STOP_INTAKE,), (Action.RECYCLE,)]
    assert all(sev == "warning" for _, sev, _ in steps)
    assert [b - a for a, b in zip([s[0] for s in steps], [s[0] for s in steps][1:])] == [60, 60]
    assert steps[0][0] >= 1800


# ----------------------------------------------------------------- short (fast-burn) window

FAST = SeriesSpec("rss_bytes", slope_threshold_per_h=30 * MB, limit=4 * GB)


def fast_points(shape, start_s: int, end_s: int) -> list[tuple[float, float]]:
    return [(float(t), shape(t)) for t in range(start_s, end_s + 1, 5)]  # 5 s buckets, as by default


def test_fit_short_names_a_sustained_leak_close_to_its_limit_only() -> None:
    cfg = LeakConfig()
    leak_3 = lambda t: 1 * GB + 3 * MB * t  # noqa: E731
    tr = fit_short(fast_points(leak_3, 0, 90), FAST, cfg)
    assert (tr.judged, tr.leaking, tr.short) == (True, True, True)
    assert tr.time_to_limit_s == pytest.approx((3 * GB - 270 * MB) / (3 * MB))
    # 85 s of evidence is not enough, however clean the line.
    early = fit_short(fast_points(leak_3, 0, 85), FAST, cfg)
    assert (early.judged, early.leaking) == (False, False)
    # The same rise further from the limit than short_horizon_s is the long window's business.
    slow = fit_short(fast_points(lambda t: 1 * GB + 0.5 * MB * t, 0, 90), FAST, cfg)
    assert slow.judged and not slow.leaking and slow.time_to_limit_s > cfg.short_horizon_s


@pytest.mark.parametrize("step_at_s", range(0, 91, 5))
def test_fit_short_a_one_off_step_anywhere_in_the_span_is_no_leak(step_at_s: int) -> None:
    # A line through a step in the middle scores R² up to 0.75; one half is always flat.
    tr = fit_short(fast_points(lambda t: 1 * GB + (500 * MB if t >= step_at_s else 0), 0, 90), FAST, LeakConfig())
    assert tr.judged and not tr.leaking


def test_fit_short_growth_that_stopped_is_no_leak_but_growth_that_goes_on_is() -> None:
    cfg = LeakConfig()
    stopped = lambda t: 1 * GB + 20 * MB * min(t, 40)  # noqa: E731  (stops 40 s into a 90 s span)
    assert not fit_short(fast_points(stopped, 0, 90), FAST, cfg).leaking
    going = lambda t: 1 * GB + 20 * MB * t  # noqa: E731
    assert fit_short(fast_points(going, 0, 90), FAST, cfg).leaking


def test_detector_reports_the_short_trend_only_when_it_names_a_sooner_limit() -> None:
    det = LeakDetector([FAST], LeakConfig())
    for t in range(0, 121):  # 1 Hz, 3 MB/s from 1 GiB
        det.observe(t, {"rss_bytes": 1 * GB + 3 * MB * t})
        tr = det.trends(t)["rss_bytes"]
        assert tr.short is tr.leaking, f"t={t}s"  # the long window is not judged for 30 min
        # Bucket means: the first is t=2 (0..4); the newest, 90..t, has a mean of 92 at t=94.
        assert tr.leaking is (t >= 94), f"t={t}s"
    det.reset()
    for t in range(0, 121):  # a flat series: the long trend, never the short
        det.observe(t, {"rss_bytes": 1 * GB})
    assert not det.trends(120)["rss_bytes"].short


# ----------------------------------------------------------------- ladder


def leak(tto_h: float | None, name: str = "rss_bytes", leaking: bool = True) -> dict[str, Trend]:
    tto = None if tto_h is None else tto_h * 3600
    return {name: Trend(name, 50 * MB, 3 * GB, 0.9, 120, 3570.0, True, leaking, tto)}


WARN = leak(3.0)  # limit in 3 h: warning
CRIT = leak(0.5)  # limit in 30 min: critical
OK: dict[str, Trend] = {}


def step(
    trends: dict[str, Trend], state: LadderState, now_s: int, has_gpu: bool = True, usage: Sequence[Usage] = ()
) -> tuple[Verdict, LadderState]:
    return assess(trends, list(usage), has_gpu, state, LadderConfig(), now_s)


@pytest.mark.parametrize(
    ("has_gpu", "ladder"),
    [
        (True, [(1, Action.EMPTY_CACHE), (2, Action.STOP_INTAKE), (3, Action.RECYCLE)]),
        (False, [(1, Action.STOP_INTAKE), (2, Action.RECYCLE)]),  # no GPU: no cache to empty
    ],
)
def test_warning_takes_one_rung_per_step_interval(has_gpu: bool, ladder: list) -> None:
    v, s = step(WARN, LadderState(), 0, has_gpu)
    assert (v.severity, v.actions, v.ready, v.recycle, s.rung) == ("warning", (Action.GC,), True, False, 1)
    assert v.reason == "rss_bytes leak 50.0 MiB/h, limit in 3.0h" == s.reason
    for k, action in ladder:
        for t in range(60 * (k - 1) + 1, 60 * k):
            v, s = step(WARN, s, t, has_gpu)
            assert v.actions == (), f"stepped at t={t}s before the interval was over"
        v, s = step(WARN, s, 60 * k, has_gpu)
        assert v.actions == (action,) and s.last_step_s == 60 * k
        assert v.ready is (action not in (Action.STOP_INTAKE, Action.RECYCLE))
    assert (s.rung, v.recycle) == (4, True)
    for t in range(60 * len(ladder) + 1, 60 * len(ladder) + 200, 10):  # nothing left to take
        v, s = step(WARN, s, t, has_gpu)
        assert (v.actions, v.ready, v.recycle) == ((), False, True)


def test_critical_takes_every_remaining_rung_at_once() -> None:
    v, s = step(CRIT, LadderState(), 0)
    assert v.severity == "critical" and v.actions == tuple(Action) and (s.rung, v.ready, v.recycle) == (4, False, True)
    v, s = step(CRIT, LadderState(), 0, has_gpu=False)
    assert v.actions == (Action.GC, Action.STOP_INTAKE, Action.RECYCLE)
    # After gc under a warning, critical takes the rest without waiting for the interval.
    _, s = step(WARN, LadderState(), 0)
    v, s = step(CRIT, s, 1)
    assert v.actions == (Action.EMPTY_CACHE, Action.STOP_INTAKE, Action.RECYCLE) and s.rung == 4
    v, s = step(CRIT, s, 2)
    assert (v.actions, v.recycle) == ((), True)


def test_clearing_resets_the_ladder_before_recycle_but_not_after() -> None:
    s = LadderState()
    for t in (0, 60, 120):
        v, s = step(WARN, s, t)
    assert (s.rung, v.ready) == (3, False)
    v, s = step(OK, s, 121)
    assert (v.severity, v.reason, v.actions, v.ready, v.recycle) == ("ok", None, (), True, False)
    assert s == LadderState()
    v, s = step(WARN, s, 125)  # a fresh ladder starts again at gc, at once
    assert v.actions == (Action.GC,) and s.last_step_s == 125
    v, s = step(CRIT, s, 126)
    v, s = step(OK, s, 127)
    assert (v.severity, v.actions, v.ready, v.recycle, s.rung) == ("ok", (), False, True, 4)
    assert s.reason == "rss_bytes leak 50.0 MiB/h, limit in 0.5h"  # why the recycle was asked for


def test_an_interrupted_warning_restarts_the_step_interval() -> None:
    _, s = step(WARN, LadderState(), 0)
    _, s = step(OK, s, 30)
    v, s = step(WARN, s, 40)
    assert v.actions == (Action.GC,)
    assert step(WARN, s, 99)[0].actions == ()
    assert step(WARN, s, 100)[0].actions == (Action.EMPTY_CACHE,)


@pytest.mark.parametrize(
    ("value", "severity", "reason"),
    [
        (0.89, "ok", None),
        (0.90, "warning", "vram_bytes at 90% of limit"),
        (0.969, "warning", "vram_bytes at 97% of limit"),
        (0.97, "critical", "vram_bytes at 97% of limit"),
        (0.98, "critical", "vram_bytes at 98% of limit"),
    ],
)
def test_usage_ratios(value: float, severity: str, reason: str | None) -> None:
    usage = [Usage("vram_bytes", value * 80 * GB, 80 * GB), Usage("rss_bytes", 100 * GB, None)]
    v, _ = step(OK, LadderState(), 0, usage=usage)
    assert (v.severity, v.reason) == (severity, reason)


def test_slow_or_unbounded_leaks_are_named_but_ok() -> None:
    for trends in (leak(6.0), leak(40.0), leak(None)):
        v, s = step(trends, LadderState(), 0)
        assert (v.severity, v.actions, v.ready, s) == ("ok", (), True, LadderState())
        assert v.reason is not None and v.reason.startswith("rss_bytes leak 50.0 MiB/h")
    assert step(leak(None), LadderState(), 0)[0].reason == "rss_bytes leak 50.0 MiB/h, no limit"
    assert step(leak(0.5, leaking=False), LadderState(), 0)[0].severity == "ok"  # not credible: ignored
    fds = {"fds": Trend("fds", 120.0, 900.0, 0.95, 60, 1800.0, True, True, 5.0 * 3600)}
    usage = [Usage("vram_bytes", 0.98 * GB, GB)]
    v, _ = step({**leak(40.0), **fds}, LadderState(), 0, usage=usage)
    assert v.severity == "critical"
    assert v.reason == (  # worst first
        "vram_bytes at 98% of limit; fds leak 120.0/h, limit in 5.0h; rss_bytes leak 50.0 MiB/h, limit in 40.0h"
    )


# ----------------------------------------------------------------- hang


def test_a_stall_the_replica_reports_is_a_hang_past_its_limit() -> None:
    assert hang_reason(3.0, 0.1, inflight=1, interval_s=1.0) is None  # exactly 3 intervals: not yet
    assert hang_reason(3.001, 0.1, inflight=1, interval_s=1.0) == STALLED
    assert hang_reason(11, 0.1, inflight=2, interval_s=2, stall_missed=5) == STALLED
    assert hang_reason(10, 0.1, inflight=2, interval_s=2, stall_missed=5) is None
    assert hang_reason(1e9, 1e9, inflight=0, interval_s=1.0) is None  # idle: nothing to be stuck on


def test_silence_is_a_hang_only_past_its_own_longer_limit() -> None:
    # A late heartbeat from a replica whose work loop moves is not a stall.
    assert hang_reason(0.2, 9.0, inflight=3, interval_s=1.0) is None
    assert hang_reason(0.2, 10.0, inflight=3, interval_s=1.0) is None  # exactly 10 intervals: not yet
    assert hang_reason(0.2, 10.001, inflight=3, interval_s=1.0) == SILENT
    assert hang_reason(0.2, 4.1, inflight=3, interval_s=1.0, silent_missed=4) == SILENT
    assert hang_reason(0.0, None, inflight=4, interval_s=1.0) is None  # no heartbeat seen yet
    assert hang_reason(5.0, 20.0, inflight=1, interval_s=1.0) == STALLED  # the replica's own word first


def test_hang_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        hang_reason(1.0, 1.0, 1, 0)
    with pytest.raises(ValueError, match="stall_missed"):
        hang_reason(1.0, 1.0, 1, 1.0, stall_missed=0)
    with pytest.raises(ValueError, match="silent_missed"):
        hang_reason(1.0, 1.0, 1, 1.0, silent_missed=0)
