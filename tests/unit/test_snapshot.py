"""ballast.control.snapshot: ordering, the fail-static cache walked second by second, the exchange.

The cache's wall clock is a ``FakeWallClock`` advanced in whole seconds; the
exchange's controller call is an async fake. Nothing here sleeps on real time
except the one timeout test, whose fake call never answers (so the outcome
does not depend on how long the sleep really takes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from ballast.control.snapshot import ModelState, Snapshot, SnapshotCache, SnapshotExchange
from ballast.policies.control import RoutingSummary
from ballast.policies.degradation import DEFAULT_CONSTRAINTS, DegradationConfig, LoadSignals
from ballast.policies.reports import ModelLoad, RouterReport

DEG = DegradationConfig()
STALE_S = 3
MAX_STALE_S = 10
FLOOR = 1


class FakeWallClock:
    """Stands in for time.time(): a wall clock that moves only when told."""

    def __init__(self, t: int = 1000) -> None:
        self.t = t

    def __call__(self) -> float:
        return float(self.t)

    def advance(self, seconds: int = 1) -> None:
        self.t += seconds


M = "m"  # the model these snapshots name


def state(level: int, deployment: str = "BallastModel") -> ModelState:
    return ModelState(deployment, DEG.constraints[level], level=level, target_level=level, reason="test")


def snap(version: int, created_at_s: float, level: int = 0, epoch: str = "e1") -> Snapshot:
    return Snapshot(epoch=epoch, version=version, created_at_s=created_at_s, models={M: state(level)})


def make_cache(clock: FakeWallClock, floor: int = FLOOR) -> SnapshotCache:
    return SnapshotCache(DEG, stale_s=STALE_S, max_stale_s=MAX_STALE_S, fail_static_level=floor, wall_clock=clock)


# --------------------------------------------------------------------------- Snapshot


class TestIsNewerThan:
    def test_anything_is_newer_than_nothing(self) -> None:
        assert snap(1, 0).is_newer_than(None)

    def test_same_epoch_compares_versions_not_times(self) -> None:
        older, newer = snap(4, created_at_s=500), snap(5, created_at_s=100)
        assert newer.is_newer_than(older)
        assert not older.is_newer_than(newer)

    def test_same_epoch_same_version_is_not_newer(self) -> None:
        assert not snap(3, 100).is_newer_than(snap(3, 90))

    def test_new_epoch_accepted_by_created_at(self) -> None:
        old = snap(900, created_at_s=100, epoch="before-restart")
        restarted = snap(1, created_at_s=101, epoch="after-restart")
        assert restarted.is_newer_than(old)  # version 1 < 900, but a later epoch start
        assert not old.is_newer_than(restarted)

    def test_new_epoch_at_the_same_instant_is_accepted(self) -> None:
        assert snap(1, 100, epoch="b").is_newer_than(snap(7, 100, epoch="a"))

    def test_new_epoch_created_earlier_is_refused(self) -> None:
        assert not snap(1, created_at_s=99, epoch="b").is_newer_than(snap(7, created_at_s=100, epoch="a"))

    def test_dict_round_trip(self) -> None:
        s = Snapshot(
            epoch="e",
            version=2,
            created_at_s=5.0,
            models={M: state(3)},
            desired_replicas={"BallastModel": 2},
            running_replicas={"BallastModel": 1},
            autoscale={"BallastModel": {"mode": "stable"}},
        )
        assert Snapshot.from_dict(s.to_dict()) == s


class TestModelStates:
    """``Snapshot.models``: every model's typed state, across the process boundary as a dict."""

    def three(self) -> Snapshot:
        signals = LoadSignals(
            queue_length=40,
            queue_wait_p95_ms=250.0,
            gpu_util_pct=None,
            vram_pct=None,
            error_rate=0.0,
            demand_rps={"critical": 3.5},
        )
        return Snapshot(
            epoch="e",
            version=7,
            created_at_s=5.0,
            models={
                "a": state(0),
                "b": ModelState(
                    "BallastModel-b",
                    DEG.constraints[3],
                    level=3,
                    target_level=4,
                    reason="queue 40 > 20",
                    inputs=signals,
                    engine_rows=24,
                    routing=RoutingSummary(prefix_hit_ratio=0.5, routed_by_prefix_ratio=0.25, load_max_over_mean=1.2),
                ),
                "c": ModelState("BallastModel-c", DEG.constraints[1], level=1, target_level=1, reason="gpu"),
            },
        )

    def test_three_models_round_trip_typed_each_its_own(self) -> None:
        s = self.three()
        wire = s.to_dict()
        assert set(wire) >= {"models"} and not {"level", "target_level", "reason", "constraints", "inputs"} & set(wire)
        assert wire["models"]["b"]["inputs"]["demand_rps"] == {"critical": 3.5}  # plain data on the wire
        back = Snapshot.from_dict(wire)
        assert back == s
        assert all(type(m) is ModelState for m in back.models.values())
        b = back.models["b"]
        assert (b.level, b.target_level, b.constraints, b.engine_rows) == (3, 4, DEG.constraints[3], 24)
        assert b.inputs is not None and b.inputs.queue_length == 40 and b.routing.load_max_over_mean == 1.2
        assert [m.level for m in back.models.values()] == [0, 3, 1]

    def test_unknown_keys_are_ignored_and_an_older_controllers_snapshot_reads(self) -> None:
        wire = self.three().to_dict()
        newer = {**wire, "newer": 1, "models": {n: {**m, "newer": 2} for n, m in wire["models"].items()}}
        assert Snapshot.from_dict(newer) == self.three()
        # An older controller wrote the first model at the top as well, and {} for "no inputs yet".
        older = {**wire, "level": 0, "target_level": 0, "reason": "x", "constraints": {}, "inputs": {}}
        older["models"]["a"]["inputs"] = {}
        assert Snapshot.from_dict(older) == self.three()
        assert Snapshot.from_dict({k: v for k, v in wire.items() if k != "models"}).models == {}

    @pytest.mark.parametrize(
        "field, bad",
        [("level", 5), ("level", "2"), ("deployment", ""), ("engine_rows", -1), ("constraints", None), ("reason", 3)],
    )
    def test_a_malformed_model_state_is_refused_naming_its_field(self, field: str, bad: Any) -> None:
        wire = self.three().to_dict()
        wire["models"]["c"][field] = bad
        with pytest.raises(ValueError, match=f"^{field}:"):
            Snapshot.from_dict(wire)

    def test_a_model_state_missing_its_inputs_signal_or_a_field_is_refused_naming_it(self) -> None:
        wire = self.three().to_dict()
        del wire["models"]["b"]["inputs"]["queue_length"]
        with pytest.raises(ValueError, match="^queue_length: missing"):
            Snapshot.from_dict(wire)
        wire = self.three().to_dict()
        del wire["models"]["a"]["target_level"]
        with pytest.raises(ValueError, match="^target_level: missing"):
            Snapshot.from_dict(wire)

    def test_a_model_the_snapshot_does_not_name_is_fail_static_at_once(self) -> None:
        clock = FakeWallClock(5)
        cache = make_cache(clock)
        cache.offer(self.three())
        assert [cache.effective(m).level for m in ("a", "b", "c")] == [0, 3, 1]
        assert {cache.effective(m).source for m in ("a", "b", "c")} == {"snapshot"}
        unnamed = cache.effective("d")  # a model this router serves that the controller has not ticked yet
        assert (unnamed.source, unnamed.level) == ("fail-static", FLOOR)


