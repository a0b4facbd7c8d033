"""One request's deadline, and the offsets every layer takes from it.

A request has one deadline, fixed when the router reads it (the route's default or
the client's ``X-Request-Timeout-Ms``, capped by ``resilience.max_deadline_s``).
Each layer works to an earlier instant derived from it, so that the layer below
answers first and the answer still reaches the client in time:

* the **replica** stops a request ``REPLICA_LEAD_S`` before its attempt's deadline
  (its ``DeadlineExceeded`` reaches the router before the router's timeout fires);
* the router's **gate** admits a request only if its service time fits before that
  replica deadline (``gate_until``);
* each **attempt** ends ``ATTEMPT_MARGIN_S`` before the deadline, so a hung backend
  is seen as an attempt timeout (counted by its breaker) rather than cut off by the
  router's own deadline, which cannot tell a slow backend from a client that left;
* no attempt starts with less than ``MIN_ATTEMPT_S`` left.

Times are ``time.monotonic()`` seconds of the process that holds the value; a
replica gets the time left (and a wall-clock instant) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ballast.policies.validation import check_fields, check_finite, check_positive

#: The replica answers this much before the attempt's deadline.
REPLICA_LEAD_S = 0.1
#: An attempt's timeout ends this much before the request's deadline.
ATTEMPT_MARGIN_S = 0.02
#: No point starting an attempt with less time than this.
MIN_ATTEMPT_S = 0.05


@dataclass(frozen=True)
class Deadline:
    """When the request started and when the router must have answered (monotonic s)."""

    started_s: float
    at_s: float

    def __post_init__(self) -> None:
        check_fields(self, check_finite, "started_s", "at_s")
        if self.at_s < self.started_s:
            raise ValueError(f"at_s: must not be before started_s ({self.started_s}), got {self.at_s}")

    @classmethod
    def starting(cls, now_s: float, budget_s: float) -> Deadline:
        check_positive("budget_s", budget_s)
        return cls(now_s, now_s + budget_s)

    @property
    def budget_s(self) -> float:
        return self.at_s - self.started_s

    def left_s(self, now_s: float) -> float:
        return self.at_s - now_s

    @property
    def gate_until_s(self) -> float:
        """The last instant the model may finish: the replica's deadline."""
        return self.at_s - REPLICA_LEAD_S

    @property
    def gate_budget_s(self) -> float:
        """The time a request has at the model from its start (the gate's service-time budget)."""
        return self.gate_until_s - self.started_s


def attempt_timeout_s(left_s: float, cap_s: float) -> float:
    """One attempt's timeout: at most ``cap_s``, ending ``ATTEMPT_MARGIN_S`` before the deadline."""
    return max(0.001, min(cap_s, left_s - ATTEMPT_MARGIN_S))


def replica_deadline_s(now_s: float, timeout_s: float) -> float:
    """The replica's own deadline for an attempt given ``timeout_s`` to live."""
    return now_s + max(0.0, timeout_s - REPLICA_LEAD_S)
