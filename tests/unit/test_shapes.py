"""Load shapes, the fault schedule and runner, and the locustfile's response validation.

The shapes are walked second by second (real run time) and minute by minute
(simulated time of day). The fault runner plays against a real ``http.server`` on
an ephemeral loopback port that records what it receives (no mock). The
locustfile is imported with ``LOCUST_SKIP_MONKEY_PATCH`` set so that gevent does
not patch this test process; its validation functions are pure.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from loadtest.faults import (
    DEFAULT_SOAK,
    FaultEvent,
    FaultRunner,
    FaultSchedule,
    check_loopback,
    leak_mb_per_s,
)
from loadtest.shapes import (
    DAY_S,
    DEFAULT_DIURNAL,
    DiurnalPoint,
    DiurnalProfile,
    DiurnalShape,
    Stage,
    StepShape,
    TimeScale,
    diurnal,
    step_burst,
)

H = 3600.0


# =========================================================================== diurnal


def test_trough_around_three_and_peak_at_noon():
    by_minute = [(m, diurnal(m * 60.0)) for m in range(24 * 60)]
    low_m, low = min(by_minute, key=lambda x: x[1])
    high_m, high = max(by_minute, key=lambda x: x[1])
    assert low_m == 3 * 60 and low == pytest.approx(0.08)
    assert high_m == 12 * 60 and high == pytest.approx(1.0)
    assert diurnal(3 * H) < diurnal(12 * H)


def test_evening_spike_is_a_sharp_local_maximum_at_eight():
    spike = diurnal(20 * H)
    assert spike == pytest.approx(0.90)
    assert diurnal(18 * H) < spike and diurnal(21 * H) < spike
    # Local maximum: every minute from 17:00 to 23:00 other than 20:00 is lower.
    for m in range(17 * 60, 23 * 60):
        if m != 20 * 60:
            assert diurnal(m * 60.0) < spike, m
    # Sharp: it falls by half within an hour after the spike.
    assert diurnal(21 * H) <= spike / 2


def test_profile_points_are_hit_exactly_and_interpolated_linearly():
    for p in DEFAULT_DIURNAL.points:
        assert diurnal(p.hour * H) == pytest.approx(p.fraction)
    # Halfway between 09:00 (0.65) and 12:00 (1.0).
    assert diurnal(10.5 * H) == pytest.approx((0.65 + 1.0) / 2)


def test_continuous_over_the_day_and_across_midnight():
    # Steepest segment of the default table: 20:00 -> 21:00, 0.45 per hour.
    max_step_per_s = 0.45 / H
    prev = diurnal(0.0)
    for s in range(1, int(DAY_S) + 1, 7):
        cur = diurnal(float(s))
        assert abs(cur - prev) <= max_step_per_s * 7 + 1e-12, s
        prev = cur
    assert diurnal(DAY_S - 1e-6) == pytest.approx(diurnal(0.0), abs=1e-9)
    assert diurnal(DAY_S + 5 * H) == pytest.approx(diurnal(5 * H))  # a second day repeats the first


def test_all_fractions_within_zero_and_one():
    for m in range(0, 24 * 60, 5):
        assert 0.0 <= diurnal(m * 60.0) <= 1.0


def test_a_custom_profile_is_just_data():
    flat = DiurnalProfile(((0, 0.5), (24, 0.5)))
    assert diurnal(7 * H, flat) == 0.5
    ramp = DiurnalProfile((DiurnalPoint(0, 0.0), DiurnalPoint(12, 1.0), DiurnalPoint(24, 0.0)))
    assert diurnal(6 * H, ramp) == pytest.approx(0.5)
    assert diurnal(18 * H, ramp) == pytest.approx(0.5)


# =========================================================================== time scale and shapes


def test_time_scale_96_runs_the_day_in_900_seconds():
    ts = TimeScale(96)
    assert ts.day_real_s == 900.0
    assert ts.sim_s(900.0) == DAY_S
    assert ts.real_s(12 * H) == 450.0
    assert TimeScale(1).day_real_s == DAY_S


def test_diurnal_shape_walks_the_scaled_day_second_by_second():
    shape = DiurnalShape(peak_users=100, time_scale=TimeScale(96))
    assert shape.duration_s == 900.0
    assert shape.tick(0.0) == (25, 10.0)  # midnight: 0.25 of the peak; spawn rate peak/10
    assert shape.tick(450.0)[0] == 100  # noon
    assert shape.tick(112.5)[0] == 8  # 03:00: the trough
    assert shape.tick(750.0)[0] == 90  # 20:00: the evening spike
    prev = shape.tick(0.0)[0]
    for t in range(1, 900):
        users, rate = shape.tick(float(t))
        assert 1 <= users <= 100
        # One real second is 96 simulated: at most 0.45/h * 96 s * 100 users ~ 1.2 users, rounded.
        assert abs(users - prev) <= 2, t
        assert rate == 10.0
        prev = users
    assert shape.tick(899.999) is not None
    assert shape.tick(900.0) is None  # the day is over: Locust stops
    assert shape.tick(5000.0) is None


def test_diurnal_shape_floor_and_start_hour():
    small = DiurnalShape(peak_users=5, time_scale=TimeScale(96), min_users=2)
    assert small.tick(112.5)[0] == 2  # 0.08 * 5 = 0.4: the floor keeps two users
    assert DiurnalShape(peak_users=5, min_users=0).tick(112.5)[0] == 0
    noon_start = DiurnalShape(peak_users=10, time_scale=TimeScale(96), start_hour=12)
    assert noon_start.tick(0.0)[0] == 10
    assert noon_start.tick(450.0)[0] == round(10 * 0.25)  # twelve simulated hours later: midnight
    assert DiurnalShape(peak_users=10, spawn_rate_per_s=3).tick(0.0)[1] == 3


def test_step_shape_walks_its_stages():
    shape = StepShape((Stage(10, 2, 1.0), Stage(5, 8, 4.0), (3, 0, 2.0)))
    assert shape.duration_s == 18
    expected = [(2, 1.0)] * 10 + [(8, 4.0)] * 5 + [(0, 2.0)] * 3
    for t, want in enumerate(expected):
        assert shape.tick(float(t)) == want, t
        assert shape.tick(t + 0.999) == want, t
    assert shape.tick(18.0) is None
    assert shape.stage_at(9.5) == Stage(10, 2, 1.0)


def test_step_burst_from_the_ratio_table():
    shape = step_burst(10)
    assert [s.users for s in shape.stages] == [2, 5, 10, 2]
    assert [s.duration_s for s in shape.stages] == [60, 60, 30, 60]
    assert shape.duration_s == 210
    assert all(s.spawn_rate >= s.users / 2 for s in shape.stages)
    fast = step_burst(10, ((30, 0.5), (30, 1.0)), time_scale=TimeScale(10))
    assert [(s.duration_s, s.users) for s in fast.stages] == [(3.0, 5), (3.0, 10)]
    assert step_burst(3, ((10, 0.0),)).stages[0].users == 0


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: DiurnalPoint(25, 0.5), "hour"),
        (lambda: DiurnalPoint(3, 1.5), "fraction"),
        (lambda: DiurnalPoint(3, math.nan), "fraction"),
        (lambda: DiurnalProfile(((0, 0.1),)), "points"),
        (lambda: DiurnalProfile(((1, 0.1), (24, 0.1))), "points"),
        (lambda: DiurnalProfile(((0, 0.1), (24, 0.2))), "points"),
        (lambda: DiurnalProfile(((0, 0.1), (12, 0.5), (12, 0.6), (24, 0.1))), "points"),
        (lambda: TimeScale(0), "time_scale"),
        (lambda: TimeScale(-96), "time_scale"),
        (lambda: TimeScale(math.inf), "time_scale"),
        (lambda: TimeScale(True), "time_scale"),
        (lambda: TimeScale(1e9), "time_scale"),
        (lambda: diurnal(math.nan), "t_s"),
        (lambda: Stage(0, 1, 1.0), "duration_s"),
        (lambda: Stage(10, -1, 1.0), "users"),
        (lambda: Stage(10, 1.5, 1.0), "users"),
        (lambda: Stage(10, 1, 0), "spawn_rate"),
        (lambda: StepShape(()), "stages"),
        (lambda: StepShape((Stage(1, 1, 1.0),)).tick(-1), "run_time_s"),
        (lambda: DiurnalShape(peak_users=0), "peak_users"),
        (lambda: DiurnalShape(peak_users=5, min_users=6), "min_users"),
        (lambda: DiurnalShape(peak_users=5, start_hour=24), "start_hour"),
        (lambda: DiurnalShape(peak_users=5, time_scale=96), "time_scale"),
        (lambda: DiurnalShape(peak_users=5).tick(-0.5), "run_time_s"),
        (lambda: step_burst(0), "peak_users"),
        (lambda: step_burst(5, ((10, 1.5),)), "share"),
        (lambda: step_burst(5, ()), "ratios"),
    ],
)
def test_shape_validation_names_the_field(build, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        build()


# =========================================================================== fault schedule


def test_schedule_is_sorted_stably_by_time():
    a = FaultEvent(50, "clear_chaos")
    b = FaultEvent(10, "start_leak", {"leak_mb_per_s": 5})
    c = FaultEvent(10, "fail_primary")
    sched = FaultSchedule((a, b, c))
    assert sched.events == (b, c, a)  # equal times keep their given order
    assert sched.end_sim_s == 50
    assert FaultSchedule(()).end_sim_s == 0


def test_default_soak_fits_one_day_and_covers_every_action():
    times = [e.at_sim_s for e in DEFAULT_SOAK.events]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < DAY_S
    assert {e.action for e in DEFAULT_SOAK.events} == {
        "kill_replica",
        "start_leak",
        "fail_primary",
        "clear_chaos",
        "kill_switch_on",
        "kill_switch_off",
    }
    # At scale 96 the kill switch's real expiry outlasts its scheduled off.
    on = next(e for e in DEFAULT_SOAK.events if e.action == "kill_switch_on")
    off = next(e for e in DEFAULT_SOAK.events if e.action == "kill_switch_off")
    assert on.args["expires_in_s"] > TimeScale(96).real_s(off.at_sim_s - on.at_sim_s)


def test_event_args_are_frozen():
    e = FaultEvent(0, "start_leak", {"leak_mb_per_s": 5})
    with pytest.raises(TypeError):
        e.args["leak_mb_per_s"] = 50  # type: ignore[index]


_ON = {"label": "x", "scope": "tenant", "value": "free", "reason": "r", "expires_in_s": 60}


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: FaultEvent(-1, "clear_chaos"), "at_sim_s"),
        (lambda: FaultEvent(math.nan, "clear_chaos"), "at_sim_s"),
        (lambda: FaultEvent(0, "reboot"), "action"),
        (lambda: FaultEvent(0, "clear_chaos", {"target": "primary"}), "args"),
        (lambda: FaultEvent(0, "start_leak", {"leak_mb": 5}), "args"),
        (lambda: FaultEvent(0, "start_leak", {}), "leak_mb_per_s"),
        (lambda: FaultEvent(0, "start_leak", {"leak_mb_per_s": 5, "leak_mb_per_sim_h": 5}), "leak_mb_per_sim_h"),
        (lambda: FaultEvent(0, "start_leak", {"leak_mb_per_sim_h": -1}), "leak_mb_per_sim_h"),
        (lambda: FaultEvent(0, "start_leak", {"leak_mb_per_s": 0}), "leak_mb_per_s"),
        (lambda: FaultEvent(0, "start_leak", {"leak_mb_per_s": 2000}), "leak_mb_per_s"),
        (lambda: FaultEvent(0, "start_leak", {"leak_mb_per_s": 5, "target": "router"}), "target"),
        (lambda: FaultEvent(0, "fail_primary", {"error_ratio": 1.5}), "error_ratio"),
        (lambda: FaultEvent(0, "fail_primary", {"error_ratio": 0}), "error_ratio"),
        (lambda: FaultEvent(0, "kill_replica", {"stall_s": 0}), "stall_s"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "label": ""}), "label"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "scope": "planet"}), "scope"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "value": None}), "value"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "scope": "global"}), "value"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "reason": " "}), "reason"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "expires_in_s": 0}), "expires_in_s"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "expires_in_s": 60.5}), "expires_in_s"),
        (lambda: FaultEvent(0, "kill_switch_on", {**_ON, "expires_in_s": 8 * 86400}), "expires_in_s"),
        (lambda: FaultEvent(0, "kill_switch_off", {}), "label"),
        (lambda: FaultSchedule((FaultEvent(0, "kill_switch_off", {"label": "x"}),)), "label"),
        # Off listed first but scheduled after: fine. Off scheduled before on: refused.
        (
            lambda: FaultSchedule(
                (FaultEvent(5, "kill_switch_on", _ON), FaultEvent(1, "kill_switch_off", {"label": "x"}))
            ),
            "label",
        ),
        (lambda: FaultSchedule((FaultEvent(0, "kill_switch_on", _ON), FaultEvent(1, "kill_switch_on", _ON))), "label"),
        (lambda: FaultSchedule(("clear_chaos",)), "events"),
    ],
)
def test_fault_validation_names_the_field(build, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        build()


def test_off_listed_before_on_but_scheduled_after_is_accepted():
    sched = FaultSchedule((FaultEvent(9, "kill_switch_off", {"label": "x"}), FaultEvent(1, "kill_switch_on", _ON)))
    assert [e.action for e in sched.events] == ["kill_switch_on", "kill_switch_off"]


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8000", "http://localhost:8123/", "http://[::1]:8000", "http://127.0.0.2", "https://LOCALHOST"],
)
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://example.com",
        "http://0.0.0.0:8000",
        "http://[::]:8000",
        "ftp://127.0.0.1",
        "127.0.0.1:8000",
        "",
    ],
)
def test_other_urls_are_refused_before_any_request(url):
    with pytest.raises(ValueError, match="^base_url:"):
        check_loopback(url)
    with pytest.raises(ValueError, match="^base_url:"):
        FaultRunner(DEFAULT_SOAK, url)


# =========================================================================== fault runner (real local server)


class _Recorder(ThreadingHTTPServer):
    """A loopback stand-in for Ballast's admin API that records every request.

    ``answers`` maps (method, path) to a status (default 200); a successful
    ``POST /admin/kill-switch`` returns a fresh id.
    """

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.answers: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()
        self.next_id = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def seen(self) -> list[tuple[str, str, Any]]:
        with self.lock:
            return [(r["method"], r["path"], r["body"]) for r in self.requests]


class _Handler(BaseHTTPRequestHandler):
    server: _Recorder

    def log_message(self, *args: Any) -> None:
        pass

    def _handle(self, method: str) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        body = json.loads(raw) if raw else None
        with self.server.lock:
            self.server.requests.append(
                {
                    "method": method,
                    "path": self.path,
                    "body": body,
                    "auth": self.headers.get("Authorization"),
                    "operator": self.headers.get("X-Ballast-Operator"),
                }
            )
            status = self.server.answers.get((method, self.path), 200)
            if status < 300 and method == "POST" and self.path == "/admin/kill-switch":
                self.server.next_id += 1
                out: dict[str, Any] = {"id": f"ks-{self.server.next_id}"}
                status = 201
            elif status < 300:
                out = {"ok": True}
            else:
                out = {"error": {"code": "CHAOS_DISABLED", "message": "chaos hooks are disabled"}}
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


@pytest.fixture
def admin_server():
    server = _Recorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _wait_for(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_leak_given_per_simulated_hour_leaks_the_same_share_of_a_day_at_any_scale():
    event = FaultEvent(0, "start_leak", {"leak_mb_per_sim_h": 750})
    rates = {scale: leak_mb_per_s(event, TimeScale(scale)) for scale in (1, 96, DAY_S)}
    assert rates[96] == pytest.approx(20.0) and rates[1] == pytest.approx(750 / 3600)
    assert rates[DAY_S] == 1024.0  # the server's cap
    real = FaultEvent(0, "start_leak", {"leak_mb_per_s": 3})
    assert leak_mb_per_s(real, TimeScale(96)) == 3.0
    assert DEFAULT_SOAK.events[0].args == {"target": "primary", "leak_mb_per_sim_h": 750.0}


def test_runner_plays_the_schedule_in_order(admin_server):
    sched = FaultSchedule(
        (
            FaultEvent(0, "start_leak", {"leak_mb_per_s": 20}),
            FaultEvent(10, "fail_primary"),
            FaultEvent(20, "kill_replica", {"stall_s": 0.05}),
            FaultEvent(30, "kill_switch_on", {**_ON, "label": "free-off"}),
            FaultEvent(40, "kill_switch_off", {"label": "free-off"}),
            FaultEvent(50, "clear_chaos"),
        )
    )
    # 1000 simulated seconds per real second: the whole schedule in ~0.1 s.
    runner = FaultRunner(sched, admin_server.base_url, TimeScale(1000), admin_token="tok")
    runner.start()
    assert runner.join(10)
    ks = {"scope": "tenant", "value": "free", "reason": "r", "expires_in_s": 60}
    assert admin_server.seen() == [
        ("POST", "/admin/chaos", {"target": "primary", "leak_mb_per_s": 20.0}),
        ("POST", "/admin/chaos", {"target": "primary", "error_ratio": 1.0}),
        ("POST", "/admin/chaos", {"target": "primary", "stall": True}),
        ("DELETE", "/admin/chaos", None),
        ("POST", "/admin/kill-switch", ks),
        ("DELETE", "/admin/kill-switch/ks-1", None),
        ("DELETE", "/admin/chaos", None),
    ]  # nothing left on: no cleanup calls
    assert {r["auth"] for r in admin_server.requests} == {"Bearer tok"}
    assert {r["operator"] for r in admin_server.requests} == {"loadtest-faults"}
    recs = runner.records
    assert [(r.action, r.step, r.status) for r in recs] == [
        ("start_leak", "leak", 200),
        ("fail_primary", "fail", 200),
        ("kill_replica", "stall", 200),
        ("kill_replica", "clear", 200),
        ("kill_switch_on", "on", 201),
        ("kill_switch_off", "off", 200),
        ("clear_chaos", "clear", 200),
    ]
    assert [r.at_sim_s for r in recs] == [0, 10, 20, 20, 30, 40, 50]
    offsets = [r.real_offset_s for r in recs]
    assert offsets == sorted(offsets)
    assert recs[3].real_offset_s - recs[2].real_offset_s >= 0.05  # the stall was held (real seconds)
    assert recs[-1].real_offset_s >= 0.05  # 50 simulated seconds at scale 1000
    assert all(r.error is None for r in recs)
    assert recs[0].to_dict()["status"] == 200


def test_stop_interrupts_and_undoes_what_is_on(admin_server):
    sched = FaultSchedule(
        (
            FaultEvent(0, "fail_primary", {"error_ratio": 0.5}),
            FaultEvent(0, "kill_switch_on", _ON),
            FaultEvent(10 * H, "clear_chaos"),  # ten real hours away at scale 1
        )
    )
    runner = FaultRunner(sched, admin_server.base_url, TimeScale(1), admin_token="tok")
    runner.start()
    runner.start()  # idempotent
    _wait_for(lambda: len(admin_server.seen()) == 2)
    t0 = time.monotonic()
    runner.stop()
    assert time.monotonic() - t0 < 5 and runner.done.is_set()
    assert admin_server.seen()[2:] == [
        ("DELETE", "/admin/chaos", None),
        ("DELETE", "/admin/kill-switch/ks-1", None),
    ]
    assert [(r.action, r.step) for r in runner.records][2:] == [
        ("cleanup", "clear_chaos"),
        ("cleanup", "kill_switch_off:x"),
    ]


def test_refused_calls_are_recorded_and_an_off_without_an_id_is_skipped(admin_server):
    admin_server.answers[("POST", "/admin/chaos")] = 409
    admin_server.answers[("POST", "/admin/kill-switch")] = 403
    sched = FaultSchedule(
        (
            FaultEvent(0, "start_leak", {"leak_mb_per_s": 1}),
            FaultEvent(1, "kill_switch_on", _ON),
            FaultEvent(2, "kill_switch_off", {"label": "x"}),
        )
    )
    runner = FaultRunner(sched, admin_server.base_url, TimeScale(1000), admin_token="tok")
    runner.start()
    assert runner.join(10)
    recs = runner.records
    assert [(r.action, r.step, r.status) for r in recs] == [
        ("start_leak", "leak", 409),
        ("kill_switch_on", "on", 403),
        ("kill_switch_off", "off", None),
        ("cleanup", "clear_chaos", 200),  # a chaos POST was attempted: cleared at the end regardless
    ]
    assert "CHAOS_DISABLED" in recs[0].error
    assert recs[2].error == "no id: the kill_switch_on failed"
    assert ("DELETE", "/admin/kill-switch/ks-1", None) not in admin_server.seen()


def test_no_answer_is_recorded_and_the_record_list_is_bounded():
    with ThreadingHTTPServer(("127.0.0.1", 0), _Handler) as closed:
        port = closed.server_address[1]  # bound then closed: nothing listens there
    sched = FaultSchedule(tuple(FaultEvent(i, "clear_chaos") for i in range(5)))
    runner = FaultRunner(
        sched, f"http://127.0.0.1:{port}", TimeScale(1000), admin_token="tok", max_records=3, timeout_s=2
    )
    runner.start()
    assert runner.join(30)
    recs = runner.records
    assert len(recs) == 3
    assert [r.at_sim_s for r in recs] == [2, 3, 4]  # the newest kept
    assert all(r.status is None and r.error and "Connect" in r.error for r in recs)


def test_runner_validates_its_arguments(admin_server):
    with pytest.raises(ValueError, match="^schedule:"):
        FaultRunner([], admin_server.base_url)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^time_scale:"):
        FaultRunner(DEFAULT_SOAK, admin_server.base_url, 96)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^timeout_s:"):
        FaultRunner(DEFAULT_SOAK, admin_server.base_url, timeout_s=0)
    with pytest.raises(ValueError, match="^admin_token:"):
        FaultRunner(DEFAULT_SOAK, admin_server.base_url, admin_token="")


# =========================================================================== locustfile validation


@pytest.fixture(scope="module")
def lf():
    """``loadtest.locustfile`` imported without gevent's monkey-patching of this process."""
    saved = os.environ.get("LOCUST_SKIP_MONKEY_PATCH")
    os.environ["LOCUST_SKIP_MONKEY_PATCH"] = "1"
    try:
        return importlib.import_module("loadtest.locustfile")
    finally:
        if saved is None:
            del os.environ["LOCUST_SKIP_MONKEY_PATCH"]
        else:
            os.environ["LOCUST_SKIP_MONKEY_PATCH"] = saved


