"""The replica's scheduler (ballast/policies/scheduler.py), walked chunk boundary by chunk boundary.

Each test holds the replica's side by hand: a line and a batch of plain ``Row``s, and
an integer clock. ``Replica.tick`` asks the scheduler once and applies the decision the
way the replica does (finished rows leave the batch, dropped and admitted rows leave
the line, admitted rows join the batch) and checks the invariants on the way (the
rows taken are the oldest, admission stays within the limits), so each assertion reads
one boundary.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ballast.policies.scheduler import (
    CANCELLED,
    DEADLINE,
    STALL_S,
    STALLED,
    Leave,
    Row,
    SchedulerConfig,
    batch_row_limit,
    schedule,
    timeout_reason,
)

CONTEXT = 100
CFG = SchedulerConfig(kv_budget_tokens=300, context_tokens=CONTEXT)
FAR_S = 1_000


def row(key: int, tokens: int = 50, at_s: int = 0, deadline_s: int = FAR_S) -> Row:
    return Row(key=key, reserved_tokens=tokens, enqueued_at_s=at_s, deadline_s=deadline_s)


class Replica:
    """The line and the batch as the replica keeps them, on plain rows."""

    def __init__(self, cfg: SchedulerConfig = CFG, max_rows: int = 4) -> None:
        self.cfg = cfg
        self.max_rows = max_rows
        self.line: list[Row] = []
        self.batch: dict[int, Row] = {}

    def enqueue(self, *rows: Row) -> None:
        self.line.extend(rows)

    def cancel(self, key: int) -> None:
        self.line = [replace(r, cancelled=True) if r.key == key else r for r in self.line]
        if key in self.batch:
            self.batch[key] = replace(self.batch[key], cancelled=True)

    def tick(self, now_s: int):
        d = schedule(self.cfg, now_s, self.line, self.batch.values(), self.max_rows)
        taken = {r.key for r in d.admitted} | {g.row.key for g in d.dropped}
        oldest = keys(sorted(self.line, key=lambda r: r.enqueued_at_s))
        assert set(oldest[: len(taken)]) == taken  # the oldest rows, whatever else happens
        assert keys(d.admitted) == [k for k in oldest if k in taken and k not in {g.row.key for g in d.dropped}]
        self.line = [r for r in self.line if r.key not in taken]
        for gone in d.finished:
            del self.batch[gone.row.key]
        self.batch.update((r.key, r) for r in d.admitted)
        if d.admitted:  # admission never brings the batch past its limits
            assert len(self.batch) <= self.max_rows
            assert self.cfg.kv_budget_tokens is None or self.kv_reserved <= self.cfg.kv_budget_tokens
        return d

    @property
    def kv_reserved(self) -> int:
        return sum(r.reserved_tokens for r in self.batch.values())


def keys(rows) -> list[int]:
    return [r.key for r in rows]


def leaves(gone: tuple[Leave, ...]) -> list[tuple[int, str]]:
    return [(g.row.key, g.reason) for g in gone]


# -- admission within the budget --------------------------------------------------------


def test_rows_join_until_the_kv_budget_is_spent_then_the_head_waits_for_rows_to_leave() -> None:
    r = Replica()
    r.enqueue(row(1, 120), row(2, 120), row(3, 120))
    d = r.tick(0)
    assert keys(d.admitted) == [1, 2]  # 240 of 300: the third's 120 does not fit
    assert r.kv_reserved == 240 and keys(r.line) == [3]

    assert keys(r.tick(1).admitted) == []  # nothing left: the budget is unchanged
    assert keys(r.line) == [3]

    r.cancel(1)  # its caller went away: it leaves at the next boundary, and so does its KV
    d = r.tick(2)
    assert leaves(d.finished) == [(1, CANCELLED)]
    assert keys(d.admitted) == [3]
    assert r.kv_reserved == 240 and not r.line


def test_the_row_limit_bounds_the_batch_whatever_kv_is_left() -> None:
    r = Replica(max_rows=2)
    r.enqueue(row(1, 10), row(2, 10), row(3, 10))
    assert keys(r.tick(0).admitted) == [1, 2]
    assert keys(r.tick(1).admitted) == []
    r.max_rows = 3  # the level raised the limit
    assert keys(r.tick(2).admitted) == [3]


def test_a_lowered_limit_lets_running_rows_finish_and_only_stops_admission() -> None:
    r = Replica(max_rows=3)
    r.enqueue(row(1, 10), row(2, 10), row(3, 10), row(4, 10))
    assert keys(r.tick(0).admitted) == [1, 2, 3]
    r.max_rows = 1
    d = r.tick(1)
    assert d.finished == () and d.admitted == ()
    assert sorted(r.batch) == [1, 2, 3]
    for key in (1, 2):
        r.cancel(key)
    d = r.tick(2)
    assert leaves(d.finished) == [(1, CANCELLED), (2, CANCELLED)]
    assert d.admitted == ()  # one row still runs: the limit of one is reached
    r.cancel(3)
    assert keys(r.tick(3).admitted) == [4]


def test_a_row_that_fills_the_context_joins_an_empty_batch() -> None:
    r = Replica(SchedulerConfig(kv_budget_tokens=CONTEXT, context_tokens=CONTEXT))
    r.enqueue(row(1, CONTEXT), row(2, 1))
    assert keys(r.tick(0).admitted) == [1]
    assert keys(r.tick(1).admitted) == []  # the budget is full
    r.cancel(1)
    assert keys(r.tick(2).admitted) == [2]


def test_without_a_kv_budget_only_the_row_limit_binds() -> None:
    r = Replica(SchedulerConfig(kv_budget_tokens=None, context_tokens=CONTEXT), max_rows=3)
    r.enqueue(row(1, 10_000), row(2, 10_000), row(3, 10_000), row(4, 1))
    assert keys(r.tick(0).admitted) == [1, 2, 3]
    assert keys(r.line) == [4]


# -- order --------------------------------------------------------------------------------


def test_the_line_is_served_oldest_first_and_ties_keep_their_order() -> None:
    r = Replica(max_rows=2)
    r.enqueue(row(3, at_s=2), row(1, at_s=0), row(4, at_s=2), row(2, at_s=1))
    assert keys(r.tick(3).admitted) == [1, 2]
    r.cancel(1)
    r.cancel(2)
    assert keys(r.tick(4).admitted) == [3, 4]


def test_a_head_that_does_not_fit_is_never_skipped_for_a_younger_smaller_row() -> None:
    r = Replica()
    r.enqueue(row(1, 200), row(2, 150), row(3, 10))
    assert keys(r.tick(0).admitted) == [1]  # 2 needs 150 of the 100 left; 3 would fit but waits
    assert keys(r.line) == [2, 3]
    assert keys(r.tick(1).admitted) == []
    r.cancel(1)
    assert keys(r.tick(2).admitted) == [2, 3]


# -- deadlines and cancellation ---------------------------------------------------------


def test_a_running_row_leaves_once_its_deadline_has_passed_not_at_it() -> None:
    r = Replica()
    r.enqueue(row(1, deadline_s=3), row(2))
    assert keys(r.tick(0).admitted) == [1, 2]
    assert r.tick(3).finished == ()  # at the deadline: still in time
    d = r.tick(4)
    assert leaves(d.finished) == [(1, DEADLINE)]
    assert sorted(r.batch) == [2]


def test_a_waiting_row_past_its_deadline_leaves_the_line_without_a_prefill() -> None:
    r = Replica(max_rows=1)
    r.enqueue(row(1), row(2, deadline_s=2), row(3))
    assert keys(r.tick(0).admitted) == [1]
    assert r.tick(3).dropped == ()  # the batch is full: nothing is taken from the line
    r.cancel(1)
    d = r.tick(4)
    assert leaves(d.finished) == [(1, CANCELLED)]
    assert leaves(d.dropped) == [(2, DEADLINE)]
    assert keys(d.admitted) == [3]  # the slot goes to the next row in the same step


def test_an_expired_head_that_does_not_fit_waits_like_any_other_head() -> None:
    r = Replica()
    r.enqueue(row(1, 250), row(2, 100, deadline_s=1))
    assert keys(r.tick(0).admitted) == [1]
    d = r.tick(2)
    assert d.dropped == () and keys(r.line) == [2]
    r.cancel(1)
    d = r.tick(3)
    assert leaves(d.dropped) == [(2, DEADLINE)] and d.admitted == ()


def test_a_cancelled_waiting_row_leaves_the_line_and_holds_no_place() -> None:
    r = Replica()
    r.enqueue(row(1, 250), row(2, 400), row(3, 50))
    r.cancel(2)
    d = r.tick(0)
    assert leaves(d.dropped) == [(2, CANCELLED)]
    assert keys(d.admitted) == [1, 3]


def test_a_cancelled_row_past_its_deadline_leaves_as_cancelled() -> None:
    r = Replica()
    r.enqueue(row(1, deadline_s=1))
    r.tick(0)
    r.cancel(1)
    assert leaves(r.tick(5).finished) == [(1, CANCELLED)]


def test_an_empty_step_decides_nothing() -> None:
    d = Replica().tick(0)
    assert d.finished == () and d.dropped == () and d.admitted == ()


# -- stall or deadline ------------------------------------------------------------------


def test_a_deadline_with_steps_going_on_is_the_requests_own_time() -> None:
    # Enqueued at 0, deadline at 5, the engine stepped at 4.5: idle 0.5 s.
    assert timeout_reason(CFG, 5.0, 0.0, 4.5) == (DEADLINE, 0.5)


def test_no_step_for_more_than_stall_s_is_a_stall() -> None:
    assert timeout_reason(CFG, 5.0, 0.0, 3.0) == (STALLED, 2.0)
    assert timeout_reason(CFG, 4.0, 0.0, 3.0) == (DEADLINE, STALL_S)  # exactly stall_s: not yet


def test_idle_time_counts_from_the_enqueue_when_the_last_step_is_older() -> None:
    # The engine last stepped long before the request came: only the request's own wait counts.
    assert timeout_reason(CFG, 10.5, 10.0, 0.0) == (DEADLINE, 0.5)
    assert timeout_reason(CFG, 12.0, 10.0, 0.0) == (STALLED, 2.0)


def test_stall_s_is_the_configs() -> None:
    cfg = SchedulerConfig(kv_budget_tokens=None, context_tokens=CONTEXT, stall_s=3.0)
    assert timeout_reason(cfg, 5.0, 0.0, 3.0)[0] == DEADLINE
    assert timeout_reason(cfg, 7.0, 0.0, 3.0)[0] == STALLED


# -- limits and config ------------------------------------------------------------------


@pytest.mark.parametrize(("max_batch_size", "level_limit", "rows"), [(32, 8, 8), (8, 32, 8), (8, 0, 1)])
def test_batch_row_limit_is_the_levels_within_the_replicas_and_at_least_one(max_batch_size, level_limit, rows) -> None:
    assert batch_row_limit(max_batch_size, level_limit) == rows


def test_a_kv_budget_below_the_context_is_refused_where_the_config_is_built() -> None:
    with pytest.raises(ValueError, match="kv_budget_tokens: 99 is smaller than the model's context of 100"):
        SchedulerConfig(kv_budget_tokens=99, context_tokens=100)
    with pytest.raises(ValueError, match="stall_s"):
        SchedulerConfig(kv_budget_tokens=None, context_tokens=100, stall_s=0)
    with pytest.raises(ValueError, match="context_tokens"):
        SchedulerConfig(kv_budget_tokens=None, context_tokens=0)
