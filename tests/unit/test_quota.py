"""Tenant quotas: the token bucket walked tick by tick on a fake clock, and the
pure limit math (apportion, effective_rates, lease_rate) on exact numbers."""

from __future__ import annotations

import math
import random

import pytest
from fakes import FakeClock

from ballast.policies.quota import (
    RateLease,
    TenantQuota,
    TokenBucket,
    apportion,
    effective_rates,
    lease_rate,
)


def bucket(rate: float = 10, burst: float = 50, initial: float | None = None) -> tuple[TokenBucket, FakeClock]:
    clock = FakeClock()
    return TokenBucket(rate, burst, clock=clock, initial_tokens=initial), clock


def q(rate: float = 100, *, weight: float = 1.0, sheddable: bool = False) -> TenantQuota:
    return TenantQuota(rate_tokens_per_s=rate, burst_tokens=rate, max_concurrent=4, weight=weight, sheddable=sheddable)


# ----------------------------------------------------------------- TenantQuota


def test_quota_defaults() -> None:
    quota = TenantQuota(rate_tokens_per_s=100, burst_tokens=400, max_concurrent=8)
    assert quota.weight == 1.0
    assert quota.sheddable is False


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate_tokens_per_s": 0}, "rate_tokens_per_s"),
        ({"rate_tokens_per_s": -1}, "rate_tokens_per_s"),
        ({"rate_tokens_per_s": math.inf}, "rate_tokens_per_s"),
        ({"rate_tokens_per_s": True}, "rate_tokens_per_s"),
        ({"burst_tokens": 0}, "burst_tokens"),
        ({"burst_tokens": math.nan}, "burst_tokens"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"max_concurrent": 1.5}, "max_concurrent"),
        ({"max_concurrent": True}, "max_concurrent"),
        ({"weight": 0}, "weight"),
        ({"weight": -2}, "weight"),
        ({"sheddable": "yes"}, "sheddable"),
    ],
)
def test_quota_validation_names_the_field(kwargs: dict, field: str) -> None:
    args = {"rate_tokens_per_s": 100, "burst_tokens": 400, "max_concurrent": 8, **kwargs}
    with pytest.raises(ValueError, match=rf"^{field}: "):
        TenantQuota(**args)


def test_quota_rate_message() -> None:
    with pytest.raises(ValueError, match=r"^rate_tokens_per_s: must be a finite number > 0"):
        TenantQuota(rate_tokens_per_s=0, burst_tokens=1, max_concurrent=1)


# ----------------------------------------------------------------- TokenBucket


def test_bucket_starts_full_by_default() -> None:
    b, _ = bucket(rate=10, burst=50)
    assert b.tokens == 50
    assert b.rate_tokens_per_s == 10
    assert b.burst_tokens == 50


def test_bucket_refills_tick_by_tick_up_to_burst() -> None:
    b, clock = bucket(rate=10, burst=35, initial=0)
    seen = []
    for _ in range(6):
        seen.append(b.tokens)
        clock.advance()
    assert seen == [0, 10, 20, 30, 35, 35]


def test_bucket_refill_is_not_lost_between_reads() -> None:
    # Refill is lazy: 3 s without any call still credits 3 s.
    b, clock = bucket(rate=10, burst=50, initial=0)
    clock.advance(3)
    assert b.tokens == 30


def test_charge_and_deny_at_exact_boundaries() -> None:
    b, clock = bucket(rate=10, burst=50)
    assert b.try_charge(50) is True  # exactly the whole bucket
    assert b.tokens == 0
    assert b.try_charge(1) is False  # nothing left
    assert b.tokens == 0  # a refusal charges nothing
    clock.advance()  # 10
    assert b.try_charge(11) is False
    assert b.tokens == 10
    assert b.try_charge(10) is True  # exactly what is there
    assert b.tokens == 0
    assert b.try_charge(0) is True  # free requests pass at zero balance


