"""The soak report on recorded sample data (tests/unit/data/soak_sample).

The sample is a small hand-made soak output in Locust 2.47's exact CSV layout
(``locust_stats.csv``, ``locust_stats_history.csv`` with ``--csv-full-history``,
``locust_failures.csv``), the locustfile's ``report.json``, the soak's ``run.json``
and ``status.jsonl`` (eight samples 10 s apart, one of them a failed poll). Every
number asserted below can be worked out by hand from those files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loadtest import report
from loadtest.report import (
    PLOTS,
    ReportError,
    build,
    level_summary,
    load,
    lost_capacity,
    outcome_timeline,
    parse_name,
    recycle_events,
    replica_count_table,
    rss_table,
    run_duration_s,
    shed_rows,
    shed_totals,
    sheds_by_criticality,
    status_sample,
    tenant_kind_table,
)

SAMPLE = Path(__file__).parent / "data" / "soak_sample"
T0 = 1795338000.0


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A copy of the sample: build() writes beside its inputs."""
    dst = tmp_path / "soak"
    shutil.copytree(SAMPLE, dst)
    return dst


@pytest.fixture
def data():
    return load(SAMPLE)


def test_parse_name() -> None:
    assert parse_name("gold plain") == ("gold", "plain", None)
    assert parse_name("free stream shed:QUOTA_EXCEEDED") == ("free", "stream", "QUOTA_EXCEEDED")
    assert parse_name("Aggregated") is None
    assert parse_name("gold batch") is None


def test_sample_loads_without_notes_but_the_failed_poll(data) -> None:
    assert len(data.stats) == 10  # nine names + Aggregated
    assert len(data.history) == 1 + 3 * 10  # the empty first row, then three full rounds
    assert len(data.samples) == 8
    assert data.notes == ["`status.jsonl`: 1 of 8 sample(s) recorded a failed poll."]
    assert data.t0_s == T0
    assert data.time_scale == 96.0


def test_duration_is_the_history_span(data) -> None:
    assert run_duration_s(data.history, data.stats) == 100.0
    # without a history: the Aggregated count over its rate (507 / 5.07 s⁻¹)
    assert run_duration_s([], data.stats) == pytest.approx(100.0)
    assert run_duration_s([], []) is None


def test_tenant_kind_table(data) -> None:
    rows = {(r.tenant, r.kind): r for r in tenant_kind_table(data.stats, 100.0)}
    assert list(rows) == [
        ("free", "plain"),
        ("free", "stream"),
        ("gold", "plain"),
        ("gold", "stream"),
        ("free", "all"),
        ("gold", "all"),
        ("all", "all"),
    ]
    fp = rows[("free", "plain")]
    # 40 answered (2 of them failed) + 6 OVERLOADED + 10 QUOTA_EXCEEDED sheds
    assert (fp.requests, fp.ok, fp.shed, fp.failed) == (56, 38, 16, 2)
    assert fp.success_ratio == pytest.approx(38 / 56)
    assert fp.shed_ratio == pytest.approx(16 / 56)
    assert (fp.p50_ms, fp.p95_ms, fp.p99_ms) == (120, 480, 900)
    assert fp.goodput_per_s == pytest.approx(0.38)

    fs = rows[("free", "stream")]
    assert (fs.requests, fs.ok, fs.shed, fs.failed) == (24, 20, 4, 0)
    gp = rows[("gold", "plain")]
    assert (gp.requests, gp.ok, gp.shed, gp.failed) == (305, 297, 5, 3)
    assert (gp.p50_ms, gp.p95_ms, gp.p99_ms) == (110, 420, 800)
    assert gp.goodput_per_s == pytest.approx(2.97)
    gs = rows[("gold", "stream")]
    assert (gs.requests, gs.ok, gs.shed, gs.failed) == (122, 119, 2, 1)
    assert (gs.p50_ms, gs.p95_ms, gs.p99_ms) == (230, 650, 950)

    free, gold, total = rows[("free", "all")], rows[("gold", "all")], rows[("all", "all")]
    assert (free.requests, free.ok, free.shed, free.failed) == (80, 58, 20, 2)
    assert (gold.requests, gold.ok, gold.shed, gold.failed) == (427, 416, 7, 4)
    assert (total.requests, total.ok, total.shed, total.failed) == (507, 474, 27, 6)
    assert total.requests == next(r.requests for r in data.stats if r.name == "Aggregated")
    assert total.goodput_per_s == pytest.approx(4.74)
    assert total.p50_ms is None  # Locust's percentiles do not merge
    # no duration: no goodput, the counts stand
    assert tenant_kind_table(data.stats, None)[0].goodput_per_s is None


