"""What this process's request routers (``ballast.model.routing``) share with the rest of it.

Serve ships a custom request router's module *by value* (``RequestRouterConfig`` pickles it
with ``cloudpickle.register_pickle_by_value``): the router class a handle runs is a copy, and
any table in its own module would be a copy too, written by the routers and never seen by
the process's own import of it. So the tables live here, in a module that travels by
reference: the copy and the process reach the same one.

* Route decisions by model and reason since the process started (``routed_so_far``): what the
  router replica's reporter sends the controller. Bounded: the models times ROUTE_REASONS.
* Each model's replicas' heartbeats as the routers last saw them, on their clock
  (``get_curr_time_s``: Serve's is the wall clock, which ``hedging.ServeReplicas`` reads too),
  and the replica each recent attempt went to, by Serve's internal request id: what the
  resilient caller (``ballast.router.resilience``) reads to tell a silent replica from a sick
  one, and to send a hedge elsewhere. Bounded: ``Heartbeats``' replicas, MAX_PLACED attempts.

Written on Serve's routing loop, read on the router's: the locks guard them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from ballast.policies.hedge import Heartbeats
from ballast.policies.reports import ROUTE_REASONS

#: The most attempts whose replica this process remembers (``placed``), oldest forgotten first.
MAX_PLACED = 4096

_ROUTED: dict[str, dict[str, int]] = {}
_ROUTED_LOCK = threading.Lock()
_BEATS = Heartbeats()
_PLACED: OrderedDict[str, str] = OrderedDict()
_SEEN_LOCK = threading.Lock()


def count_routed(model: str, reason: str) -> None:
    with _ROUTED_LOCK:
        counts = _ROUTED.setdefault(model, dict.fromkeys(ROUTE_REASONS, 0))
        counts[reason] += 1


def routed_so_far(model: str) -> dict[str, int]:
    """Model ``model``'s route decisions made in this process, by reason (a copy)."""
    with _ROUTED_LOCK:
        return dict(_ROUTED.get(model, {}))


def note_beats(model: str, replicas: Iterable[Any], now_s: float) -> None:
    """Model ``model``'s replicas as Serve handed them over, with their heartbeats."""
    beats = {r.replica_id.unique_id: (r.routing_stats or {}).get("beat") for r in replicas}
    with _SEEN_LOCK:
        _BEATS.saw(model, beats, now_s)


def note_placed(request_id: str, replica_id: str) -> None:
    with _SEEN_LOCK:
        _PLACED.pop(request_id, None)
        _PLACED[request_id] = replica_id
        while len(_PLACED) > MAX_PLACED:
            _PLACED.popitem(last=False)


def placed(response: Any) -> str | None:
    """The replica a Serve response's request went to (its unique id); None until the request
    router placed it, or for a response from elsewhere."""
    metadata = getattr(response, "_request_metadata", None)
    request_id = getattr(metadata, "internal_request_id", None)
    if not isinstance(request_id, str):
        return None
    with _SEEN_LOCK:
        return _PLACED.get(request_id)


def silent_replicas(model: str, after_s: float, now_s: float) -> set[str]:
    """Model ``model``'s replicas whose heartbeat stopped (``Heartbeats.silent``)."""
    with _SEEN_LOCK:
        return _BEATS.silent_of(model, after_s, now_s)


def is_silent(model: str, replica_id: str, after_s: float, now_s: float) -> bool:
    with _SEEN_LOCK:
        return _BEATS.silent(model, replica_id, after_s, now_s)


def others(model: str, besides: str, after_s: float, now_s: float) -> int:
    """Model ``model``'s replicas heard from other than ``besides`` (``Heartbeats.others``)."""
    with _SEEN_LOCK:
        return _BEATS.others(model, besides, after_s, now_s)