JSON_H = {"Content-Type": "application/json"}
SSE_H = {"content-type": "text/event-stream; charset=utf-8"}
GOOD = {"text": "hi there", "tokens_generated": 3, "model": "m", "degradation_level": 0, "fallback": None}


def _err(code: str | None, message: str = "m") -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


def _sse(*events: tuple[str, Any], sep: str = "\n") -> bytes:
    out = ""
    for name, data in events:
        payload = data if isinstance(data, str) else json.dumps(data)
        out += f"event: {name}{sep}data: {payload}{sep}{sep}"
    return out.encode()


def test_unary_ok(lf):
    assert lf.classify_unary(200, JSON_H, json.dumps(GOOD).encode()) == lf.OK
    assert lf.classify_unary(200, JSON_H, json.dumps({"text": "", "tokens_generated": 0}).encode()).kind == "ok"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "empty"),
        (b"  \n", "empty"),
        (None, "empty"),
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not an object"),
        (json.dumps({"tokens_generated": 3}).encode(), "'text'"),
        (json.dumps({"text": 5, "tokens_generated": 3}).encode(), "'text'"),
        (json.dumps({"text": "x"}).encode(), "tokens_generated"),
        (json.dumps({"text": "x", "tokens_generated": "3"}).encode(), "tokens_generated"),
        (json.dumps({"text": "x", "tokens_generated": True}).encode(), "tokens_generated"),
        (json.dumps({"text": "x", "tokens_generated": -1}).encode(), "tokens_generated"),
    ],
)
def test_unary_200_that_is_empty_or_malformed_is_a_failure(lf, body, why):
    out = lf.classify_unary(200, JSON_H, body)
    assert out.kind == "fail" and why in out.detail


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (429, "QUOTA_EXCEEDED"),
        (429, "CONCURRENCY_LIMIT"),
        (503, "OVERLOADED"),
        (503, "KILL_SWITCH"),
        (503, "MODEL_UNAVAILABLE"),
    ],
)
def test_documented_refusals_are_sheds_by_code(lf, status, code):
    assert lf.classify_unary(status, JSON_H, _err(code)) == lf.Outcome("shed", code)
    assert lf.classify_stream(status, JSON_H, _err(code)) == lf.Outcome("shed", code)


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (429, _err("OVERLOADED"), "OVERLOADED"),  # code and status disagree
        (503, _err("QUOTA_EXCEEDED"), "QUOTA_EXCEEDED"),
        (503, b"Service Unavailable", None),  # Serve's own backpressure, no Ballast code
        (503, b"", None),
        (429, json.dumps({"error": "slow down"}).encode(), None),
        (401, _err("UNAUTHENTICATED"), "UNAUTHENTICATED"),
        (403, _err("FORBIDDEN"), "FORBIDDEN"),
        (422, _err("INVALID_REQUEST"), "INVALID_REQUEST"),
        (500, _err("MODEL_ERROR"), "MODEL_ERROR"),
        (504, _err("DEADLINE_EXCEEDED"), "DEADLINE_EXCEEDED"),
        (0, None, None),  # no answer: a connection error or a timeout
    ],
)
def test_anything_else_is_a_failure(lf, status, body, code):
    for classify in (lf.classify_unary, lf.classify_stream):
        out = classify(status, JSON_H, body)
        assert out.kind == "fail" and out.code == code, (classify, out)