def test_tenant_kind_table_with_only_sheds() -> None:
    rows = report.parse_stats(
        [
            "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
            "Max Response Time,Average Content Size,Requests/s,Failures/s,"
            "50%,66%,75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%",
            "POST,free plain shed:KILL_SWITCH,7,0,2,2,1,3,40,0.7,0.0,2,2,2,2,3,3,3,3,3,3,3",
        ]
    )
    fp = tenant_kind_table(rows, 10.0)[0]
    assert (fp.requests, fp.ok, fp.shed, fp.failed, fp.success_ratio) == (7, 0, 7, 0, 0.0)
    assert fp.p50_ms is None  # the refusals' latency is not the service's


def test_sheds_by_reason(data) -> None:
    assert shed_totals(data.stats) == {"QUOTA_EXCEEDED": 14, "OVERLOADED": 11, "MODEL_UNAVAILABLE": 2}
    assert list(shed_totals(data.stats)) == ["QUOTA_EXCEEDED", "OVERLOADED", "MODEL_UNAVAILABLE"]
    assert [(s.code, s.tenant, s.kind, s.count) for s in shed_rows(data.stats)] == [
        ("QUOTA_EXCEEDED", "free", "plain", 10),
        ("OVERLOADED", "free", "plain", 6),
        ("OVERLOADED", "gold", "plain", 5),
        ("QUOTA_EXCEEDED", "free", "stream", 4),
        ("MODEL_UNAVAILABLE", "gold", "stream", 2),
    ]


def test_sheds_by_criticality(data) -> None:
    by_crit = sheds_by_criticality(data.report)
    assert by_crit == {
        "critical": {"MODEL_UNAVAILABLE": 2, "OVERLOADED": 1},
        "sheddable_plus": {"OVERLOADED": 6, "QUOTA_EXCEEDED": 8},
        "sheddable": {"OVERLOADED": 4, "QUOTA_EXCEEDED": 6},
    }
    # the locustfile's counts and Locust's shed names agree
    assert sum(sum(v.values()) for v in by_crit.values()) == sum(shed_totals(data.stats).values())
    assert sheds_by_criticality(None) == {}
    assert (
        sheds_by_criticality({"sheds": [{"criticality": "critical", "code": "OVERLOADED", "count": "x"}, "junk"]}) == {}
    )


def test_level_summary_sample_by_sample(data) -> None:
    # levels at +5, +15, ..., +65 s: 0 0 1 2 1 0 (failed poll at +60: skipped) 0
    lvl = level_summary(data.samples)
    assert lvl.seconds_by_level == {0: 30.0, 1: 20.0, 2: 10.0}
    assert (lvl.changes, lvl.max_level, lvl.samples) == (4, 2, 7)
    assert lvl.total_s == 60.0

    def s(t: float, level: int) -> dict:
        return {"t_s": t, "level": level}

    assert level_summary([]).seconds_by_level == {}
    assert level_summary([s(0, 3)]).seconds_by_level == {3: 0.0}  # one sample: seen, no duration
    steps = [s(0, 0), s(1, 0), s(2, 1), s(3, 1), s(4, 0), s(5, 4)]
    for n, expected in [
        (2, {0: 1.0}),
        (3, {0: 2.0, 1: 0.0}),
        (4, {0: 2.0, 1: 1.0}),
        (5, {0: 2.0, 1: 2.0}),
        (6, {0: 3.0, 1: 2.0, 4: 0.0}),
    ]:
        assert level_summary(steps[:n]).seconds_by_level == expected
    assert level_summary(steps).changes == 3


