"""Client-side adaptive throttling, walked tick by tick on a fake clock with an injected rng."""

from __future__ import annotations

import math
import random

import pytest
from fakes import FakeClock

from ballast.policies.throttle import AdaptiveThrottle, ThrottleConfig, reject_probability


class Fixed:
    """rng returning ``u`` every time, counting its draws."""

    def __init__(self, u: float) -> None:
        self.u = u
        self.draws = 0

    def __call__(self) -> float:
        self.draws += 1
        return self.u


def never_called() -> float:
    raise AssertionError("rng drawn while p == 0")


def make(cfg: ThrottleConfig | None = None, rng=never_called, now_s: int = 0) -> tuple[AdaptiveThrottle, FakeClock]:
    clock = FakeClock(now_s)
    return AdaptiveThrottle(cfg, clock=clock, rng=rng), clock


def refused(throttle: AdaptiveThrottle, n: int = 1) -> None:
    """n attempts that the backend refuses as overloaded (sent, nothing recorded)."""
    for _ in range(n):
        assert throttle.should_send() is True


def accepted(throttle: AdaptiveThrottle, n: int = 1) -> None:
    for _ in range(n):
        assert throttle.should_send() is True
        throttle.record_accept()


# ----------------------------------------------------------------- formula


@pytest.mark.parametrize(
    ("requests", "accepts", "k", "p"),
    [
        (0, 0, 2.0, 0.0),
        (10, 10, 2.0, 0.0),
        (10, 5, 2.0, 0.0),  # exactly at requests = K × accepts
        (10, 4, 2.0, 2 / 11),
        (100, 0, 2.0, 100 / 101),
        (1, 0, 2.0, 0.5),
        (3, 0, 1.0, 0.75),
        (10, 8, 1.1, (10 - 8.8) / 11),
        (5, 10, 2.0, 0.0),  # more accepts than requests (aged differently)
    ],
)
def test_reject_probability_table(requests: int, accepts: int, k: float, p: float) -> None:
    assert reject_probability(requests, accepts, k) == pytest.approx(p, abs=1e-15)


def test_reject_probability_stays_below_one() -> None:
    assert reject_probability(10**9, 0, 2.0) < 1.0


