"""Adapter affinity against power-of-two choices and Serve's multiplexed routing, simulated.

``python -m loadtest.adapter_affinity`` (issue 43's figure): ``--adapters`` LoRA adapters
requested in a Zipf mix (exponent ``--zipf``) over ``--replicas`` replicas that hold at
most ``--room`` adapters each (least recently used out), Poisson arrivals at
``--utilization`` of the replicas' capacity, exponential service times. The defaults are
the issue's case: 8 adapters, Zipf 1.0, 2 replicas with room for 2. The same seeded
sequence of arrivals, adapters and service times goes to three choosers:

- **affinity**: ``ballast.policies.affinity.choose`` fed what Ballast's request router
  reads: each replica's load, its ``AdapterHoldings`` report (held adapters, most recent
  first; its recent adapter calls) and the demand summed over the reports;
- **p2c**: Serve's power-of-two choices: two replicas at random, the less loaded (ties
  at random), whatever they hold;
- **serve-multiplex**: the rule ``ray.serve.llm``'s LoRA multiplexing routes by (Serve's
  ``MultiplexMixin.apply_multiplex_routing`` then power of two over the candidates): the
  replicas holding the adapter, else the replicas holding the fewest adapters, two of
  them at random, the less loaded; a replica's ``max_num_adapters_per_replica`` is
  ``--room``, least recently used out (``serve.multiplexed``). ``ray.serve.llm`` sets
  ``max_ongoing_requests`` to 1e9, so a holder is never full and load never overrides a
  holder. Simulated with the holdings known at once (Serve learns them from a push after
  each load, and waits up to a second for a holder), which favours it.

``ray.serve.llm`` itself is not run beside the simulation: its ``LLMServer`` starts a
vLLM engine per replica, two here, and a live run measures the engines and the clock as
much as the routing; the simulation replays one sequence of requests through each rule,
which a live run cannot.

Both holdings-aware choosers see each replica's holdings as they are at each arrival;
the real ones see them as of the last routing-stats poll (Ballast: every
``watchdog.interval_s``), so the simulation is their best case alike.

It prints, per chooser, adapter loads per 1,000 requests and the most loaded replica's
time-averaged requests in flight over the mean of all replicas, and ends with the line
``affinity: loads_per_1000=<n> p2c_loads_per_1000=<n> max_over_mean=<x>`` (the affinity
chooser's balance). A simulation of the policies, not of vLLM: a load here is one
adapter brought into a replica's slots, which vLLM does from its CPU cache or from disk.
Deterministic for a seed; bounded by ``--requests``.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ballast.policies.affinity import AffinityConfig, ReplicaView, choose
from ballast.policies.holdings import AdapterHoldings, fleet_demand


@dataclass
class _Replica:
    replica_id: str
    room: int
    load: int = 0
    busy_area: float = 0.0  # integral of load over time
    since_s: float = 0.0
    slots: AdapterHoldings = field(init=False)

    def __post_init__(self) -> None:
        self.slots = AdapterHoldings(self.room)

    def advance(self, now_s: float) -> None:
        self.busy_area += self.load * (now_s - self.since_s)
        self.since_s = now_s

    def use(self, adapter: str) -> bool:
        """The replica serves ``adapter``: True when it had to load it (evicting its LRU)."""
        loads = adapter not in self.slots.held
        self.slots.ran(adapter)
        return loads

    def view(self) -> ReplicaView:
        return ReplicaView(self.replica_id, self.load, self.slots.held, self.room)


@dataclass(frozen=True)
class Workload:
    adapters: int = 8
    zipf: float = 1.0
    replicas: int = 2
    room: int = 2
    utilization: float = 0.7
    service_s: float = 0.5
    requests: int = 20_000
    seed: int = 0

    def arrivals(self) -> list[tuple[float, str, float]]:
        """(arrival time, adapter, service time) of every request, seeded."""
        rng = random.Random(self.seed)
        weights = [1.0 / (i + 1) ** self.zipf for i in range(self.adapters)]
        names = [f"a{i}" for i in range(self.adapters)]
        rate = self.utilization * self.replicas / self.service_s
        now, out = 0.0, []
        for _ in range(self.requests):
            now += rng.expovariate(rate)
            out.append((now, rng.choices(names, weights)[0], rng.expovariate(1.0 / self.service_s)))
        return out


@dataclass(frozen=True)
class Result:
    loads_per_1000: float
    max_over_mean: float


Chooser = Callable[[list[_Replica], str], _Replica]


def simulate(w: Workload, chooser: Chooser) -> Result:
    """Run the workload's arrivals through ``chooser``; count loads and time-averaged loads."""
    replicas = [_Replica(f"r{i}", w.room) for i in range(w.replicas)]
    departures: list[tuple[float, int]] = []  # (time, replica index)
    loads, now = 0, 0.0
    for now, adapter, service_s in w.arrivals():
        while departures and departures[0][0] <= now:
            t, i = heapq.heappop(departures)
            replicas[i].advance(t)
            replicas[i].load -= 1
        target = chooser(replicas, adapter)
        target.advance(now)
        loads += target.use(adapter)
        target.load += 1
        heapq.heappush(departures, (now + service_s, replicas.index(target)))
    for r in replicas:
        r.advance(now)
    areas = [r.busy_area for r in replicas]
    mean = sum(areas) / len(areas)
    return Result(1000.0 * loads / w.requests, max(areas) / mean if mean else 1.0)


