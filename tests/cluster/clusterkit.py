"""Helpers for the local cluster's fault tests: what runs where, waiting, the report.

(The fixture is in conftest.py; a module of its own so test modules import these by a
name no other test directory uses.)

Each fault test adds a row to ``REPORT``; the session ends by printing the rows
(requests, failures by cause, time to recover), and ``make test-cluster`` shows them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from ballast.ops.status_text import model_view, sole_model
from loadtest import netcluster
from loadtest.cluster_load import ClusterLoad

REPORT: list[dict[str, Any]] = []

FULL = os.environ.get("BALLAST_CLUSTER_SUITE") == "full"
full_suite = pytest.mark.skipif(not FULL, reason="the whole fault suite runs with `make test-cluster`")

MODEL = "ServeReplica:ballast:BallastModel"
ROUTER = "ServeReplica:ballast:BallastRouter"
MIN_REPLICAS = 2  # netcluster.serve_config: one per worker to start


@dataclass
class Cluster:
    state: dict[str, Any]
    broken: bool = False  # a fault test left it changed: the next test gets a new one

    @property
    def nodes(self) -> list[netcluster.Node]:
        return [netcluster.Node(name, ip) for name, ip in self.state["nodes"].items()]

    @property
    def head(self) -> netcluster.Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[netcluster.Node]:
        return self.nodes[1:]

    @property
    def endpoints(self) -> list[str]:
        return [n.endpoint for n in self.nodes]

    @property
    def gold(self) -> str:
        return self.state["keys"]["gold"]

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.state['admin_token']}"}

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.ip}:{netcluster.DASHBOARD_PORT}"

    def load(self, endpoints: list[str] | None = None, duration_s: float = 300) -> ClusterLoad:
        """Six closed-loop callers as gold through ``endpoints`` (every node's by default),
        the level sampled with the admin token; started."""
        return ClusterLoad(
            endpoints or self.endpoints,
            self.gold,
            callers=6,
            duration_s=duration_s,
            admin_token=self.state["admin_token"],
        ).start()

    def node(self, ip: str) -> netcluster.Node:
        return next(n for n in self.nodes if n.ip == ip)

    # -- what runs where (Ray's state API: the head dashboard's REST routes) ------------
    def _state(self, resource: str, **params: str) -> list[SimpleNamespace]:
        # Over HTTP with the cluster's token, not through ray.util.state: Ray reads
        # RAY_AUTH_MODE once per process, and a test session imports Ray long before.
        token = (Path.home() / ".ray" / "auth_token").read_text().strip()
        r = httpx.get(
            f"{self.dashboard}/api/v0/{resource}",
            params={"limit": "1000", "detail": "true", **params},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        r.raise_for_status()
        return [SimpleNamespace(**row) for row in r.json()["data"]["result"]["result"]]

    def node_ips(self) -> dict[str, str]:
        return {n.node_id: n.node_ip for n in self._state("nodes")}

    def ray_state(self, ip: str) -> str:
        """Ray's word on the node at ``ip``: "ALIVE" if any of its entries is, else "DEAD"."""
        states = {n.state for n in self._state("nodes") if n.node_ip == ip}
        return "ALIVE" if "ALIVE" in states else "DEAD"

    def actors(self, class_prefix: str = "") -> list[SimpleNamespace]:
        alive = self._state("actors", filter_keys="state", filter_predicates="=", filter_values="ALIVE")
        return [a for a in alive if a.class_name.startswith(class_prefix)]

    def where(self, class_prefix: str) -> list[str]:
        """The node IPs of the alive actors whose class starts with ``class_prefix``."""
        ips = self.node_ips()
        return [ips.get(a.node_id, "?") for a in self.actors(class_prefix)]

    def generate(self, endpoint: str, headers: dict[str, str] | None = None, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(
            f"{endpoint}/v1/generate",
            timeout=30,
            headers={"Authorization": f"Bearer {self.gold}", **(headers or {})},
            json={"prompt": "hello", "max_tokens": max_tokens},
        )

    def admin_call(self, method: str, path: str, endpoint: str | None = None, **kw: Any) -> httpx.Response:
        return httpx.request(
            method, f"{endpoint or self.workers[0].endpoint}{path}", headers=self.admin, timeout=30, **kw
        )

    def events(self, endpoint: str) -> list[dict[str, Any]]:
        """The controller's recent recycle/kill events (``/admin/replicas``)."""
        return self.admin_call("GET", "/admin/replicas", endpoint).json()["events"]

    def hung_kills(self, endpoint: str, lost: frozenset = frozenset()) -> str:
        """Replicas the controller killed as hung, and how many of them were on the lost
        node (whose heartbeats stopped with it) rather than on a node still serving."""
        try:
            hung = [e for e in self.events(endpoint) if e.get("outcome") == "killed_hung"]
        except (httpx.HTTPError, KeyError, ValueError):
            return "?"
        why = ", ".join(
            f"{e.get('replica_id')} {e.get('reason')} (stalled {e.get('stalled_s')} s, "
            f"last heartbeat {e.get('heartbeat_age_s')} s ago)"
            for e in hung
        )
        return (
            f"{len(hung)} ({sum(e.get('replica_id') in lost for e in hung)} on the lost node)"
            f"{': ' + why if why else ''}"
        )

    def router_views(self, endpoints: list[str], asks: int = 6) -> str:
        """What the routers behind ``endpoints`` saw of the primary: failed attempts by
        kind, attempts lost with their replica, hedges, the breaker (HAProxy spreads the asks)."""
        seen: dict[str, str] = {}
        for i in range(asks):
            try:
                st = self.admin_call("GET", "/v1/status", endpoints[i % len(endpoints)]).json()
                model = model_view(st, sole_model(st))  # the cluster serves one model
                b = model["breakers"]["primary"]
                hedges = model.get("hedges") or {}
                seen[st["router_id"][-6:]] = (
                    f"failed {b['failed_attempts']}, lost {model['lost_capacity']}, "
                    f"hedges {hedges.get('sent', 0)} sent / {hedges.get('won', 0)} won, breaker {b['state']}"
                )
            except (httpx.HTTPError, KeyError, ValueError, TypeError):
                continue
        return "; ".join(f"router …{r}: {v}" for r, v in sorted(seen.items())) or "?"

    def diagnose(self, node: netcluster.Node) -> str:
        """What a node that is not serving has: Ray's entries for it, its endpoint's
        answer, the processes in its namespace, Serve's proxy there, its start log."""
        lines = [f"{node.name} ({node.ip}):"]
        try:
            lines.append(f"  ray: {[(n.node_id[:8], n.state) for n in self._state('nodes') if n.node_ip == node.ip]}")
            ips = self.node_ips()
            lines.append(
                f"  actors there: {sorted(a.class_name for a in self.actors() if ips.get(a.node_id) == node.ip)}"
            )
        except (httpx.HTTPError, KeyError, ValueError) as e:
            lines.append(f"  ray state API: {e!r}")
        try:
            r = httpx.get(f"{node.endpoint}/healthz/ready", timeout=2)
            lines.append(f"  /healthz/ready: {r.status_code} {r.text[:200]!r}")
        except httpx.HTTPError as e:
            lines.append(f"  /healthz/ready: {e!r}")
        procs: dict[str, int] = {}
        for pid in netcluster.pids_in(node.netns):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            procs[name] = procs.get(name, 0) + 1
        lines.append(f"  processes: {dict(sorted(procs.items()))}")
        log = node.temp_dir / "start.log"
        if log.exists():
            lines.append("  start.log (tail): " + " | ".join(log.read_text().splitlines()[-6:]))
        return "\n".join(lines)

    def replica_ids_on(self, ip: str) -> frozenset:
        ips = self.node_ips()
        return frozenset(
            a.name.rsplit("#", 1)[1]
            for a in self.actors("ServeReplica:ballast:BallastModel")
            if ips.get(a.node_id) == ip
        )


def model_replicas_on(cluster: Cluster, ip: str) -> int:
    return sum(1 for where in cluster.where(MODEL) if where == ip)


def steady(cluster: Cluster) -> None:
    """Every endpoint answers and the model has its replicas before a fault starts."""
    wait_until(lambda: all(netcluster.ready(n) for n in cluster.nodes), 180, 2, "every endpoint ready")
    wait_until(lambda: len(cluster.where(MODEL)) >= MIN_REPLICAS, 180, 2, "the model's replicas")


def worker_without_controller(cluster: Cluster) -> netcluster.Node:
    """A worker the Ballast controller is not on (the controller's node lost is a fault of its own)."""
    controller_at = cluster.where("Controller")
    return next(w for w in reversed(cluster.workers) if w.ip not in controller_at)


def wait_until(
    pred: Callable[[], Any],
    timeout_s: float,
    interval_s: float = 1.0,
    what: str = "condition",
    diagnose: Callable[[], str] | None = None,
) -> Any:
    """``pred()`` true within ``timeout_s``; if not, fail with its last answer and, when
    given, ``diagnose()``'s account of what was found instead."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # noqa: BLE001 - the state API may be answering slowly mid-fault
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval_s)
    found = ""
    if diagnose is not None:
        try:
            found = "\n" + diagnose()
        except Exception as e:  # noqa: BLE001 - a diagnosis that fails must not hide the timeout
            found = f"\n(diagnosis failed: {e!r})"
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r}){found}")


def wait_clean(load: Any, since: float, window_s: float = 12.0, timeout_s: float = 150.0) -> float:
    """Wait for ``window_s`` of traffic without one failure (longer than a request's
    timeout, so a late failure cannot hide); returns when the failures stopped."""

    def clean() -> float | None:
        last = load.report.last_failure(since) or since
        if time.monotonic() - last >= window_s and load.report.count(since=last + 1) > 0:
            return last
        return None

    return wait_until(clean, timeout_s, 1.0, f"{window_s:.0f} s of traffic without a failure")


def _per_10s(offsets: list[float]) -> str:
    if not offsets:
        return "-"
    counts = [0] * (int(max(offsets) // 10) + 1)
    for off in offsets:
        counts[int(off // 10)] += 1
    return "/".join(map(str, counts))


def report_row(fault: str, load: Any, t_fault: float, t_recovered: float | None, **extra: Any) -> dict[str, Any]:
    """One line of the fault report: requests, failures by cause (keyed / not), recovery."""
    rep = load.report
    row = {
        "fault": fault,
        "requests": rep.count(),
        "streams": sum(o.stream for o in rep.outcomes),
        "keyed_failures": dict(rep.failures(True)),
        "other_failures": dict(rep.failures(False)),
        # Carried on after losing their replica (the server) or their router (the client's
        # resume); sent again by the balancer after their node went away without answering.
        "migrated": rep.migrated(),  # over the whole load: those in flight at the fault were sent before it
        "resumed": sum(o.resumed for o in rep.outcomes),
        "resent": rep.resent(),
        "recover_s": None if t_recovered is None else round(t_recovered - t_fault, 1),
        "failures_stop_s": None if rep.last_failure(t_fault) is None else round(rep.last_failure(t_fault) - t_fault, 1),
        "max_level": rep.max_level(),
        # When the failures happened: how many in each 10 s after the fault.
        "per_10s": _per_10s([o.t - t_fault for o in rep.outcomes if o.cause != "ok" and o.t >= t_fault]),
        # Which policy refused, for the refusals among them (the three most common kinds).
        "refused": dict(rep.refusals(t_fault).most_common(3)),
        # Why the level stood at 2 or above (2 sheds the sheddable classes, 3 all but critical_plus).
        "level_reasons": dict(rep.level_reasons(2, t_fault).most_common(3)),
        # The first samples at 2 or above with their numbers (s after the fault, level, reason).
        "level_detail": [
            (round(x.t - t_fault, 1), x.level, x.reason) for x in rep.levels if x.level >= 2 and x.t >= t_fault
        ][:6],
        **extra,
    }
    REPORT.append(row)
    return row
