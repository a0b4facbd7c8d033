"""Which replica a request for an adapter (or any cached key) goes to: affinity, bounded by load.

A replica that already holds what a request needs (a LoRA adapter in one of its engine's
slots; later, a prompt prefix in its KV cache) serves it without loading it first.
Sending every request for a key to its holders saves those loads, but a popular key
would pile its load on the few replicas that hold it; balancing by load alone (Serve's
power-of-two choices) spreads the load and loads keys over and over. The rule here is
consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018): affinity
while the holder is not loaded past a bound over the mean, else balance; and, when the
key must be loaded somewhere, the replica where loading it evicts the least.

**Procedure** (``choose``):

1. The bound: ``load_bound_ratio`` × the mean load counting this request
   (``(sum of loads + 1) / replicas``), at least ``min_slack`` requests above the mean.
   Only replicas whose load + 1 stays within it are eligible.
2. Among the eligible replicas that hold the key, the least loaded: affinity.
3. Otherwise the key is loaded on an eligible replica, the cheapest load first: one with
   a free slot (it evicts nothing), else the one whose next eviction (its least recently
   used key) has the least recent ``demand``; then the least loaded, then the fewest keys.
   A replica's slots are LRU, so its victim is known; choosing where the miss goes
   chooses which key leaves. Cold keys then churn through the slots of one replica while
   the hot ones stay where they are, which recency alone cannot do: a view with no
   demand (all zeros) is LRU over the fleet's slots, and a hot key evicted by a burst of
   cold ones would be loaded again soon after.

With no key, the least loaded (a free slot, then the fewest keys, breaking ties). Ties
go to the replica listed first; the caller shuffles the list when it wants random ties.
Pure and deterministic: the inputs are a snapshot of each replica's load, holdings
(most recently used first) and the keys' recent demand across the fleet.

``rank`` orders every replica for a caller that tries them in turn (Serve's request
router): the choice first, then the others least loaded first.

**Invariant**: the choice's load + 1 is within the bound (the least loaded replica
always is: its load is at most the mean without this request, and ``min_slack`` ≥ 1),
so no replica is chosen past the bound, and a holder within the bound is always
preferred to a load.

**Defaults.** ``load_bound_ratio`` 1.25 is the paper's ε = 0.25: the most loaded replica
at most a quarter over the mean, which keeps the time-averaged spread well inside a
1.5× target while the load view lags the sends by a request or two. ``min_slack`` 2:
at a few requests in flight a ratio alone would send the second concurrent request for
a key elsewhere (1.25 × a mean of 1 is 1.25) and load it there; two requests over the
mean let a holder take a short burst, and the bound still grows with the load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ballast.policies.validation import check_fields, check_int, check_positive


@dataclass(frozen=True)
class AffinityConfig:
    """``load_bound_ratio``: how far over the mean load a replica may be and still be
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
    most recently used first, and how many it can hold (``capacity``; None: no bound)."""

    replica_id: str
    load: int
    holds: tuple[str, ...] = ()
    capacity: int | None = None

    @property
    def has_room(self) -> bool:
        return self.capacity is None or len(self.holds) < self.capacity

    @property
    def victim(self) -> str | None:
        """The key loading another would evict (its least recently used); None with room."""
        return None if self.has_room or not self.holds else self.holds[-1]


@dataclass(frozen=True)
class Choice:
    """The replica chosen and why: "affinity" (it holds the key), "load" (the cheapest
    eligible replica to load the key on), "balance" (no key: the least loaded).
    ``loads``: the replica does not hold the key yet."""

    replica_id: str
    reason: str
    loads: bool


def load_bound(replicas: Sequence[ReplicaView], cfg: AffinityConfig) -> float:
    """The most load a replica may reach with this request and still be chosen for it."""
    mean = (sum(r.load for r in replicas) + 1) / len(replicas)
    return max(cfg.load_bound_ratio * mean, mean + cfg.min_slack)


def _eligible(replicas: Sequence[ReplicaView], cfg: AffinityConfig) -> list[ReplicaView]:
    bound = load_bound(replicas, cfg)
    return [r for r in replicas if r.load + 1 <= bound]


def _cheapest_load(replicas: Sequence[ReplicaView], demand: Mapping[str, float]) -> ReplicaView:
    """Where loading a key evicts the least: a free slot, else the least demanded victim."""

    def cost(r: ReplicaView) -> tuple[int, float, int, int]:
        victim = r.victim
        evicted = 0.0 if victim is None else float(demand.get(victim, 0.0))
        return (0 if r.has_room else 1, evicted, r.load, len(r.holds))

    return min(replicas, key=cost)


def choose(
    replicas: Sequence[ReplicaView],
    key: str | None,
    cfg: AffinityConfig,
    demand: Mapping[str, float] | None = None,
) -> Choice:
    """The replica for a request needing ``key`` (None: any replica will do); ``demand``:
    each key's recent requests across the fleet (a key not in it: none)."""
    if not replicas:
        raise ValueError("replicas: at least one is needed")
    eligible = _eligible(replicas, cfg)
    if key is None:
        best = min(eligible, key=lambda r: (r.load, not r.has_room, len(r.holds)))
        return Choice(best.replica_id, "balance", loads=False)
    holders = [r for r in eligible if key in r.holds]
    if holders:
        best = min(holders, key=lambda r: r.load)
        return Choice(best.replica_id, "affinity", loads=False)
    best = _cheapest_load(eligible, demand or {})
    return Choice(best.replica_id, "load", loads=True)


