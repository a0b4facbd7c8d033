"""The replica's scheduler: at each chunk boundary, which rows leave, which join, in what order.

The replica's loop (``ballast/model/replica_loop.py``) holds a line of waiting rows and a batch
of running ones, and carries out what is decided here: it moves rows between the
two, reserves and frees their KV tokens, and answers the rows that leave. The
scheduler reads the rows' facts and never changes them; a row is anything with the
fields of :class:`Row` (the replica passes its own items, tests pass ``Row``).

One step (``schedule``), on the facts at ``now_s``:

1. **Running rows leave** (``_leaving_batch``) when their caller has gone
   (``cancelled``) or their deadline has passed (``deadline``); what they reserved is
   free for this step's admissions.
2. **The line is served oldest first** (``_oldest_first``): by enqueue time, rows
   enqueued at the same instant in the order given.
3. **Room** (``_room``): rows the batch may still take (the level's row limit less the
   rows that stay) and KV tokens left (the budget less what the staying rows reserve).
4. **Admission** (``_serve_line``): the head of the line is judged while the batch has
   room for a row. A head whose caller has gone leaves the line. A head whose
   reservation (prompt + ``max_tokens``) does not fit in the KV tokens left stops the
   step: it waits for rows to leave and is never skipped for a younger, smaller row,
   so a long prompt cannot be starved. A head whose deadline has passed leaves the
   line without being prefilled (``deadline``). Any other head joins, and its
   reservation is taken from the room.

Invariants: the rows taken from the line (joined or dropped) are the oldest ones, in
order; admission never brings the running rows past the row limit nor their
reservations past the KV budget (rows already running when the level lowers the limit
finish; only admission follows the limit). ``kv_budget_tokens=None`` is an engine that
keeps its own KV cache: only the row limit binds.

**Stall or deadline** (``timeout_reason``): a request whose deadline passes before its
last chunk either waited on an engine that made no decode step for more than
``stall_s`` since the later of its enqueue and the last step (``stalled``: the model
is stuck, a health failure), or its own time ran out while the engine worked
(``deadline``: not the model's fault).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ballast.policies.validation import check_fields, check_int, check_positive

#: No decode step for this long while a request waits: the engine is stuck, not busy
#: (a chunk takes milliseconds to tens of milliseconds).
STALL_S = 1.0

# Why a row leaves without finishing: its caller went away, or its deadline passed.
CANCELLED = "cancelled"
DEADLINE = "deadline"
# Why a request's deadline passed: the engine made no progress while it waited.
STALLED = "stalled"


class RowFacts(Protocol):
    """What the scheduler reads of a row (waiting or running)."""

    @property
    def key(self) -> int: ...
    @property
    def reserved_tokens(self) -> int: ...
    @property
    def enqueued_at_s(self) -> float: ...
    @property
    def deadline_s(self) -> float: ...
    @property
    def cancelled(self) -> bool: ...


R = TypeVar("R", bound=RowFacts)


@dataclass(frozen=True)
class Row:
    """A row's facts as plain values; times on the replica's monotonic clock."""

    key: int
    reserved_tokens: int  # the KV tokens it may reach: its prompt and every token it may generate
    enqueued_at_s: float
    deadline_s: float
    cancelled: bool = False  # its caller went away


@dataclass(frozen=True)
class SchedulerConfig:
    """One replica's scheduling limits, fixed for its life.

    ``kv_budget_tokens``: the KV tokens all running rows together may reserve, at least
    ``context_tokens`` so that a row filling the context can always join an empty
    batch; None when the engine manages its own KV cache. ``stall_s``: see
    ``timeout_reason``.
    """

    kv_budget_tokens: int | None
    context_tokens: int
    stall_s: float = STALL_S

    def __post_init__(self) -> None:
        check_fields(self, check_int, "context_tokens", minimum=1)
        check_fields(self, check_positive, "stall_s")
        if self.kv_budget_tokens is not None:
            check_fields(self, check_int, "kv_budget_tokens", minimum=1)
            if self.kv_budget_tokens < self.context_tokens:
                raise ValueError(
                    f"kv_budget_tokens: {self.kv_budget_tokens} is smaller than the model's context of "
                    f"{self.context_tokens} tokens: a request that fills the context could never join the batch"
                )


@dataclass(frozen=True)
class Leave(Generic[R]):
    """A row that leaves without finishing, and why (``CANCELLED`` or ``DEADLINE``)."""

    row: R
    reason: str


@dataclass(frozen=True)
class SchedulerOutput(Generic[R]):
    """One step's decision.

    ``finished``: running rows that leave the batch. ``dropped``: waiting rows that
    leave the line unserved. ``admitted``: waiting rows that join the batch, oldest
    first. ``dropped`` and ``admitted`` together are the oldest rows of the line.
    """

    finished: tuple[Leave[R], ...]
    dropped: tuple[Leave[R], ...]
    admitted: tuple[R, ...]


@dataclass(frozen=True)
class _Room:
    rows: int
    kv_tokens: int | None  # None: not bounded here


def batch_row_limit(max_batch_size: int, level_limit: int) -> int:
    """Rows the batch may hold: the level's limit within the replica's own, at least one."""
    return max(1, min(max_batch_size, level_limit))


def schedule(
    cfg: SchedulerConfig, now_s: float, waiting: Iterable[R], running: Iterable[R], max_rows: int
) -> SchedulerOutput[R]:
    """Decide who leaves the batch, who leaves the line and who joins (see the module docstring).

    ``max_rows``: the batch's row limit (``batch_row_limit``)."""
    finished, staying = _leaving_batch(now_s, running)
    room = _room(cfg, staying, max_rows)
    line = _oldest_first(waiting) if room.rows > 0 else []  # a full batch takes nothing from the line
    dropped, admitted = _serve_line(now_s, line, room)
    return SchedulerOutput(finished, dropped, admitted)