def test_charge_tolerates_float_refill_residue() -> None:
    # 0.7 tokens/s × 3 s = 2.0999999999999996 in floats; a 2.1 charge is due.
    b, clock = bucket(rate=0.7, burst=10, initial=0)
    clock.advance(3)
    assert b.retry_after_s(2.1) == 0.0
    assert b.try_charge(2.1) is True


def test_retry_after_exact_values_tick_by_tick() -> None:
    b, clock = bucket(rate=10, burst=50, initial=0)
    assert b.retry_after_s(25) == 2.5
    assert b.retry_after_s(0) == 0.0
    clock.advance()  # 10
    assert b.retry_after_s(25) == 1.5
    clock.advance()  # 20
    assert b.retry_after_s(25) == 0.5
    assert b.try_charge(25) is False
    clock.advance()  # 30
    assert b.retry_after_s(25) == 0.0
    assert b.try_charge(25) is True
    assert b.tokens == 5


def test_retry_after_then_waiting_that_long_passes() -> None:
    b, clock = bucket(rate=4, burst=100, initial=0)
    wait_s = b.retry_after_s(12)
    assert wait_s == 3.0
    clock.advance(2)
    assert b.try_charge(12) is False
    clock.advance(1)
    assert b.try_charge(12) is True


# About 30 days of monotonic uptime, and a year: a float's spacing there is
# ~5e-10 s and ~7e-9 s, which the old bucket lost when adding the wait to the clock.
LARGE_CLOCKS_S = (2_600_000, 2_592_000 + 7, 31_536_000)


@pytest.mark.parametrize("start_s", LARGE_CLOCKS_S)
def test_waiting_the_advertised_retry_after_always_suffices_at_large_clock_values(start_s: int) -> None:
    # Deterministic property loop: for every rate and cost, wait exactly what the
    # bucket advertises, then the charge must pass. Each round starts where the
    # last one left the clock, so the clock soon has a fractional part too.
    rates = (0.7, 1.0, 3.3, 10.0, 97.0, 1234.5, 50_000.0, 1_000_000.0)
    costs = (0.1, 1.0, 2.1, 7.0, 33.3, 99.0, 1000.0, 123_456.7)
    refused = []
    for rate in rates:
        for burst in (10.0, 1000.0, 1e6):
            clock = FakeClock(start_s)
            b = TokenBucket(rate, burst, clock=clock, initial_tokens=0)
            for cost in costs:
                wait_s = b.retry_after_s(cost)
                exact_s = (min(cost, burst) - b.tokens) / rate
                # Never shorter than needed, and not padded beyond float spacing.
                assert wait_s <= max(exact_s, 0.0) + 1e-6, (rate, burst, cost)
                clock.advance(wait_s)  # type: ignore[arg-type]  # the advertised float wait
                if not b.try_charge(cost):
                    refused.append((rate, burst, cost, wait_s))
    assert refused == []


def test_retry_after_at_large_clock_tick_by_tick() -> None:
    # 30 days in, 10 tokens/s, empty: 0.1 tokens are 0.01 s away. 2_600_000 + 0.01
    # rounds down to 2_600_000.0099999998, so the old bucket refilled 0.0999999998
    # and refused the caller who waited exactly as told.
    clock = FakeClock(2_600_000)
    b = TokenBucket(10.0, 10.0, clock=clock, initial_tokens=0)
    wait_s = b.retry_after_s(0.1)
    assert 0.01 <= wait_s < 0.01 + 1e-6
    assert b.try_charge(0.1) is False
    clock.advance(wait_s)  # type: ignore[arg-type]  # the advertised float wait
    assert b.retry_after_s(0.1) == 0.0
    assert b.try_charge(0.1) is True
    # The next one: a second (10 tokens) away, less the hair the last wait overpaid.
    assert 1.0 - 1e-6 < b.retry_after_s(10.0) <= 1.0
    assert b.try_charge(10.0) is False
    clock.advance(1)
    assert b.try_charge(10.0) is True


