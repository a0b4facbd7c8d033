"""Hedged attempts: when an attempt shows no progress for longer than the model's replicas
normally take, the same request goes to another replica too, and the first answer wins.

The classic cure for a replica that has stopped answering (a partition, a wedged NIC, a GC
pause, a stalled kernel: from the router all of them are "no bytes"). Dean and Barroso, "The
Tail at Scale" (hedge at the 95th percentile); gRPC's hedging policy; Envoy's
``hedge_on_per_try_timeout``. Three pieces, the algorithm apart from the accounting (STYLE 4):

* ``HedgeDelay`` learns, per model, how long its replicas take to show progress, for each of
  three waits (``KINDS``): a unary answer (per unit of work, ``1 + max_tokens``, so that one
  delay fits short and long calls alike), a stream's first chunk, and a stream's next chunk.
  The delay is ``factor × p95`` of the last ``window`` samples, clamped to
  ``[min_delay_s, max_delay_s]``; None (no hedge) until ``min_samples`` were seen. A replica
  that answers slowly but steadily moves the p95 with it: it is not hedged. Samples come
  from the answers that arrived (a hedge's too, timed from its own send): a silent replica
  adds none, so it cannot teach the delay to wait for it.
* ``hedge_limit`` / ``hedge_allowed``: hedges in flight are at most ``budget_ratio`` of the
  requests in flight, with a floor of ``budget_min_concurrent`` (the retry budget's math:
  ``ballast.policies.retry.retry_limit``). An overload makes every attempt slow; the budget
  keeps hedges from doubling it then, and the caller sends none while the model's level
  sheds anything.
* ``HedgeBudget`` counts hedges in flight around ``hedge_allowed``.

Pure: no clock is read here; the caller measures and passes durations.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass

from ballast.policies.retry import RetryConfig, retry_limit
from ballast.policies.stats import nearest_rank
from ballast.policies.validation import check_fields, check_fraction, check_int, check_non_negative, check_positive

UNARY, FIRST_CHUNK, NEXT_CHUNK = "unary", "first_chunk", "next_chunk"
KINDS = (UNARY, FIRST_CHUNK, NEXT_CHUNK)
PERCENTILE = 0.95


@dataclass(frozen=True)
class HedgeConfig:
    enabled: bool = True
    #: The delay is this many times the p95 of the model's recent waits of the same kind ...
    factor: float = 3.0
    #: ... never below this (a fast model's p95 in milliseconds would hedge on jitter) ...
    min_delay_s: float = 0.5
    #: ... nor above this (the attempt timeout bounds it as well).
    max_delay_s: float = 10.0
    #: Samples of a kind seen before that kind is hedged at all, and the most kept.
    min_samples: int = 20
    window: int = 200
    #: Hedges in flight at most this share of the requests in flight, and never fewer than
    #: ``budget_min_concurrent`` allowed.
    budget_ratio: float = 0.1
    budget_min_concurrent: int = 1

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "factor", "max_delay_s")
        check_fields(self, check_non_negative, "min_delay_s")
        if self.min_delay_s > self.max_delay_s:
            raise ValueError(f"min_delay_s: must be <= max_delay_s ({self.max_delay_s}), got {self.min_delay_s!r}")
        check_fields(self, check_int, "min_samples", minimum=1)
        check_fields(self, check_int, "window", minimum=1)
        if self.window < self.min_samples:
            raise ValueError(f"window: must be >= min_samples ({self.min_samples}), got {self.window!r}")
        check_fields(self, check_fraction, "budget_ratio")
        check_fields(self, check_int, "budget_min_concurrent", minimum=0)


def units(kind: str, max_tokens: int) -> int:
    """What one wait of ``kind`` covers: a unary answer ``1 + max_tokens`` units of work (its
    first token and the rest), a chunk one."""
    return 1 + max(0, max_tokens) if kind == UNARY else 1


class HedgeDelay:
    """Each kind's recent waits (seconds per unit), bounded by ``window``; the delay from them."""

    def __init__(self, cfg: HedgeConfig) -> None:
        self._cfg = cfg
        self._samples: dict[str, deque[float]] = {k: deque(maxlen=cfg.window) for k in KINDS}
        self._p95: dict[str, float | None] = dict.fromkeys(KINDS)  # None: to be computed again

    def observe(self, kind: str, waited_s: float, max_tokens: int = 0) -> None:
        """An answer of ``kind`` came ``waited_s`` after its attempt was sent."""
        if not math.isfinite(waited_s) or waited_s < 0:
            return
        self._samples[kind].append(waited_s / units(kind, max_tokens))
        self._p95[kind] = None

    def samples(self, kind: str) -> int:
        return len(self._samples[kind])

    def delay_s(self, kind: str, max_tokens: int = 0) -> float | None:
        """How long an attempt of ``kind`` waits for progress before it is hedged; None: not
        hedged (hedging off, or fewer than ``min_samples`` seen)."""
        cfg = self._cfg
        seen = self._samples[kind]
        if not cfg.enabled or len(seen) < cfg.min_samples:
            return None
        p95 = self._p95[kind]
        if p95 is None:
            p95 = self._p95[kind] = nearest_rank(seen, PERCENTILE) or 0.0
        return min(cfg.max_delay_s, max(cfg.min_delay_s, cfg.factor * p95 * units(kind, max_tokens)))