def timeout_reason(
    cfg: SchedulerConfig, now_s: float, enqueued_at_s: float, last_step_at_s: float
) -> tuple[str, float]:
    """``(STALLED or DEADLINE, idle_s)`` for a request whose deadline passed at ``now_s``.

    ``idle_s`` is the time since the later of its enqueue and the engine's last
    finished decode step; more than ``cfg.stall_s`` of it is a stall."""
    idle_s = now_s - max(last_step_at_s, enqueued_at_s)
    return (STALLED if idle_s > cfg.stall_s else DEADLINE), idle_s


def _leaving_batch(now_s: float, running: Iterable[R]) -> tuple[tuple[Leave[R], ...], tuple[R, ...]]:
    """Running rows whose caller has gone or whose deadline has passed, and the rows that stay."""
    finished: list[Leave[R]] = []
    staying: list[R] = []
    for row in running:
        reason = _gone(row, now_s)
        if reason is None:
            staying.append(row)
        else:
            finished.append(Leave(row, reason))
    return tuple(finished), tuple(staying)


def _gone(row: RowFacts, now_s: float) -> str | None:
    if row.cancelled:
        return CANCELLED
    if now_s > row.deadline_s:
        return DEADLINE
    return None


def _oldest_first(waiting: Iterable[R]) -> list[R]:
    return sorted(waiting, key=lambda row: row.enqueued_at_s)  # stable: ties keep their order


def _room(cfg: SchedulerConfig, staying: tuple[RowFacts, ...], max_rows: int) -> _Room:
    """What the batch can still take once the leaving rows are out."""
    kv = None if cfg.kv_budget_tokens is None else cfg.kv_budget_tokens - sum(r.reserved_tokens for r in staying)
    return _Room(rows=max_rows - len(staying), kv_tokens=kv)


def _serve_line(now_s: float, line: list[R], room: _Room) -> tuple[tuple[Leave[R], ...], tuple[R, ...]]:
    """Take rows from the head of the line while the batch has room: each one leaves or joins."""
    dropped: list[Leave[R]] = []
    admitted: list[R] = []
    rows, kv = room.rows, room.kv_tokens
    for row in line:
        if len(admitted) >= rows:
            break
        if row.cancelled:
            dropped.append(Leave(row, CANCELLED))
            continue
        if kv is not None and row.reserved_tokens > kv:
            break  # the KV budget is spent: the head waits for rows to leave
        if now_s > row.deadline_s:  # gave up while waiting: no prefill spent on it
            dropped.append(Leave(row, DEADLINE))
            continue
        admitted.append(row)
        kv = None if kv is None else kv - row.reserved_tokens
    return tuple(dropped), tuple(admitted)