def affinity_chooser(cfg: AffinityConfig, rng: random.Random) -> Chooser:
    def pick(replicas: list[_Replica], adapter: str) -> _Replica:
        shuffled = rng.sample(replicas, len(replicas))  # random ties
        demand = fleet_demand({r.replica_id: r.slots.report(0.0) for r in replicas})
        chosen = choose([r.view() for r in shuffled], adapter, cfg, demand)
        return next(r for r in replicas if r.replica_id == chosen.replica_id)

    return pick


def _two_choices(candidates: list[_Replica], rng: random.Random) -> _Replica:
    two = rng.sample(candidates, min(2, len(candidates)))
    return min(two, key=lambda r: (r.load, rng.random()))


def p2c_chooser(rng: random.Random) -> Chooser:
    def pick(replicas: list[_Replica], adapter: str) -> _Replica:
        return _two_choices(replicas, rng)

    return pick


def multiplex_chooser(rng: random.Random) -> Chooser:
    """Serve's multiplexed routing: holders, else the fewest adapters; then two choices."""

    def pick(replicas: list[_Replica], adapter: str) -> _Replica:
        holders = [r for r in replicas if adapter in r.slots.held]
        if not holders:
            fewest = min(len(r.slots.held) for r in replicas)
            holders = [r for r in replicas if len(r.slots.held) == fewest]
        return _two_choices(holders, rng)

    return pick


CHOOSERS = ("affinity", "p2c", "serve-multiplex")


def run(w: Workload, cfg: AffinityConfig | None = None) -> dict[str, Result]:
    """Each chooser's result on the same workload, by name (``CHOOSERS``)."""
    return {
        "affinity": simulate(w, affinity_chooser(cfg or AffinityConfig(), random.Random(w.seed + 1))),
        "p2c": simulate(w, p2c_chooser(random.Random(w.seed + 1))),
        "serve-multiplex": simulate(w, multiplex_chooser(random.Random(w.seed + 1))),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Workload()
    for name in ("adapters", "replicas", "room", "requests", "seed"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    for name in ("zipf", "utilization", "service_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--load-bound-ratio", type=float, default=AffinityConfig().load_bound_ratio)
    a = p.parse_args(argv)
    w = Workload(a.adapters, a.zipf, a.replicas, a.room, a.utilization, a.service_s, a.requests, a.seed)
    results = run(w, AffinityConfig(load_bound_ratio=a.load_bound_ratio))
    print(f"workload: {w}")
    print(f"{'chooser':16} {'loads/1000':>11} {'max/mean load':>14}")
    for name, r in results.items():
        print(f"{name:16} {r.loads_per_1000:11.1f} {r.max_over_mean:14.3f}")
    ours, theirs = results["affinity"], results["p2c"]
    print(
        f"affinity: loads_per_1000={ours.loads_per_1000:.0f} p2c_loads_per_1000={theirs.loads_per_1000:.0f} "
        f"max_over_mean={ours.max_over_mean:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