def rank(
    replicas: Sequence[ReplicaView],
    key: str | None,
    cfg: AffinityConfig,
    demand: Mapping[str, float] | None = None,
) -> list[str]:
    """Every replica's id in the order to try them: ``choose``'s first, then the rest
    least loaded first (ties in the order listed)."""
    first = choose(replicas, key, cfg, demand).replica_id
    rest = sorted((r for r in replicas if r.replica_id != first), key=lambda r: r.load)
    return [first, *(r.replica_id for r in rest)]


# --------------------------------------------------------------------------- prompt prefixes

#: How a request may be routed (``route_mode``): by what replicas hold, within the load
#: bound ("affinity"); by what they hold among the least loaded only ("least_loaded");
#: by load alone ("balance": Serve's power of two choices).
ROUTE_MODES = ("affinity", "least_loaded", "balance")


def route_mode(criticality: str, level: int, balance_from_level: int) -> str:
    """How a request of ``criticality`` is routed at degradation ``level``.

    From ``balance_from_level`` up the model is short of capacity: load alone decides, so
    the shortest lines fill first. critical_plus never waits for affinity: it goes to a
    least loaded replica, the one holding most of its prompt among those."""
    if level >= balance_from_level:
        return "balance"
    return "least_loaded" if criticality == "critical_plus" else "affinity"


@dataclass(frozen=True)
class PrefixView:
    """What the chooser knows of one replica for one request: its requests in flight, the
    leading blocks of the request's prompt it holds, and its rendezvous score for the
    request's first block no replica holds (``ballast.policies.prefix_cache.home_score``)."""

    replica_id: str
    load: int
    matched: int
    home: int


def choose_by_prefix(replicas: Sequence[PrefixView], cfg: AffinityConfig, least_loaded: bool = False) -> Choice:
    """The replica for a request by the prefix of its prompt each holds.

    1. Eligible: within the load bound (``load_bound``); with ``least_loaded``, only the
       replicas at the least load.
    2. The most leading blocks held among them; ties (none holds any, or several hold
       the same) go to the highest ``home`` score, which every router computes alike, so
       a new prefix lands on one replica and copies of an old one stop being refreshed.

    "prefix" when the choice holds at least one block of the prompt, else "home"."""
    if not replicas:
        raise ValueError("replicas: at least one is needed")
    if least_loaded:
        low = min(r.load for r in replicas)
        eligible = [r for r in replicas if r.load == low]
    else:
        bound = load_bound([ReplicaView(r.replica_id, r.load) for r in replicas], cfg)
        eligible = [r for r in replicas if r.load + 1 <= bound]
    best = max(eligible, key=lambda r: (r.matched, r.home))
    return Choice(best.replica_id, "prefix" if best.matched > 0 else "home", loads=False)


def rank_by_prefix(
    replicas: Sequence[PrefixView], cfg: AffinityConfig, least_loaded: bool = False
) -> tuple[Choice, list[str]]:
    """``choose_by_prefix``'s choice, and every replica's id in the order to try them: the
    choice first, then the rest least loaded first (ties in the order listed)."""
    choice = choose_by_prefix(replicas, cfg, least_loaded)
    rest = sorted((r for r in replicas if r.replica_id != choice.replica_id), key=lambda r: r.load)
    return choice, [choice.replica_id, *(r.replica_id for r in rest)]
