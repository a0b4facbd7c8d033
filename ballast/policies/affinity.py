"""Which replica a request for an adapter (or any cached key) goes to: affinity, bounded by load.

A replica that already holds what a request needs (a LoRA adapter loaded in its engine;
later, a prompt prefix in its KV cache) serves it without loading it first. Sending
every request for a key to its holders saves those loads, but a popular key would pile
its load on the few replicas that hold it; balancing by load alone (Serve's
power-of-two choices) spreads the load and loads keys over and over. The rule here is
consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018): affinity
while the holder is not loaded past a bound over the mean, else balance.

**Procedure** (``choose``):

1. The bound: ``load_bound_ratio`` × the mean load counting this request
   (``(sum of loads + 1) / replicas``), at least ``min_slack`` requests above the mean
   (with a few requests in flight, a ratio alone would forbid any imbalance at all).
2. Among the replicas that hold the key, the least loaded one whose load plus this
   request stays within the bound: affinity.
3. Otherwise the least loaded replica: it will load the key, so a key hot enough to
   pass the bound on its holders is soon held by more replicas. Among equally loaded
   replicas, one with room for another key (no eviction) first, then the one holding
   the fewest keys.

Ties go to the replica listed first; the caller shuffles the list when it wants
random ties. With no key, step 3 alone (balance). Pure and deterministic: the inputs
are a snapshot of each replica's load and holdings.

**Invariant**: no replica is chosen while its load + 1 exceeds the bound if another
replica's does not (so the most loaded replica stays within the bound of the mean
whenever one could), and a holder within the bound is always preferred to a load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ballast.policies.validation import check_fields, check_int, check_positive


@dataclass(frozen=True)
class AffinityConfig:
    """``load_bound_ratio``: how far over the mean load a holder may be and still be
    chosen (1.25: a quarter). ``min_slack``: requests over the mean always allowed (at
    least 1, so that the least loaded replica is always within the bound)."""

    load_bound_ratio: float = 1.25
    min_slack: int = 2

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "load_bound_ratio")
        check_int("min_slack", self.min_slack, minimum=1)
        if self.load_bound_ratio < 1:
            raise ValueError(f"load_bound_ratio: must be >= 1, got {self.load_bound_ratio!r}")


@dataclass(frozen=True)
class ReplicaView:
    """What the chooser knows of one replica: its requests in flight, the keys it holds,
    and how many it can hold (``capacity``; None: no bound)."""

    replica_id: str
    load: int
    holds: frozenset[str] = frozenset()
    capacity: Optional[int] = None

    @property
    def has_room(self) -> bool:
        return self.capacity is None or len(self.holds) < self.capacity


@dataclass(frozen=True)
class Choice:
    """The replica chosen and why: "affinity" (it holds the key), "balance" (the least
    loaded; it loads the key when it does not hold it: ``loads``)."""

    replica_id: str
    reason: str
    loads: bool


def load_bound(replicas: Sequence[ReplicaView], cfg: AffinityConfig) -> float:
    """The most load a holder may reach with this request and still be chosen for it."""
    mean = (sum(r.load for r in replicas) + 1) / len(replicas)
    return max(cfg.load_bound_ratio * mean, mean + cfg.min_slack)


def choose(replicas: Sequence[ReplicaView], key: Optional[str], cfg: AffinityConfig) -> Choice:
    """The replica for a request needing ``key`` (None: any replica will do)."""
    if not replicas:
        raise ValueError("replicas: at least one is needed")
    if key is not None:
        bound = load_bound(replicas, cfg)
        holders = [r for r in replicas if key in r.holds and r.load + 1 <= bound]
        if holders:
            best = min(holders, key=lambda r: r.load)
            return Choice(best.replica_id, "affinity", loads=False)
    best = min(replicas, key=lambda r: (r.load, not r.has_room, len(r.holds)))
    return Choice(best.replica_id, "balance", loads=key is not None and key not in best.holds)