# --------------------------------------------------------------------------- SnapshotCache


class TestSnapshotCache:
    def test_no_snapshot_is_fail_static_at_the_floor(self) -> None:
        cache = make_cache(FakeWallClock())
        eff = cache.effective(M)
        assert (eff.level, eff.source, eff.snapshot_age_s, eff.version) == (FLOOR, "fail-static", None, None)
        assert eff.constraints == DEFAULT_CONSTRAINTS[FLOOR]
        assert cache.age_s() is None
        assert not cache.is_fresh()

    def test_no_snapshot_with_floor_zero_is_level_zero(self) -> None:
        eff = make_cache(FakeWallClock(), floor=0).effective(M)
        assert (eff.level, eff.source) == (0, "fail-static")

    def test_walk_fresh_then_stale_then_fail_static_second_by_second(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        assert cache.offer(snap(1, created_at_s=1000, level=0))
        seen = []
        for age in range(0, MAX_STALE_S + 3):
            eff = cache.effective(M)
            seen.append((age, eff.source, eff.level))
            assert eff.snapshot_age_s == age
            assert eff.version == 1
            assert cache.is_fresh() == (age <= STALE_S)
            clock.advance(1)
        expected = (
            [(a, "snapshot", 0) for a in range(0, STALE_S + 1)]
            + [(a, "stale-snapshot", 0) for a in range(STALE_S + 1, MAX_STALE_S + 1)]
            # Past max_stale_s: max(last level 0, floor 1).
            + [(a, "fail-static", FLOOR) for a in range(MAX_STALE_S + 1, MAX_STALE_S + 3)]
        )
        assert seen == expected

    def test_stale_snapshot_keeps_the_snapshots_level_and_constraints(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        cache.offer(snap(1, created_at_s=1000, level=2))
        clock.advance(STALE_S + 1)
        eff = cache.effective(M)
        assert (eff.source, eff.level) == ("stale-snapshot", 2)
        assert eff.constraints == DEFAULT_CONSTRAINTS[2]

    def test_fail_static_keeps_a_level_stricter_than_the_floor(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        cache.offer(snap(1, created_at_s=1000, level=3))
        clock.advance(MAX_STALE_S)
        assert (cache.effective(M).source, cache.effective(M).level) == ("stale-snapshot", 3)
        clock.advance(1)
        eff = cache.effective(M)
        assert (eff.source, eff.level, eff.version) == ("fail-static", 3, 1)
        assert eff.constraints == DEFAULT_CONSTRAINTS[3]

    def test_fail_static_raises_a_calm_level_to_the_floor(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock, floor=2)
        cache.offer(snap(1, created_at_s=1000, level=1))
        clock.advance(MAX_STALE_S + 1)
        eff = cache.effective(M)
        assert (eff.source, eff.level) == ("fail-static", 2)
        assert eff.constraints == DEFAULT_CONSTRAINTS[2]

    def test_a_fresh_snapshot_ends_fail_static(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        cache.offer(snap(1, created_at_s=1000, level=0))
        clock.advance(MAX_STALE_S + 5)
        assert cache.effective(M).source == "fail-static"
        assert cache.offer(snap(2, created_at_s=clock.t, level=0))
        eff = cache.effective(M)
        assert (eff.source, eff.level, eff.version, eff.snapshot_age_s) == ("snapshot", 0, 2, 0)

    def test_offer_ignores_older_and_equal_versions(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        assert cache.offer(snap(5, created_at_s=1000, level=2))
        assert not cache.offer(snap(4, created_at_s=1001, level=0))
        assert not cache.offer(snap(5, created_at_s=1001, level=0))
        assert cache.snapshot is not None and cache.snapshot.version == 5
        assert cache.effective(M).level == 2
        assert cache.offer(snap(6, created_at_s=1001, level=1))
        assert cache.effective(M).level == 1

    def test_offer_accepts_a_restarted_controller(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        cache.offer(snap(50, created_at_s=1000, level=3, epoch="old"))
        clock.advance(2)
        assert cache.offer(snap(1, created_at_s=1002, level=0, epoch="new"))
        assert cache.snapshot is not None and cache.snapshot.epoch == "new"
        # The old controller's later versions no longer win.
        assert not cache.offer(snap(51, created_at_s=1001, level=3, epoch="old"))
        assert cache.effective(M).level == 0

    def test_age_is_never_negative(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        cache.offer(snap(1, created_at_s=1005))  # a sender whose clock runs ahead
        assert cache.age_s() == 0.0
        assert cache.effective(M).source == "snapshot"


# --------------------------------------------------------------------------- SnapshotExchange


class FakeController:
    """Stands in for the controller actor: an async call that answers, fails, or hangs."""

    def __init__(self, replies: list[Any]) -> None:
        self.replies = list(replies)
        self.reports: list[RouterReport] = []
        self.cancelled = 0

    async def call(self, report: RouterReport) -> dict[str, Any]:
        self.reports.append(report)
        reply = self.replies.pop(0)
        if reply == "hang":
            try:
                await asyncio.Event().wait()  # never set: slower than any timeout
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if isinstance(reply, BaseException):
            raise reply
        return reply


class Reports:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> RouterReport:
        self.n += 1
        return RouterReport(router_id="r1", models={"m": ModelLoad(requests=self.n)})


def make_exchange(
    fake: FakeController, cache: SnapshotCache, seen: list[Snapshot], timeout_s: float = 1.0
) -> SnapshotExchange:
    return SnapshotExchange(cache, fake.call, Reports(), interval_s=0.0, timeout_s=timeout_s, on_snapshot=seen.append)


class TestSnapshotExchange:
    async def test_success_offers_the_snapshot_and_calls_on_snapshot(self) -> None:
        clock = FakeWallClock(1000)
        cache = make_cache(clock)
        first = snap(1, created_at_s=1000, level=2)
        fake = FakeController([first.to_dict()])
        seen: list[Snapshot] = []
        ex = make_exchange(fake, cache, seen)
        assert await ex.exchange_once() is True
        assert cache.snapshot == first
        assert seen == [first]
        assert ex.failures == 0
        assert fake.reports == [RouterReport(router_id="r1", models={"m": ModelLoad(requests=1)})]

    async def test_an_older_reply_is_not_passed_to_on_snapshot(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        new, old = snap(2, 1000), snap(1, 999)
        fake = FakeController([new.to_dict(), old.to_dict()])
        seen: list[Snapshot] = []
        ex = make_exchange(fake, cache, seen)
        assert await ex.exchange_once() is True
        assert await ex.exchange_once() is True  # the call itself succeeded
        assert seen == [new]
        assert cache.snapshot == new

    async def test_a_raising_call_counts_a_failure_and_keeps_the_old_snapshot(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        good = snap(1, created_at_s=1000, level=1)
        fake = FakeController([good.to_dict(), RuntimeError("actor died"), ConnectionError("gone")])
        seen: list[Snapshot] = []
        ex = make_exchange(fake, cache, seen)
        assert await ex.exchange_once() is True
        assert await ex.exchange_once() is False
        assert ex.failures == 1
        assert await ex.exchange_once() is False
        assert ex.failures == 2
        assert cache.snapshot == good
        assert seen == [good]
        assert len(fake.reports) == 3  # each attempt still pushed a report

    async def test_a_call_slower_than_the_timeout_counts_a_failure_and_is_cancelled(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        good = snap(1, created_at_s=1000, level=1)
        fake = FakeController([good.to_dict(), "hang"])
        seen: list[Snapshot] = []
        ex = make_exchange(fake, cache, seen, timeout_s=0.01)
        assert await ex.exchange_once() is True
        assert await ex.exchange_once() is False
        assert ex.failures == 1
        assert fake.cancelled == 1  # the hung call does not linger
        assert cache.snapshot == good
        assert seen == [good]

    async def test_a_failing_make_report_counts_a_failure(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        fake = FakeController([snap(1, 1000).to_dict()])

        def broken_report() -> RouterReport:
            raise KeyError("stats")

        ex = SnapshotExchange(cache, fake.call, broken_report, interval_s=0.0, timeout_s=1.0)
        assert await ex.exchange_once() is False
        assert ex.failures == 1
        assert fake.reports == []
        assert cache.snapshot is None

    async def test_failures_are_logged_at_1_and_10_not_in_between(self, caplog: pytest.LogCaptureFixture) -> None:
        cache = make_cache(FakeWallClock(1000))
        fake = FakeController([RuntimeError("down")] * 12)
        ex = make_exchange(fake, cache, [])
        with caplog.at_level(logging.WARNING, logger="ballast.snapshot"):
            for _ in range(12):
                assert await ex.exchange_once() is False
        assert ex.failures == 12
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2
        assert "(1 so far)" in messages[0]
        assert "(10 so far)" in messages[1]

    async def test_a_cancelled_exchange_propagates_cancellation(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        fake = FakeController(["hang"])
        ex = make_exchange(fake, cache, [], timeout_s=60)
        task = asyncio.get_running_loop().create_task(ex.exchange_once())
        while not fake.reports:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ex.failures == 0  # cancellation is not a controller failure

    async def test_the_loop_exchanges_until_stopped(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        replies = [snap(v, 1000).to_dict() for v in range(1, 4)]
        fake = FakeController(replies + ["hang"])
        seen: list[Snapshot] = []
        ex = make_exchange(fake, cache, seen)
        ex.start()
        ex.start()  # idempotent: one loop
        for _ in range(50):
            if len(fake.reports) == 4:
                break
            await asyncio.sleep(0)
        await ex.stop()
        assert [s.version for s in seen] == [1, 2, 3]
        assert len(fake.reports) == 4

    async def test_a_malformed_reply_counts_a_failure_and_keeps_the_old_snapshot(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        good = snap(1, created_at_s=1000)
        bad = {k: v for k, v in snap(2, created_at_s=1000).to_dict().items() if k != "version"}
        fake = FakeController([good.to_dict(), bad])
        ex = make_exchange(fake, cache, [])
        assert await ex.exchange_once() is True
        assert await ex.exchange_once() is False
        assert ex.failures == 1
        assert cache.snapshot == good

    async def test_unknown_fields_from_a_newer_controller_are_ignored(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        newer = {**snap(3, created_at_s=1000).to_dict(), "field_from_a_newer_controller": 1, "leases": {}}
        ex = make_exchange(FakeController([newer]), cache, [])
        assert await ex.exchange_once() is True
        assert cache.snapshot.version == 3

    async def test_the_loop_survives_a_malformed_reply(self) -> None:
        cache = make_cache(FakeWallClock(1000))
        good = snap(2, created_at_s=1000)
        fake = FakeController([None, good.to_dict(), "hang"])
        seen: list[Snapshot] = []
        ex = make_exchange(fake, cache, seen)
        ex.start()
        for _ in range(50):
            if len(fake.reports) == 3:
                break
            await asyncio.sleep(0)
        try:
            assert seen == [good]
        finally:
            try:
                await ex.stop()
            except TypeError:
                pass  # the dead loop's exception re-raised by stop(); part of the same bug


class TestHeading:
    """What batch dispatch acts on: the level, or where the controller is heading if higher."""

    def test_a_fresh_snapshot_heading_up_stops_batch_before_the_level_moves(self) -> None:
        clock = FakeWallClock()
        cache = make_cache(clock)
        rising = ModelState("BallastModel", DEG.constraints[0], level=0, target_level=2, reason="up 0->2 if it holds")
        cache.offer(Snapshot(epoch="e1", version=1, created_at_s=clock(), models={M: rising}))
        assert cache.effective(M).level == 0 and cache.heading(M) == 2
        falling = ModelState("BallastModel", DEG.constraints[3], level=3, target_level=1, reason="down")
        cache.offer(Snapshot(epoch="e1", version=2, created_at_s=clock(), models={M: falling}))
        assert cache.heading(M) == 3  # heading down: the level itself until it has moved

    def test_a_stale_snapshots_target_is_not_read_and_fail_static_rules(self) -> None:
        clock = FakeWallClock()
        cache = make_cache(clock)
        rising = ModelState("BallastModel", DEG.constraints[0], level=0, target_level=2, reason="up")
        cache.offer(Snapshot(epoch="e1", version=1, created_at_s=clock(), models={M: rising}))
        clock.advance(int(STALE_S) + 1)  # stale but not past max_stale_s: the level, not its target
        assert cache.effective(M).source == "stale-snapshot" and cache.heading(M) == 0
        clock.advance(int(MAX_STALE_S) + 1)
        assert cache.heading(M) == cache.effective(M).level == max(0, FLOOR)
        assert cache.heading("no-such-model") == cache.effective("no-such-model").level