def test_recycle_events_are_deduplicated(data) -> None:
    events = recycle_events(data.samples)
    assert [(e["outcome"], e["replica_id"], e["at_s"] - T0) for e in events] == [
        ("started", "k3z9w1qp", 40.0),
        ("completed", "k3z9w1qp", 52.0),
    ]
    assert events[1]["duration_s"] == 12.0


def test_rss_per_replica(data) -> None:
    rows = {r.replica_id: r for r in rss_table(data.samples)}
    assert list(rows) == ["k3z9w1qp", "f5n1v3ue", "m2c7x0ad", "p8r4t6yb"]  # first seen first
    old = rows["k3z9w1qp"]
    assert (old.deployment, old.samples, old.min_mb, old.max_mb, old.last_mb, old.growth_mb) == (
        "BallastModel",
        5,
        500.0,
        560.0,
        560.0,
        60.0,
    )
    assert (old.first_seen_s - T0, old.last_seen_s - T0, old.max_age_s) == (5.25, 45.25, 21040.0)
    assert (rows["m2c7x0ad"].samples, rows["m2c7x0ad"].min_mb, rows["m2c7x0ad"].max_mb) == (4, 470.0, 479.0)
    assert (rows["p8r4t6yb"].samples, rows["p8r4t6yb"].min_mb, rows["p8r4t6yb"].max_mb) == (2, 480.0, 482.5)
    fb = rows["f5n1v3ue"]
    assert (fb.deployment, fb.samples, fb.growth_mb) == ("BallastFallbackModel", 7, 0.0)


def test_replica_counts(data) -> None:
    rows = {r.deployment: r for r in replica_count_table(data.samples)}
    model = rows["BallastModel"]
    assert (model.desired_min, model.desired_max, model.running_min, model.running_max) == (1, 2, 1, 2)
    assert model.short_s == 10.0  # desired 2 at +25 s, running 2 from +35 s
    fb = rows["BallastFallbackModel"]
    assert (fb.desired_min, fb.desired_max, fb.running_min, fb.running_max, fb.short_s) == (1, 1, 1, 1, 0.0)


def test_outcome_timeline(data) -> None:
    tl = outcome_timeline(data.history)
    assert [t - T0 for t, _ in tl["ok"]] == [31.0, 61.0, 101.0]
    # the last 40 s: 507 - 329 requests, of them 27 - 17 sheds and 6 - 4 failures
    assert tl["shed"][-1][1] == pytest.approx(10 / 40, abs=1e-5)
    assert tl["failed"][-1][1] == pytest.approx(2 / 40, abs=1e-5)
    assert tl["ok"][-1][1] == pytest.approx((178 - 10 - 2) / 40, abs=1e-5)
    p99 = report.latency_by_name(data.history)
    assert list(p99) == ["free plain", "free stream", "gold plain", "gold stream"]  # no shed names
    assert p99["gold plain"] == [(T0 + 31, 800.0), (T0 + 61, 800.0), (T0 + 101, 800.0)]
    agg = report.aggregated_timeline(data.history)
    assert agg[-1].rps == pytest.approx(178 / 40, abs=1e-5)


