"""loadtest.bench_batch's pure parts: the day's rate and send times, the backlog's size and
files, the spare accounting interval by interval, exactly-once counting from two JSONL
files, the table and the line a script reads. The run needs a Ray Serve stack with the
Batch API (``make bench-batch``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ballast.batch.lines import parse_batch_file
from ballast.config import load_config
from loadtest.bench_batch import (
    BATCH_KEY,
    BATCH_TENANT,
    Answer,
    BatchLine,
    DayFigures,
    DayPlan,
    DayRun,
    LineCount,
    Poll,
    backlog_lines,
    batch_input,
    batch_sizes,
    bench_batch_data,
    check_targets,
    count_lines,
    day_record,
    p99_ratio,
    parse_args,
    poll_times,
    report,
    spare_accounting,
    table,
)
from loadtest.shapes import DEFAULT_DIURNAL, DiurnalProfile

FLAT = DiurnalProfile(((0, 0.5), (24, 0.5)))


# ---------------------------------------------------------------------------- the day


def test_the_rate_follows_the_compressed_day():
    plan = DayPlan(capacity_rps=20.0, day_s=480.0, peak_ratio=0.9)
    assert plan.time_scale.factor == 180.0  # 86,400 simulated seconds in 480 real ones
    assert plan.rate_at(0.0) == pytest.approx(0.9 * 20 * 0.25)  # midnight
    assert plan.rate_at(60.0) == pytest.approx(0.9 * 20 * 0.08)  # 03:00, the valley
    assert plan.rate_at(240.0) == pytest.approx(0.9 * 20)  # noon, the peak
    assert plan.rate_at(400.0) == pytest.approx(0.9 * 20 * 0.90)  # 20:00, the evening spike
    assert max(plan.rate_at(t) for t in range(481)) == pytest.approx(18.0)  # never past peak x C


def test_send_times_are_evenly_spaced_at_a_steady_rate_and_the_same_every_call():
    plan = DayPlan(capacity_rps=10.0, day_s=60.0, peak_ratio=1.0, profile=FLAT)  # 5 req/s all day
    times = plan.arrivals()
    assert len(times) == 300 == round(plan.expected_requests())
    assert times[0] == pytest.approx(0.1)  # the first at half a request's interval
    assert all(b - a == pytest.approx(0.2) for a, b in zip(times, times[1:]))
    assert times == plan.arrivals()  # both days send the same
    assert plan.spare_requests() == pytest.approx(10 * 60 - 300)


def test_send_times_follow_the_curve():
    plan = DayPlan(capacity_rps=20.0, day_s=480.0)
    times = plan.arrivals()
    assert len(times) == round(plan.expected_requests())
    assert all(0 <= a < b < 480 for a, b in zip(times, times[1:]))
    for t in (60.0, 240.0, 400.0):  # the gap near t is 1 / rate(t)
        i = next(k for k, s in enumerate(times) if s >= t)
        assert times[i + 1] - times[i] == pytest.approx(1 / plan.rate_at(t), rel=0.05)
    # The profile's mean over the day, by its trapezoids, times peak x C x day.
    pts = DEFAULT_DIURNAL.points
    mean = sum((a.fraction + b.fraction) / 2 * (b.hour - a.hour) for a, b in zip(pts, pts[1:])) / 24
    assert plan.expected_requests() == pytest.approx(0.9 * 20 * 480 * mean, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_rps": 0.0, "day_s": 60.0},
        {"capacity_rps": 10.0, "day_s": 0.0},
        {"capacity_rps": 10.0, "day_s": 60.0, "peak_ratio": 1.1},
        {"capacity_rps": 10.0, "day_s": 60.0, "peak_ratio": 0.0},
        {"capacity_rps": 10.0, "day_s": 0.5},  # a day in under a second: past TimeScale's bound
    ],
)
def test_a_bad_day_is_refused(kwargs):
    with pytest.raises(ValueError):
        DayPlan(**kwargs)


def test_polls_every_interval_and_at_the_end():
    assert poll_times(5.5, 1.0) == [1.0, 2.0, 3.0, 4.0, 5.0, 5.5]
    assert poll_times(3.0, 1.0) == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        poll_times(3.0, 0.0)


# ---------------------------------------------------------------------------- the backlog


def test_the_backlog_outlasts_the_days_spare():
    plan = DayPlan(capacity_rps=10.0, day_s=60.0, peak_ratio=1.0, profile=FLAT)  # spare: 300 requests
    assert backlog_lines(plan, 1.5) == 450
    assert backlog_lines(plan, 1.0) == 300
    with pytest.raises(ValueError):
        backlog_lines(plan, 0.0)


def test_lines_are_split_evenly_within_a_files_bound():
    assert batch_sizes(10, 4, 100) == [3, 3, 2, 2]
    assert batch_sizes(8, 4, 2) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="more batches"):
        batch_sizes(9, 4, 2)
    with pytest.raises(ValueError):
        batch_sizes(3, 4, 100)  # more batches than lines


def test_a_batch_file_is_what_the_batch_api_accepts():
    ids, data = batch_input(2, 5, "tiny-decoder", "The quick brown fox", 32)
    assert ids == [f"b2-{i:06d}" for i in range(5)]
    parsed = parse_batch_file(data, "/v1/completions", 50_000, lambda body: body["model"])
    assert not parsed.errors and parsed.model == "tiny-decoder"
    assert [g.custom_id for g in parsed.lines] == ids
    assert parsed.lines[0].body() == {"model": "tiny-decoder", "prompt": "The quick brown fox", "max_tokens": 32}


# ---------------------------------------------------------------------------- spare accounting


def _answer(done_s: float, tokens: int, status: int = 200, latency_s: float = 0.1) -> Answer:
    return Answer("critical", status, "OK" if status == 200 else "OVERLOADED", latency_s, done_s, tokens)


def test_spare_is_capacity_less_interactive_each_interval_and_batch_fills_it():
    # C: 100 tokens/s; polls each second; a batch line is 10 tokens.
    polls = [Poll(1.0, 2, 0, 0), Poll(2.0, 5, 0, 0), Poll(3.0, 5, 0, 1), Poll(4.0, 9, 1, 0)]
    answers = [_answer(0.5, 30), _answer(0.9, 20), _answer(2.5, 150), _answer(3.2, 40), _answer(4.5, 999)]
    meter = spare_accounting(polls, answers, capacity_tokens_per_s=100.0, tokens_per_line=10.0)
    assert meter.intervals == 4
    # Interval by interval: spare 50, 100, 0 (150 interactive: clipped, not negative), 60.
    assert meter.spare_tokens == pytest.approx(50 + 100 + 0 + 60)
    # Batch: 2, 3, 0, 4 lines completed; the answer after the last poll is outside the day.
    assert meter.batch_tokens == 90
    assert meter.interactive_tokens == 30 + 20 + 150 + 40
    assert meter.spare_used() == pytest.approx(90 / 210)


def test_a_failed_poll_carries_its_lines_to_the_next():
    polls = [Poll(1.0, 2, 0, 0), Poll(2.0, None, None, None), Poll(3.0, 6, 0, 0)]
    meter = spare_accounting(polls, [], capacity_tokens_per_s=10.0, tokens_per_line=1.0)
    assert (meter.spare_tokens, meter.batch_tokens) == (30.0, 6)


def test_batch_tokens_are_rounded_on_the_running_total():
    polls = [Poll(float(t), t, 0, 0) for t in range(1, 4)]  # one line a second
    meter = spare_accounting(polls, [], capacity_tokens_per_s=10.0, tokens_per_line=2.5)
    assert meter.batch_tokens == 8  # round(3 x 2.5) = 8, not round(2.5) x 3 = 6


def test_polls_out_of_order_are_refused():
    with pytest.raises(ValueError):
        spare_accounting([Poll(2.0, 0, 0, 0), Poll(1.0, 0, 0, 0)], [], 10.0, 1.0)


def test_without_a_backlog_spare_used_is_zero():
    meter = spare_accounting([Poll(1.0, 0, 0, 0)], [_answer(0.5, 10)], 100.0, 0.0)
    assert meter.spare_used() == 0.0


# ---------------------------------------------------------------------------- exactly once


def _out(cid: str, tokens: int = 32) -> str:
    body = {"choices": [{"text": "x"}], "usage": {"completion_tokens": tokens}}
    return json.dumps({"custom_id": cid, "response": {"status_code": 200, "body": body}, "error": None})


def _err(cid: str) -> str:
    return json.dumps({"custom_id": cid, "response": None, "error": {"code": "x", "message": "y"}})


def test_every_line_once_is_nothing_lost_nothing_twice():
    ids = ["a", "b", "c", "d"]
    out = "\n".join(_out(c) for c in ("a", "b", "d")) + "\n"
    n = count_lines(ids, out, _err("c") + "\n", "completed")
    assert n == LineCount(total=4, done=3, failed=1, lost=0, cancelled=0, twice=0, stray=0, tokens=96)
    assert n.tokens_per_line == 32.0


def test_a_line_in_both_files_or_twice_in_one_is_twice():
    ids = ["a", "b", "c"]
    out = "\n".join([_out("a"), _out("b"), _out("b")])
    n = count_lines(ids, out, _err("a"), "completed")
    assert (n.twice, n.done, n.failed, n.lost) == (2, 2, 0, 1)  # a in both, b twice; c in neither


def test_a_missing_line_is_lost_unless_its_batch_was_cancelled():
    ids = ["a", "b", "c"]
    assert count_lines(ids, _out("a"), "", "completed").lost == 2
    assert count_lines(ids, _out("a"), "", "expired").lost == 2
    cancelled = count_lines(ids, _out("a"), "", "cancelled")
    assert (cancelled.lost, cancelled.cancelled, cancelled.done) == (0, 2, 1)


def test_a_batch_that_never_ended_loses_every_line():
    n = count_lines(["a", "b"], _out("a"), "", None)
    assert (n.lost, n.done) == (2, 0)


def test_lines_of_no_input_and_unreadable_lines_are_stray():
    out = "\n".join([_out("a"), _out("zz"), "{not json", json.dumps({"custom_id": 7}), ""])
    n = count_lines(["a"], out, "", "completed")
    assert (n.done, n.stray, n.twice) == (1, 3, 0)


def test_counts_add_up_over_batches():
    a = count_lines(["a"], _out("a", 10), "", "completed")
    b = count_lines(["b", "c"], _out("b", 20), "", "cancelled")
    total = a + b
    assert (total.total, total.done, total.cancelled, total.tokens) == (3, 2, 1, 30)
    assert total.tokens_per_line == 15.0


# ---------------------------------------------------------------------------- the line and the table


def test_the_line_is_the_issues_and_reads_back():
    line = BatchLine(1234, 0, 0, 0.8123, 1.0567, 3)
    text = line.render()
    assert text == (
        "batch: lines_done=1234 lines_lost=0 lines_twice=0 spare_used=0.812 "
        "interactive_p99_ratio=1.057 interactive_refused_delta=3"
    )
    assert BatchLine.parse(text) == BatchLine(1234, 0, 0, 0.812, 1.057, 3)
    assert BatchLine.parse("a table\nbatch: noise before\n" + text + "\n") == BatchLine.parse(text)


def test_a_figure_that_is_no_number_is_nan_and_a_negative_delta_stays():
    line = BatchLine(0, 5, 0, None, None, -2)
    text = line.render()
    assert "spare_used=nan interactive_p99_ratio=nan interactive_refused_delta=-2" in text
    assert BatchLine.parse(text) == line


@pytest.mark.parametrize(
    "text",
    [
        "no line here",
        "batch: lines_done=1 lines_lost=0",
        "batch: lines_lost=0 lines_done=1 lines_twice=0 spare_used=1 interactive_p99_ratio=1 "
        "interactive_refused_delta=0",
    ],
)
def test_a_line_that_is_not_the_issues_is_refused(text):
    with pytest.raises(ValueError):
        BatchLine.parse(text)


def test_targets_at_their_bounds():
    met = {name: ok for name, ok, _ in check_targets(BatchLine(10, 0, 0, 0.7, 1.2, 5), 1000, gpu=False)}
    assert all(met.values())
    missed = check_targets(BatchLine(10, 1, 0, 0.699, 1.201, 6), 1000, gpu=False)
    assert not any(ok for _, ok, _ in missed)
    gpu = {name: ok for name, ok, _ in check_targets(BatchLine(10, 0, 0, 0.7, 1.06, 0), 1000, gpu=True)}
    assert gpu == {
        "lines_lost = lines_twice = 0": True,
        "spare_used >= 0.7": True,
        "interactive p99 ratio <= 1.05": False,
        "interactive refused delta <= 0.5 % of 1000 = 5.0": True,
    }
    assert not check_targets(BatchLine(10, 0, 0, None, None, 0), 1000, gpu=False)[1][1]  # no spare: not met


def _day(name: str, latencies_ms: list[float], refused: int, lines: int = 0) -> DayFigures:
    answers = [_answer(1.0, 32, latency_s=ms / 1000) for ms in latencies_ms]
    answers += [_answer(1.0, 0, status=503) for _ in range(refused)] + [_answer(1.0, 0, status=504)]
    polls = [Poll(1.0, lines, 0, 1), Poll(2.0, lines, 0, 0)]
    meter = spare_accounting(polls, answers, 1000.0, 32.0)
    return DayFigures.of(name, answers, polls, meter, [0.001, 0.002], 50.0)


def test_a_days_figures():
    d = _day("with backlog", [float(i) for i in range(1, 101)], refused=2, lines=10)
    assert (d.requests, d.ok, d.refused, d.other) == (103, 100, 2, 1)
    assert (d.p50_ms, d.p99_ms) == (51.0, 100.0)
    assert d.level_s == 1.0  # level 1 at the first poll, 0 at the second
    assert d.batch_lines == 10
    # C 1,000 tokens/s: the first second's 3,200 interactive tokens leave no spare, the second
    # leaves 1,000; the 10 lines of 32 tokens came in the first.
    assert d.spare_used == pytest.approx(320 / 1000)


def test_the_table_and_the_report_end_with_the_line():
    without = _day("without backlog", [10.0] * 100, refused=1)
    with_b = _day("with backlog", [11.0] * 100, refused=3, lines=4)
    assert p99_ratio(with_b, without) == pytest.approx(1.1)
    rows = table([without, with_b])
    assert rows[0].split()[:3] == ["day", "requests", "ok"] and len(rows) == 3
    printed: list[str] = []
    counted = count_lines(["a", "b"], _out("a"), _err("b"), "completed")
    plan = DayPlan(10.0, 60.0)
    rc = report(10.0, plan, [without, with_b], counted, {"batch_1": "completed"}, DayRun(), False, printed.append)
    assert rc == 0
    line = BatchLine.parse(printed[-1])
    assert (line.lines_done, line.lines_lost, line.lines_twice, line.interactive_refused_delta) == (1, 0, 0, 2)
    assert line.interactive_p99_ratio == pytest.approx(1.1)
    lost = count_lines(["a", "b"], _out("a"), "", "completed")
    assert report(10.0, plan, [without, with_b], lost, {"b": "completed"}, DayRun(), False, printed.append) == 1


# ---------------------------------------------------------------------------- config and options


def test_the_stack_config_has_the_store_and_the_backlogs_tenant(tmp_path: Path):
    pw = tmp_path / "password"
    pw.write_text("secret")
    cfg = load_config(bench_batch_data("cluster/local.yaml", "redis://127.0.0.1:6390/0", str(pw)))
    assert cfg.batch.enabled and cfg.batch.store_url == "redis://127.0.0.1:6390/0"
    assert cfg.batch.store_password_file == str(pw)
    assert cfg.auth.demo_keys[BATCH_KEY] == BATCH_TENANT
    assert cfg.tenants[BATCH_TENANT].rate_tokens_per_s is None  # no quota: only spare capacity limits it
    assert cfg.deployments.model.min_replicas == cfg.deployments.model.max_replicas == 1


def test_options_are_checked_and_the_smoke_is_short():
    smoke = parse_args(["--smoke"])
    assert (smoke.day_s, smoke.batches, smoke.drain_s) == (60.0, 2, 60.0)
    full = parse_args([])
    assert full.day_s * 2 + full.drain_s + full.cancel_wait_s < 30 * 60  # the whole run stays bounded
    for bad in (["--peak-ratio", "1.5"], ["--day-s", "0"], ["--batches", "0"], ["--day-s", "7200"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert math.isfinite(full.backlog_factor) and full.backlog_factor > 1  # the backlog outlasts the day


def test_a_days_raw_figures_are_json():
    run = DayRun([_answer(1.23456, 32)], [Poll(1.0, 3, 0, None)], [0.002], 48.5, None)
    doc = json.loads(json.dumps(day_record(run)))
    assert doc["answers"] == [["critical", 200, "OK", 0.1, 1.235, 32]]
    assert doc["polls"] == [[1.0, 3, 0, None]]
    assert doc["machine_rps"] == 48.5 and doc["backlog_out_s"] is None