def hedge_limit(active: int, cfg: HedgeConfig) -> int:
    """Hedges allowed in flight with ``active`` requests in flight."""
    return retry_limit(
        active, RetryConfig(budget_ratio=cfg.budget_ratio, budget_min_concurrent=cfg.budget_min_concurrent)
    )


def hedge_allowed(active: int, hedges_in_flight: int, cfg: HedgeConfig) -> bool:
    check_int("hedges_in_flight", hedges_in_flight, minimum=0)
    return hedges_in_flight < hedge_limit(active, cfg)


class HedgeBudget:
    """Hedges in flight, against ``hedge_allowed`` (the requests in flight are the caller's
    retry budget's ``active``). One per router's caller, on its event loop thread only."""

    def __init__(self, cfg: HedgeConfig) -> None:
        self._cfg = cfg
        self.in_flight = 0
        self.sent = 0  # hedges sent since start
        self.denied = 0  # hedges wanted and refused by the budget
        self.won = 0  # hedges whose answer was taken

    def try_acquire(self, active: int) -> bool:
        if hedge_allowed(active, self.in_flight, self._cfg):
            self.in_flight += 1
            self.sent += 1
            return True
        self.denied += 1
        return False

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def snapshot(self, active: int) -> dict[str, int]:
        """For /v1/status: hedges in flight and their limit now, sent, denied and won so far."""
        return {
            "in_flight": self.in_flight,
            "limit": hedge_limit(active, self._cfg),
            "sent": self.sent,
            "denied": self.denied,
            "won": self.won,
        }


class Heartbeats:
    """Each replica's last heartbeat stamp and when this process first saw it, on this
    process's clock (so the replicas' clocks never meet it), per model.

    A replica is silent when its stamp has not moved for longer than ``after_s`` while
    another replica's has (of any model this process routes to: a model of one replica
    beside its fallback can go silent too): when no stamp moves at all, it is the view that
    stopped (Serve's controller not polling, say), not every replica. A replica not seen yet
    is not silent. A replica Serve no longer lists (dead, unhealthy, drained) is gone, and
    counts as silent: an attempt still waiting on it is lost capacity. Bounded: at most
    ``max_replicas`` replicas per model, and as many gone ones."""

    def __init__(self, max_replicas: int = 1024) -> None:
        check_int("max_replicas", max_replicas, minimum=1)
        self._max = max_replicas
        self._seen: dict[str, dict[str, tuple[object, float]]] = {}
        # Replicas Serve no longer lists (dead, unhealthy, drained), by model: an attempt still
        # waiting on one is lost capacity. The last max_replicas per model.
        self._gone: dict[str, OrderedDict[str, float]] = {}

    def saw(self, model: str, beats: Mapping[str, object], now_s: float) -> None:
        """The model's replicas now (every one of them) and their stamps (None: none sent)."""
        before = self._seen.get(model, {})
        after: dict[str, tuple[object, float]] = {}
        for replica, stamp in list(beats.items())[: self._max]:
            if stamp is None:  # a replica that sends no heartbeat (an older one): never silent
                continue
            known = before.get(replica)
            after[replica] = known if known is not None and known[0] == stamp else (stamp, now_s)
        self._seen[model] = after
        gone = self._gone.setdefault(model, OrderedDict())
        for replica in before.keys() - beats.keys():
            gone[replica] = now_s
        for replica in beats:
            gone.pop(replica, None)
        while len(gone) > self._max:
            gone.popitem(last=False)

    def _view_alive(self, after_s: float, now_s: float) -> bool:
        """Some replica's heartbeat, of any model, moved within ``after_s``: the view moves."""
        return any(now_s - at_s <= after_s for seen in self._seen.values() for _, at_s in seen.values())

    def silent(self, model: str, replica: str, after_s: float, now_s: float) -> bool:
        """Whether ``replica`` of ``model`` is silent, or gone from Serve's list."""
        if replica in self._gone.get(model, {}):
            return True
        entry = self._seen.get(model, {}).get(replica)
        if entry is None or now_s - entry[1] <= after_s:
            return False
        return self._view_alive(after_s, now_s)

    def others(self, model: str, besides: str, after_s: float, now_s: float) -> int:
        """The model's replicas other than ``besides`` that are heard from (not silent): where
        a hedge of an attempt on ``besides`` could go."""
        silent = self.silent_of(model, after_s, now_s)
        return sum(1 for r in self._seen.get(model, {}) if r != besides and r not in silent)

    def silent_of(self, model: str, after_s: float, now_s: float) -> set[str]:
        """The model's silent replicas."""
        seen = self._seen.get(model, {})
        stale = {r for r, (_, at_s) in seen.items() if now_s - at_s > after_s}
        return stale if stale and self._view_alive(after_s, now_s) else set()