def test_big_request_passes_only_on_a_full_bucket_and_leaves_a_debt() -> None:
    b, clock = bucket(rate=10, burst=50, initial=40)
    # Above the burst: needs a full bucket, not 80 tokens.
    assert b.try_charge(80) is False
    assert b.retry_after_s(80) == 1.0
    clock.advance()  # 50: full
    assert b.try_charge(80) is True
    assert b.tokens == -30
    # The debt is paid at the rate: 3 s to get back to 0, 1 more for 10 tokens.
    assert b.retry_after_s(10) == 4.0
    assert b.retry_after_s(80) == 8.0  # back to full
    for expected in (-20, -10, 0):
        clock.advance()
        assert b.tokens == expected
        assert b.try_charge(1) is False
    clock.advance()
    assert b.try_charge(10) is True


def test_big_request_is_never_refused_forever() -> None:
    b, clock = bucket(rate=1, burst=5, initial=0)
    for _ in range(4):
        assert b.try_charge(1000) is False
        clock.advance()
    clock.advance()  # t=5: full
    assert b.try_charge(1000) is True


def test_set_rate_credits_the_old_rate_up_to_now() -> None:
    b, clock = bucket(rate=10, burst=50, initial=0)
    clock.advance(2)  # 20 at the old rate, not yet read
    b.set_rate(20, 100)
    assert b.tokens == 20
    assert (b.rate_tokens_per_s, b.burst_tokens) == (20, 100)
    clock.advance()
    assert b.tokens == 40  # new rate from the switch on
    clock.advance(5)
    assert b.tokens == 100  # new burst cap


def test_set_rate_cuts_tokens_to_a_smaller_burst_and_keeps_a_debt() -> None:
    b, clock = bucket(rate=10, burst=50)
    b.set_rate(10, 30)
    assert b.tokens == 30
    assert b.try_charge(30) is True
    b.charge_extra(20)
    assert b.tokens == -20
    b.set_rate(5, 30)
    assert b.tokens == -20  # a debt is not forgiven by a new lease
    clock.advance(2)
    assert b.tokens == -10


def test_refund_and_charge_extra() -> None:
    b, clock = bucket(rate=10, burst=50)
    assert b.try_charge(40) is True
    assert b.tokens == 10
    b.refund(15)
    assert b.tokens == 25
    b.refund(100)
    assert b.tokens == 50  # never above the burst
    b.charge_extra(70)
    assert b.tokens == -20
    assert b.retry_after_s(10) == 3.0
    clock.advance(3)
    assert b.try_charge(10) is True


def test_rate_zero_never_refills() -> None:
    b, clock = bucket(rate=0, burst=50)
    assert b.try_charge(30) is True
    clock.advance(1000)
    assert b.tokens == 20
    assert b.retry_after_s(20) == 0.0
    assert b.retry_after_s(30) == math.inf
    assert b.try_charge(30) is False
    b.set_rate(10, 50)  # a new lease: refill resumes from now
    assert b.tokens == 20
    clock.advance()
    assert b.retry_after_s(30) == 0.0


def test_clock_stepping_back_credits_nothing_twice() -> None:
    b, clock = bucket(rate=10, burst=1000, initial=0)
    clock.advance(10)
    assert b.tokens == 100
    clock.now_s = 5
    assert b.tokens == 100
    clock.now_s = 11
    assert b.tokens == 110  # only 10 → 11 is new


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: TokenBucket(-1, 10, clock=c), "rate_tokens_per_s"),
        (lambda c: TokenBucket(1, 0, clock=c), "burst_tokens"),
        (lambda c: TokenBucket(1, 10, clock=c, initial_tokens=11), "initial_tokens"),
        (lambda c: TokenBucket(1, 10, clock=c, initial_tokens=-1), "initial_tokens"),
        (lambda c: TokenBucket(1, 10, clock=c).try_charge(-1), "cost"),
        (lambda c: TokenBucket(1, 10, clock=c).try_charge(math.nan), "cost"),
        (lambda c: TokenBucket(1, 10, clock=c).retry_after_s(math.inf), "cost"),
        (lambda c: TokenBucket(1, 10, clock=c).refund(-1), "tokens"),
        (lambda c: TokenBucket(1, 10, clock=c).charge_extra(-1), "tokens"),
        (lambda c: TokenBucket(1, 10, clock=c).set_rate(1, 0), "burst_tokens"),
        (lambda c: TokenBucket(1, 10, clock=c).set_rate(math.inf, 10), "rate_tokens_per_s"),
    ],
)
def test_bucket_validation_names_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        call(FakeClock())