def test_build_writes_markdown_and_plots(out: Path) -> None:
    path = build(out)
    assert path == out / "report.md"
    for name in PLOTS:
        png = out / name
        assert png.is_file() and png.stat().st_size > 1000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = path.read_text()
    for section in (
        "# Ballast soak report",
        "## Requests per tenant and kind",
        "## Sheds by reason",
        "## Sheds by criticality",
        "## Degradation level",
        "## Replicas",
        "## RSS per replica",
        "## Recycle events",
        "## Faults injected",
        "## Failures",
    ):
        assert section in md, section
    for name in PLOTS:
        assert f"]({name})" in md, name
    assert "| gold | plain | 305 | 297 | 5 | 3 | 97.38 % | 1.64 % | 110 | 420 | 800 | 2.97 |" in md
    assert "| all | all | 507 | 474 | 27 | 6 | 93.49 % | 5.33 % | — | — | — | 4.74 |" in md
    assert "| QUOTA_EXCEEDED | 14 | 2.76 % |" in md
    assert "| criticality (claimed) | MODEL_UNAVAILABLE | OVERLOADED | QUOTA_EXCEEDED | total |" in md
    assert "| sheddable_plus | 0 | 6 | 8 | 14 |" in md
    assert "| L0 | 30.0 s | 50.00 % |" in md and "Highest level: L2; level changes: 4" in md
    assert "| k3z9w1qp | BallastModel | 5 | 500.0 | 560.0 | 60.0 | 560.0 |" in md
    assert "| +40.0 s (sim 01.07 h) | started | BallastModel | k3z9w1qp | max_age | — |" in md
    assert "| BallastModel | 1–2 | 1–2 | 10.0 s |" in md
    assert "| 18.00 | 11.3 min | kill_switch_off | off | no answer | ConnectError" in md
    assert "504 DEADLINE_EXCEEDED" in md
    assert "1 of 8 sample(s) recorded a failed poll" in md


def test_rebuild_drops_plots_that_lost_their_data(out: Path) -> None:
    build(out)
    (out / "status.jsonl").unlink()
    md = build(out).read_text()
    assert not (out / "level.png").exists() and (out / "requests.png").is_file()
    assert "`status.jsonl` is missing" in md
    assert "_No plot of degradation level over time: no status samples with a level._" in md


def test_empty_folder_gives_a_report_that_says_what_is_missing(tmp_path: Path) -> None:
    md = build(tmp_path).read_text()
    for name in (
        "locust_stats.csv",
        "locust_stats_history.csv",
        "locust_failures.csv",
        "status.jsonl",
        "report.json",
        "run.json",
    ):
        assert f"`{name}` is missing" in md, name
    assert "_No request data (see the missing inputs above)._" in md
    assert "_No `report.json`" in md
    assert not any((tmp_path / name).exists() for name in PLOTS)


def test_broken_files_become_notes(tmp_path: Path) -> None:
    (tmp_path / "locust_stats.csv").write_text("not,a,locust,file\n1,2,3,4\n")
    (tmp_path / "locust_stats_history.csv").write_text("")
    (tmp_path / "report.json").write_text("{cut")
    (tmp_path / "run.json").write_text("[1, 2]")
    lines = (SAMPLE / "status.jsonl").read_text().splitlines()
    (tmp_path / "status.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:40] + "\n[]\n")
    data = load(tmp_path)
    assert len(data.samples) == 3
    notes = "\n".join(data.notes)
    assert "`locust_stats.csv` could not be parsed (locust_stats.csv: not Locust's layout" in notes
    assert "`locust_stats_history.csv` could not be parsed" in notes
    assert "`report.json` is not valid JSON" in notes
    assert "`run.json` is not a JSON object" in notes
    assert "`status.jsonl`: 2 unreadable line(s) skipped." in notes
    md = build(tmp_path).read_text()
    assert "## Degradation level" in md and (tmp_path / "level.png").is_file()


def test_missing_folder_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ReportError, match="no such directory"):
        build(tmp_path / "nope")
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "report: " in capsys.readouterr().err
    assert report.main([]) == 2