def test_stream_ok_with_tokens_then_done(lf):
    body = _sse(
        ("token", {"text": "ab", "tokens": 2}),
        ("token", {"text": "c", "tokens": 1}),
        ("done", {**GOOD, "tokens_generated": 3}),
    )
    assert lf.classify_stream(200, SSE_H, body) == lf.OK
    assert lf.classify_stream(200, SSE_H, body.replace(b"\n", b"\r\n")) == lf.OK  # CRLF line ends
    # Streaming turned off by the level: one token event with the whole text, then done.
    one = _sse(("token", {"text": "whole", "tokens": 5}), ("done", {**GOOD, "tokens_generated": 5, "degraded": True}))
    assert lf.classify_stream(200, SSE_H, one) == lf.OK
    # Comments and unknown events are ignored.
    extra = b": keep-alive\n\n" + _sse(("progress", {"x": 1})) + _sse(("done", {**GOOD, "tokens_generated": 0}))
    assert lf.classify_stream(200, SSE_H, extra) == lf.OK


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "without a done event"),
        (_sse(("token", {"text": "ab", "tokens": 2})), "without a done event"),
        # Cut mid-event: "done" never completed by its blank line.
        (
            _sse(("token", {"text": "a", "tokens": 1})) + b'event: done\ndata: {"tokens_generated": 1}\n',
            "without a done event",
        ),
        (_sse(("token", {"tokens": 2}), ("done", {"tokens_generated": 2})), "token event without"),
        (_sse(("token", "not json"), ("done", {"tokens_generated": 2})), "malformed 'token'"),
        (_sse(("done", {"text": "x"})), "done event without"),
        (_sse(("done", "{")), "malformed 'done'"),
        (_sse(("token", {"text": "a", "tokens": 1}), ("done", {"tokens_generated": 4})), "done says 4"),
        (_sse(("done", {"tokens_generated": 0}), ("token", {"text": "a", "tokens": 1})), "after done"),
        (
            _sse(
                ("token", {"text": "a", "tokens": 1}),
                ("error", {"error": {"code": "MODEL_UNAVAILABLE", "message": "m"}}),
            ),
            "after 1 token",
        ),
        (_sse(("error", {"error": {"code": "MODEL_ERROR", "message": "m"}})), "MODEL_ERROR"),
        (_sse(("error", {"error": {"code": "DEADLINE_EXCEEDED", "message": "m"}})), "DEADLINE_EXCEEDED"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_stream_failures(lf, body, why):
    out = lf.classify_stream(200, SSE_H, body)
    assert out.kind == "fail" and why in out.detail, out


def test_stream_error_event_with_a_refusal_code_before_tokens_is_a_shed(lf):
    body = _sse(("error", {"error": {"code": "MODEL_UNAVAILABLE", "message": "every backend failed"}}))
    assert lf.classify_stream(200, SSE_H, body) == lf.Outcome("shed", "MODEL_UNAVAILABLE")


def test_stream_200_that_is_not_sse_is_a_failure(lf):
    out = lf.classify_stream(200, JSON_H, json.dumps(GOOD).encode())
    assert out.kind == "fail" and "text/event-stream" in out.detail
    assert lf.classify_stream(200, None, b"").kind == "fail"


def test_request_names_count_sheds_by_reason(lf):
    assert lf.request_name("gold", "plain", lf.OK) == "gold plain"
    assert lf.request_name("free", "stream", lf.Outcome("shed", "QUOTA_EXCEEDED")) == "free stream shed:QUOTA_EXCEEDED"
    assert lf.request_name("gold", "stream", lf.Outcome("fail", None, "x")) == "gold stream"


def test_shape_from_env(lf):
    assert lf.shape_from_env({}) is None
    assert lf.shape_from_env({"BALLAST_SHAPE": ""}) is None
    day = lf.shape_from_env({"BALLAST_SHAPE": "diurnal"})
    assert isinstance(day, DiurnalShape) and day.duration_s == 900.0 and day.peak_users == 20
    fast = lf.shape_from_env({"BALLAST_SHAPE": "Diurnal", "BALLAST_TIME_SCALE": "1440", "BALLAST_PEAK_USERS": "8"})
    assert fast.duration_s == 60.0 and fast.peak_users == 8
    step = lf.shape_from_env({"BALLAST_SHAPE": "step", "BALLAST_PEAK_USERS": "10"})
    assert isinstance(step, StepShape) and [s.users for s in step.stages] == [2, 5, 10, 2]


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"BALLAST_SHAPE": "sawtooth"}, "BALLAST_SHAPE"),
        ({"BALLAST_SHAPE": "diurnal", "BALLAST_TIME_SCALE": "fast"}, "BALLAST_TIME_SCALE"),
        ({"BALLAST_SHAPE": "diurnal", "BALLAST_TIME_SCALE": "0"}, "BALLAST_TIME_SCALE"),
        ({"BALLAST_SHAPE": "diurnal", "BALLAST_TIME_SCALE": "1e9"}, "BALLAST_TIME_SCALE"),
        ({"BALLAST_SHAPE": "diurnal", "BALLAST_PEAK_USERS": "2.5"}, "BALLAST_PEAK_USERS"),
        ({"BALLAST_SHAPE": "step", "BALLAST_PEAK_USERS": "-3"}, "BALLAST_PEAK_USERS"),
    ],
)
def test_shape_env_validation_names_the_variable(lf, env, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        lf.shape_from_env(env)


def test_faults_from_env(lf):
    assert lf.faults_from_env({}) is None
    assert lf.faults_from_env({"BALLAST_FAULTS": "off"}) is None
    assert lf.faults_from_env({"BALLAST_FAULTS": "soak"}) is DEFAULT_SOAK
    with pytest.raises(ValueError, match="^BALLAST_FAULTS:"):
        lf.faults_from_env({"BALLAST_FAULTS": "chaos-monkey"})


def test_remote_hosts_are_refused_unless_allowed(lf):
    assert lf.check_host("http://127.0.0.1:8123", {}) == "http://127.0.0.1:8123"
    assert lf.check_host("http://localhost:8000", {})
    assert lf.check_host("http://[::1]:8000", {})
    with pytest.raises(ValueError, match="^host:.*BALLAST_ALLOW_REMOTE"):
        lf.check_host("http://ballast.example.com", {})
    with pytest.raises(ValueError, match="^host:"):
        lf.check_host("http://ballast.example.com", {"BALLAST_ALLOW_REMOTE": "yes"})  # exactly "1"
    assert lf.check_host("https://ballast.example.com", {"BALLAST_ALLOW_REMOTE": "1"})
    for bad in (None, "", "127.0.0.1:8000", "ftp://127.0.0.1"):
        with pytest.raises(ValueError, match="^host:"):
            lf.check_host(bad, {})


def test_tenants_and_criticality_mix_are_data(lf):
    from ballast.client import CRITICALITIES

    by_name = {t.name: t for t in lf.TENANTS}
    assert set(by_name) == {"gold", "free"}
    assert by_name["gold"].api_key({}) == "dev-key-gold"
    assert by_name["free"].api_key({"BALLAST_KEY_FREE": "k-free"}) == "k-free"
    assert lf.GoldTenantUser.tenant is by_name["gold"] and lf.GoldTenantUser.weight == by_name["gold"].user_weight
    assert lf.FreeTenantUser.tenant is by_name["free"] and lf.FreeTenantUser.weight == by_name["free"].user_weight
    rng = random.Random(7)
    for t in lf.TENANTS:
        picks = [t.pick_criticality(rng) for _ in range(2000)]
        allowed = {c for c, w in t.criticality_weights if w > 0}
        assert set(picks) == allowed and allowed <= set(CRITICALITIES)
        for crit, weight in t.criticality_weights:  # the mix follows the weights (loose bound)
            share = weight / sum(w for _, w in t.criticality_weights)
            assert abs(picks.count(crit) / len(picks) - share) < 0.05, (t.name, crit)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": ""}, "name"),
        ({"user_weight": 0}, "user_weight"),
        ({"criticality_weights": ()}, "criticality_weights"),
        ({"criticality_weights": (("urgent", 1.0),)}, "criticality_weights"),
        ({"criticality_weights": (("critical", 0.0),)}, "criticality_weights"),
        ({"stream_ratio": 1.5}, "stream_ratio"),
        ({"max_tokens_range": (0, 5)}, "max_tokens_range"),
        ({"max_tokens_range": (9, 5)}, "max_tokens_range"),
    ],
)
def test_tenant_profile_validation(lf, change, field):
    import dataclasses

    with pytest.raises(ValueError, match=rf"^{field}:"):
        dataclasses.replace(lf.TENANTS[0], **change)