# ----------------------------------------------------------------- apportion


def test_apportion_by_demand_above_the_floor() -> None:
    # floor = 0.2 × 100 / 4 = 5 each; the other 80 by demand (60 : 20 : 0 : 0).
    shares = apportion(100, {"a": 60, "b": 20, "c": 0, "d": 0}, min_share_ratio=0.2)
    assert shares == {"a": 65, "b": 25, "c": 5, "d": 5}


def test_apportion_default_min_share() -> None:
    # floor = 0.1 × 100 / 2 = 5; 90 split 3 : 1.
    assert apportion(100, {"a": 3, "b": 1}) == {"a": 72.5, "b": 27.5}


def test_apportion_idle_router_still_gets_the_min_share() -> None:
    shares = apportion(1000, {"busy": 500, "idle": 0})
    assert shares["idle"] == 50  # 0.1 × 1000 / 2
    assert shares["busy"] == 950


def test_apportion_no_demand_anywhere_is_an_equal_split() -> None:
    assert apportion(100, {"a": 0, "b": 0, "c": 0, "d": 0}) == {"a": 25, "b": 25, "c": 25, "d": 25}


def test_apportion_min_share_bounds() -> None:
    assert apportion(100, {"a": 9, "b": 1}, min_share_ratio=0.0) == {"a": 90, "b": 10}
    assert apportion(100, {"a": 9, "b": 1}, min_share_ratio=1.0) == {"a": 50, "b": 50}


def test_apportion_single_router_gets_everything() -> None:
    assert apportion(123.5, {"only": 0}) == {"only": 123.5}
    assert apportion(123.5, {"only": 7}) == {"only": 123.5}


def test_apportion_empty_and_zero_rate() -> None:
    assert apportion(100, {}) == {}
    assert apportion(0, {"a": 5, "b": 0}) == {"a": 0, "b": 0}


def test_apportion_sums_to_the_rate_and_respects_the_floor() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 12)
        rate = rng.uniform(0, 5000)
        ratio = rng.choice([0.0, 0.1, 0.25, 1.0])
        demands = {f"r{i}": rng.choice([0.0, rng.uniform(0, 900)]) for i in range(n)}
        shares = apportion(rate, demands, min_share_ratio=ratio)
        assert set(shares) == set(demands)
        assert math.fsum(shares.values()) == pytest.approx(rate, rel=1e-12, abs=1e-9)
        floor = ratio * rate / n
        assert all(s >= floor - 1e-9 for s in shares.values())


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((-1, {"a": 1}), "tenant_rate"),
        ((math.inf, {"a": 1}), "tenant_rate"),
        ((10, {"a": -1}), "demands"),
        ((10, {"a": math.nan}), "demands"),
        ((10, {"a": 1}, 1.5), "min_share_ratio"),
        ((10, {"a": 1}, -0.1), "min_share_ratio"),
    ],
)
def test_apportion_validation(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}"):
        apportion(*args)


# ----------------------------------------------------------------- effective_rates


def test_own_rates_when_nobody_needs_more() -> None:
    quotas = {"a": q(100), "b": q(200)}
    assert effective_rates(quotas, {"a": 50, "b": 200}, level=0) == {"a": 100, "b": 200}