@pytest.mark.parametrize(
    ("args", "field"),
    [((-1, 0, 2.0), "requests"), ((0, -1, 2.0), "accepts"), ((0, 0, 0.0), "k"), ((0, 0, math.nan), "k")],
)
def test_reject_probability_validation(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        reject_probability(*args)


# ----------------------------------------------------------------- config


def test_config_defaults_follow_the_book() -> None:
    cfg = ThrottleConfig()
    assert (cfg.k, cfg.window_s, cfg.bucket_s) == (2.0, 120.0, 1.0)
    assert cfg.num_buckets == 120


@pytest.mark.parametrize(
    ("window_s", "bucket_s", "n"),
    [(120, 1, 120), (120, 7, 18), (10, 10, 1), (2, 0.5, 4), (0.1 * 3, 0.1, 3)],
)
def test_num_buckets_is_the_ceiling(window_s: float, bucket_s: float, n: int) -> None:
    assert ThrottleConfig(window_s=window_s, bucket_s=bucket_s).num_buckets == n


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"k": 0}, "k"),
        ({"k": 0.9}, "k"),
        ({"k": math.inf}, "k"),
        ({"window_s": 0}, "window_s"),
        ({"bucket_s": -1}, "bucket_s"),
        ({"window_s": 5, "bucket_s": 6}, "bucket_s"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        ThrottleConfig(**kwargs)


def test_cfg_must_be_a_throttle_config() -> None:
    with pytest.raises(ValueError, match=r"^cfg: "):
        AdaptiveThrottle({"k": 2})  # type: ignore[arg-type]


# ----------------------------------------------------------------- throttle


def test_healthy_backend_never_rejects_and_never_draws() -> None:
    throttle, clock = make()
    for t in range(300):
        accepted(throttle, 5)
        assert throttle.probability() == 0.0
        # The window holds the last 120 one-second buckets: 600 once full.
        assert throttle.requests == throttle.accepts == 5 * min(t + 1, 120)
        clock.advance()
    assert throttle.local_rejects_total == 0


def test_probability_rises_while_the_server_refuses() -> None:
    throttle, clock = make(rng=Fixed(0.999))
    accepted(throttle, 4)
    # Up to requests = 2 × accepts the client still sends freely.
    for _ in range(4):
        refused(throttle)
        assert throttle.probability() == 0.0
    expected = []
    seen = []
    for n in range(9, 15):
        clock.advance()
        refused(throttle)
        expected.append((n - 8) / (n + 1))
        seen.append(throttle.probability())
    assert seen == pytest.approx(expected, abs=1e-15)
    assert all(a < b for a, b in zip(seen, seen[1:]))
    assert (throttle.requests, throttle.accepts) == (14, 4)


def test_local_rejections_are_counted_as_requests() -> None:
    rng = Fixed(0.0)  # any p > 0 rejects
    throttle, _ = make(rng=rng)
    refused(throttle)  # requests 1, accepts 0 → p = 1/2
    assert throttle.probability() == 0.5
    assert throttle.should_send() is False
    assert rng.draws == 1
    assert (throttle.requests, throttle.accepts, throttle.local_rejects_total) == (2, 0, 1)
    assert throttle.probability() == pytest.approx(2 / 3)
    assert throttle.should_send() is False
    assert throttle.requests == 3
    assert throttle.local_rejects_total == 2


def test_draw_is_compared_strictly_below_p() -> None:
    throttle, _ = make(rng=Fixed(0.5))
    refused(throttle)  # p = 0.5 exactly
    assert throttle.should_send() is True  # u = 0.5 is not < 0.5
    throttle2, _ = make(rng=Fixed(0.4999))
    refused(throttle2)
    assert throttle2.should_send() is False


def test_p_is_taken_before_the_attempt_is_counted() -> None:
    # First attempt ever: p = 0 (requests 0), though counting it first would give 1/2.
    throttle, _ = make()  # rng raises if drawn
    assert throttle.should_send() is True
    assert throttle.requests == 1


def test_probability_decays_as_buckets_age_out() -> None:
    cfg = ThrottleConfig(window_s=10, bucket_s=1)
    throttle, clock = make(cfg, rng=Fixed(0.999))
    refused(throttle, 5)  # t=0: 5 refused → p = 5/6
    clock.advance(5)
    accepted(throttle, 4)  # t=5: requests 9, accepts 4
    assert throttle.probability() == pytest.approx(1 / 10)
    for t in range(6, 10):
        clock.now_s = t
        assert throttle.probability() == pytest.approx(1 / 10), t
    clock.now_s = 10  # the t=0 bucket is 10 buckets behind: forgotten
    assert (throttle.requests, throttle.accepts) == (4, 4)
    assert throttle.probability() == 0.0
    clock.now_s = 15  # the t=5 bucket goes too
    assert (throttle.requests, throttle.accepts, throttle.bucket_count) == (0, 0, 0)


def test_rejecting_client_recovers_once_the_window_forgets() -> None:
    throttle, clock = make(rng=Fixed(0.0))
    refused(throttle)
    assert throttle.should_send() is False
    clock.advance(119)
    assert throttle.should_send() is False  # still inside the 2-minute window
    clock.advance(1)  # t=120: the t=0 bucket ages out, t=119 remains (1 request)
    assert throttle.requests == 1
    assert throttle.probability() == 0.5
    clock.advance(119)
    assert throttle.probability() == 0.0
    assert throttle.should_send() is True


def test_buckets_are_bounded() -> None:
    cfg = ThrottleConfig(window_s=5, bucket_s=1)
    throttle, clock = make(cfg)
    for t in range(50):
        accepted(throttle)
        assert throttle.bucket_count == min(t + 1, 5)
        assert throttle.requests == min(t + 1, 5)
        clock.advance()


def test_sub_second_buckets_with_integer_ticks() -> None:
    cfg = ThrottleConfig(window_s=2, bucket_s=0.5)  # 4 buckets
    throttle, clock = make(cfg, rng=Fixed(0.999))
    refused(throttle)  # bucket 0
    clock.advance()  # bucket 2
    refused(throttle)
    assert throttle.requests == 2
    clock.advance()  # bucket 4: oldest kept is 1, so bucket 0 is gone
    assert throttle.requests == 1
    assert throttle.bucket_count == 1


def test_clock_stepping_back_counts_into_the_newest_bucket() -> None:
    cfg = ThrottleConfig(window_s=10, bucket_s=1)
    throttle, clock = make(cfg, rng=Fixed(0.999), now_s=100)
    refused(throttle)
    clock.now_s = 95
    refused(throttle)
    assert throttle.bucket_count == 1
    clock.now_s = 109
    assert throttle.requests == 2
    clock.now_s = 110  # both were counted in bucket 100
    assert throttle.requests == 0


def test_sent_rate_settles_near_k_times_accepted() -> None:
    # The application tries 20 per tick; the backend accepts at most 4 per tick.
    # Once the window has filled, the client sends about K × 4 = 8 per tick.
    throttle, clock = make(rng=random.Random(3).random)
    sent_per_tick = []
    for _ in range(600):
        sent = 0
        for _ in range(20):
            if throttle.should_send():
                sent += 1
                if sent <= 4:
                    throttle.record_accept()
        sent_per_tick.append(sent)
        clock.advance()
    steady = sent_per_tick[-240:]
    mean_sent = sum(steady) / len(steady)
    assert 7.0 <= mean_sent <= 9.0
    assert throttle.accepts <= 4 * 120
    assert throttle.local_rejects_total > 0
