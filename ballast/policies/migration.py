"""A request whose replica went away is sent again; a cut stream is carried on elsewhere.

A replica or node that is gone (its actor died, its node was lost, Serve drained it
past its grace period) is Ballast's capacity gap, not a sick model. Three rules follow:

* **Not a model failure.** Such an attempt neither counts toward the level's error
  rate nor trips the backend's breaker; it is counted on its own (``LOST_CAPACITY``).
  A model that itself answers with errors still does both.
* **Sent again.** A generation has no side effects, so a unary request in flight on a
  lost replica goes to another replica of the same backend, keyed or not; a stream
  cut mid-way continues on another replica from the tokens already delivered (the
  prompt plus those tokens are prefilled there: a continuation), so the client sees
  one stream. Either is a *migration*.
* **Bounded.** At most ``MigrationConfig.limit`` migrations per request, each only
  while the deadline leaves room for a short pause and one useful attempt, and each
  inside the router's retry budget (the caller asks it). Past that the request ends
  with 503 ``REPLICA_LOST`` (a stream with an error event), which the level does not
  count as an error either.

The pause before a migration is short: Serve's handle drops a replica it saw die,
so the next attempt goes elsewhere at once; the jitter only spreads the requests that
lost the same replica together.
"""

from __future__ import annotations

from dataclasses import dataclass

from ballast.policies.validation import check_fields, check_int, check_non_negative, is_number

#: The failure kind (``ballast.router.resilience.classify``) of an attempt whose
#: replica or node went away.
LOST_CAPACITY = "replica_died"

#: Pause before a migration, at most: the handle has already dropped the dead replica.
MAX_PAUSE_S = 0.05


@dataclass(frozen=True)
class MigrationConfig:
    #: Migrations per request (unary re-sends and stream continuations together).
    limit: int = 3

    def __post_init__(self) -> None:
        check_fields(self, check_int, "limit", minimum=0)


def pause_s(migration: int, rand: float) -> float:
    """The jittered pause before migration number ``migration`` (1 = the first)."""
    check_int("migration", migration, minimum=1)
    if not is_number(rand) or not 0 <= rand <= 1:
        raise ValueError(f"rand: must be a number in [0, 1], got {rand!r}")
    return rand * MAX_PAUSE_S


def should_migrate(
    done: int, cfg: MigrationConfig, deadline_left_s: float, next_pause_s: float, min_attempt_s: float
) -> tuple[bool, str]:
    """Whether a request that lost its replica after ``done`` migrations goes on elsewhere.

    Yes while ``done < cfg.limit`` and the deadline leaves room for the pause and one
    attempt of ``min_attempt_s``. Returns ``(decision, reason)``.
    """
    check_int("done", done, minimum=0)
    check_non_negative("next_pause_s", next_pause_s)
    check_non_negative("min_attempt_s", min_attempt_s)
    if not is_number(deadline_left_s):
        raise ValueError(f"deadline_left_s: must be a number, got {deadline_left_s!r}")
    if done >= cfg.limit:
        return False, f"migration limit reached ({done}/{cfg.limit})"
    if not deadline_left_s > next_pause_s + min_attempt_s:
        return False, f"no room before the deadline ({deadline_left_s:.3f}s left)"
    return True, f"migration {done + 1}/{cfg.limit}"