def test_borrowing_by_weight() -> None:
    # A idle (lends 100); B needs +60 weight 1; C needs +100 weight 3.
    # 100 split 1 : 3 = 25 : 75; neither reaches its need.
    quotas = {"a": q(100), "b": q(100, weight=1), "c": q(100, weight=3)}
    rates = effective_rates(quotas, {"a": 0, "b": 160, "c": 200}, level=0)
    assert rates == {"a": 0, "b": 125, "c": 175}
    assert sum(rates.values()) == 300


def test_water_filling_gives_a_capped_borrowers_rest_to_the_others() -> None:
    # Pool 100 split 1 : 3 = 25 : 75, but B needs only 20: C gets the other 80.
    quotas = {"a": q(100), "b": q(100, weight=1), "c": q(100, weight=3)}
    rates = effective_rates(quotas, {"a": 0, "b": 120, "c": 200}, level=0)
    assert rates == {"a": 0, "b": 120, "c": 180}


def test_water_filling_over_several_rounds() -> None:
    # Pool 90, equal weights. Round 1: 30 each, B capped at 20. Round 2: 70 / 2 = 35
    # each, C capped at 34. Round 3: D gets the 36 left.
    quotas = {"lender": q(90), "b": q(100), "c": q(100), "d": q(100)}
    rates = effective_rates(quotas, {"lender": 0, "b": 120, "c": 134, "d": 200}, level=0)
    assert rates == {"lender": 0, "b": 120, "c": 134, "d": 136}


def test_lenders_keep_what_nobody_borrows_pro_rata() -> None:
    # Pool 150 (A 50 + D 100); B needs 30: 20 % of the pool is lent, so each
    # lender gives up 20 % of what it put in.
    quotas = {"a": q(100), "d": q(100), "b": q(100)}
    rates = effective_rates(quotas, {"a": 50, "d": 0, "b": 130}, level=0)
    assert rates == {"a": 90, "d": 80, "b": 130}


def test_a_lender_never_drops_below_its_own_demand() -> None:
    quotas = {"a": q(100), "b": q(100)}
    rates = effective_rates(quotas, {"a": 70, "b": 1000}, level=0)
    assert rates == {"a": 70, "b": 130}


def test_nothing_is_lent_under_degradation() -> None:
    quotas = {"a": q(100), "b": q(100), "c": q(100, weight=3)}
    demand = {"a": 0, "b": 160, "c": 200}
    for level in (1, 2, 3, 4):
        assert effective_rates(quotas, demand, level=level) == {"a": 100, "b": 100, "c": 100}


@pytest.mark.parametrize(
    ("level", "sheddable_rate"),
    [(0, 100.0), (1, 75.0), (2, 50.0), (3, 25.0), (4, 0.0)],
)
def test_sheddable_rate_shrinks_per_level(level: int, sheddable_rate: float) -> None:
    quotas = {"batch": q(100, sheddable=True), "chat": q(100)}
    rates = effective_rates(quotas, {}, level=level)
    assert rates == {"batch": sheddable_rate, "chat": 100.0}


def test_custom_factors_and_lending_while_degraded() -> None:
    quotas = {"batch": q(100, sheddable=True), "chat": q(100)}
    demand = {"batch": 0, "chat": 180}
    factors = (1.0, 0.5)
    # Level 1 not a lending level: the sheddable base is 50, nothing moves.
    assert effective_rates(quotas, demand, level=1, level_factors=factors) == {"batch": 50, "chat": 100}
    # Lending at level 1: only the shrunk base (50) is lendable, never the 100.
    rates = effective_rates(quotas, demand, level=1, level_factors=factors, lend_at_levels=frozenset({0, 1}))
    assert rates == {"batch": 0, "chat": 150}


def test_missing_demand_is_zero_and_unknown_tenants_are_ignored() -> None:
    quotas = {"a": q(100), "b": q(100)}
    rates = effective_rates(quotas, {"b": 150, "gone": 10_000}, level=0)
    assert rates == {"a": 50, "b": 150}


