"""What one router counted between two reports to the controller (bounded)."""

from __future__ import annotations

from ballast.policies.reports import ModelLoad
from ballast.policies.stats import nearest_rank

MAX_WAIT_SAMPLES = 4096  # queue-wait samples kept between two reports


class Tally:
    """Counts since the last report: requests, errors, refusals, lost capacity, waits,
    demand by class and the gate's decisions by class (keys: the four classes)."""

    def __init__(self) -> None:
        self.inflight = 0  # requests at the model now (not reset by a report)
        self.requests = 0
        self.errors = 0
        self.shed = 0
        # Attempts lost with their replica or node: capacity gone, not model errors.
        self.lost_capacity = 0
        self.waits_ms: list[float] = []
        # Demand by class: turned away by the level, or within quota.
        self.offered: dict[str, int] = {}
        # Per class: [decided at the gate, let through], counted in the interval it was
        # decided in (a request still waiting is neither).
        self.gate_decided: dict[str, list[int]] = {}

    def add_wait(self, ms: float) -> None:
        if len(self.waits_ms) < MAX_WAIT_SAMPLES:
            self.waits_ms.append(ms)

    def offer(self, crit: str, n: int = 1) -> None:
        self.offered[crit] = self.offered.get(crit, 0) + n

    def decided(self, crit: str, through: bool) -> None:
        seen = self.gate_decided.setdefault(crit, [0, 0])
        seen[0] += 1
        seen[1] += through

    def take_offered(self) -> dict[str, int]:
        out, self.offered = self.offered, {}
        return out

    def take_gate_decided(self) -> dict[str, list[int]]:
        out, self.gate_decided = self.gate_decided, {}
        return out

    def drain(self) -> ModelLoad:
        """The model's load as counted since the last report; the counts start again."""
        p95: float | None = nearest_rank(self.waits_ms, 0.95)  # None with no samples
        out = ModelLoad(
            inflight=self.inflight,
            requests=self.requests,
            errors=self.errors,
            shed=self.shed,
            lost_capacity=self.lost_capacity,
            queue_wait_p95_ms=p95,
        )
        self.requests = self.errors = self.shed = self.lost_capacity = 0
        self.waits_ms = []
        return out