def test_main_regenerates(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.md")


def test_status_sample_compacts_the_admin_answers() -> None:
    lost = {"migrated": 2, "not_migrated": 1, "streams_carried_on": 0}
    status = {
        "models": {
            "a": {"level": 0, "source": "snapshot", "lost_capacity": lost},
            "b": {"level": 1, "source": "snapshot", "constraints": {"max_tokens": 256}, "lost_capacity": lost},
        },
        "snapshot": {
            "epoch": "e",
            "version": 7,
            "age_s": 0.4,
            "models": {
                "a": {"level": 0, "target_level": 0, "reason": "normal", "inputs": {"queue_length": 1}},
                "b": {
                    "level": 1,
                    "target_level": 2,
                    "reason": "queue_length 120 >= 100",
                    "inputs": {"queue_length": 120, "queue_wait_p95_ms": 310.5, "gpu_util_pct": None, "flag": True},
                },
            },
        },
        "replicas": {"BallastModel": {"desired": 2, "running": 1, "autoscale": {"mode": "panic"}}},
        "recycle": {
            "in_flight": [{"replica_id": "a"}],
            "availability": {"expected": 0.99, "measured": 1.0, "out_s": 3.0},
        },
    }
    replicas = {
        "replicas": [
            {
                "replica_id": f"r{i}",
                "deployment": "BallastModel",
                "age_s": 12.5,
                "queued": 0,
                "running": 1,
                "ready": True,
                "draining": False,
                "watchdog": {"rss_bytes": 512 * 1024 * 1024, "threads": 40, "trends": {"rss": {}}},
            }
            for i in range(100)
        ]
        + [{"replica_id": "nowd", "deployment": "BallastModel", "watchdog": None}],
        "events": [
            {
                "at_s": float(i),
                "outcome": "completed",
                "replica_id": f"r{i}",
                "deployment": "BallastModel",
                "reason": "max_age",
                "duration_s": 9.0,
                "extra": "x",
            }
            for i in range(30)
        ],
        "leases": [{"id": "l"}],
    }
    s = status_sample(100.0, status, replicas)
    assert (s["model"], s["level"], s["target_level"]) == ("b", 1, 2)  # the model at the highest level
    assert s["reason"] == "queue_length 120 >= 100"
    assert s["lost_capacity"] == {"migrated": 4, "not_migrated": 2, "streams_carried_on": 0}  # every model's
    assert s["inputs"] == {"queue_length": 120, "queue_wait_p95_ms": 310.5, "gpu_util_pct": None}
    assert s["deployments"] == {"BallastModel": {"desired": 2, "running": 1}}
    assert s["recycles_in_flight"] == 1 and s["availability"] == {"expected": 0.99, "measured": 1.0}
    assert len(s["replicas"]) == report.MAX_SAMPLE_REPLICAS
    assert s["replicas"][0] == {
        "id": "r0",
        "deployment": "BallastModel",
        "rss_mb": 512.0,
        "age_s": 12.5,
        "ready": True,
        "draining": False,
    }
    assert [e["replica_id"] for e in s["events"]] == [f"r{i}" for i in range(20, 30)]
    assert "extra" not in s["events"][0]
    # a failed poll: the time and why, nothing else
    assert status_sample(5.0, None, None, "/v1/status: ConnectError") == {
        "t_s": 5.0,
        "error": "/v1/status: ConnectError",
    }
    # what the sampler writes, the report reads
    rows = rss_table([s])
    assert len(rows) == report.MAX_SAMPLE_REPLICAS and rows[0].max_mb == 512.0


def test_lost_capacity_is_the_last_sample_that_saw_any() -> None:
    samples = [
        {"lost_capacity": {"migrated": 0, "not_migrated": 0}},
        {"lost_capacity": {"migrated": 3, "not_migrated": 1}},
        {"level": 0},
        {"error": "a poll failed"},
    ]
    assert lost_capacity(samples) == {"migrated": 3, "not_migrated": 1}
    assert lost_capacity([{"lost_capacity": {"migrated": 0}}, {}]) == {}