def test_sum_never_above_the_sum_of_own_rates() -> None:
    rng = random.Random(11)
    for _ in range(300):
        names = [f"t{i}" for i in range(rng.randint(1, 8))]
        quotas = {
            n: q(rng.uniform(1, 1000), weight=rng.choice([0.5, 1.0, 3.0]), sheddable=rng.random() < 0.3) for n in names
        }
        demand = {n: rng.choice([0.0, rng.uniform(0, 2500)]) for n in names}
        level = rng.randint(0, 4)
        rates = effective_rates(quotas, demand, level=level)
        own_sum = sum(quota.rate_tokens_per_s for quota in quotas.values())
        assert sum(rates.values()) <= own_sum * (1 + 1e-12)
        for n, quota in quotas.items():
            base = quota.rate_tokens_per_s * ((1.0, 0.75, 0.5, 0.25, 0.0)[level] if quota.sheddable else 1.0)
            assert rates[n] >= min(base, demand[n]) - 1e-9  # never below what it uses of its own
            assert rates[n] <= max(base, demand[n]) + 1e-9  # a borrower gets no more than it needs
            if level != 0:
                assert rates[n] == base


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"level": 5}, "level"),
        ({"level": -1}, "level"),
        ({"level": True}, "level"),
        ({"level": 1, "level_factors": (1.0,)}, "level"),
        ({"level": 0, "level_factors": ()}, "level_factors"),
        ({"level": 0, "level_factors": (1.0, 1.5)}, "level_factors"),
        ({"level": 0, "level_factors": [1.0]}, "level_factors"),
        ({"level": 0, "demand_tokens_per_s": {"a": -1}}, "demand_tokens_per_s"),
        ({"level": 0, "quotas": {"a": 100}}, "quotas"),
    ],
)
def test_effective_rates_validation(kwargs: dict, field: str) -> None:
    args = {"quotas": {"a": q(100)}, "demand_tokens_per_s": {}, **kwargs}
    with pytest.raises(ValueError, match=rf"^{field}"):
        effective_rates(**args)


# ----------------------------------------------------------------- leases


def test_lease_used_while_unexpired_then_safe_share_from_the_boundary() -> None:
    lease = RateLease(tenant="acme", rate_tokens_per_s=70, burst_tokens=300, expires_at_s=10)
    assert lease_rate(lease, 0, tenant_rate=100, tenant_burst=400, n_routers=4) == (70, 300, "lease")
    assert lease_rate(lease, 9, tenant_rate=100, tenant_burst=400, n_routers=4) == (70, 300, "lease")
    assert lease_rate(lease, 10, tenant_rate=100, tenant_burst=400, n_routers=4) == (25, 100, "safe-share")
    assert lease_rate(lease, 11, tenant_rate=100, tenant_burst=400, n_routers=4) == (25, 100, "safe-share")


def test_no_lease_is_the_safe_share() -> None:
    assert lease_rate(None, 0, tenant_rate=90, tenant_burst=30, n_routers=3) == (30, 10, "safe-share")


@pytest.mark.parametrize("n_routers", [0, -3, 1])
def test_unknown_router_count_counts_as_one(n_routers: int) -> None:
    assert lease_rate(None, 0, tenant_rate=90, tenant_burst=30, n_routers=n_routers) == (90, 30, "safe-share")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tenant": ""}, "tenant"),
        ({"rate_tokens_per_s": -1}, "rate_tokens_per_s"),
        ({"burst_tokens": 0}, "burst_tokens"),
        ({"expires_at_s": math.inf}, "expires_at_s"),
    ],
)
def test_lease_validation(kwargs: dict, field: str) -> None:
    args = {"tenant": "acme", "rate_tokens_per_s": 1, "burst_tokens": 1, "expires_at_s": 1, **kwargs}
    with pytest.raises(ValueError, match=rf"^{field}: "):
        RateLease(**args)


def test_lease_rate_validation() -> None:
    with pytest.raises(ValueError, match=r"^n_routers: "):
        lease_rate(None, 0, tenant_rate=1, tenant_burst=1, n_routers=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^tenant_burst: "):
        lease_rate(None, 0, tenant_rate=1, tenant_burst=0, n_routers=1)
