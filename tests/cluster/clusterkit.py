"""Helpers for the local cluster's fault tests: what runs where, waiting, the report.

(The fixture is in conftest.py; a module of its own so test modules import these by a
name no other test directory uses.)

Each fault test adds a row to ``REPORT``; the session ends by printing the rows
(requests, failures by cause, time to recover), and ``make test-cluster`` shows them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import httpx

from serve_app.ops import netcluster

REPORT: list[dict[str, Any]] = []


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

    def node(self, ip: str) -> netcluster.Node:
        return next(n for n in self.nodes if n.ip == ip)

    # -- what runs where (Ray's state API through the head's dashboard) -------------
    def node_ips(self) -> dict[str, str]:
        from ray.util.state import list_nodes

        return {n.node_id: n.node_ip for n in list_nodes(address=self.dashboard, raise_on_missing_output=False)}

    def ray_state(self, ip: str) -> str:
        """Ray's word on the node at ``ip``: "ALIVE" if any of its entries is, else "DEAD"."""
        from ray.util.state import list_nodes

        states = {n.state for n in list_nodes(address=self.dashboard, raise_on_missing_output=False) if n.node_ip == ip}
        return "ALIVE" if "ALIVE" in states else "DEAD"

    def actors(self, class_prefix: str = "") -> list[Any]:
        from ray.util.state import list_actors

        alive = list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")], limit=1000,
                            raise_on_missing_output=False, detail=True)
        return [a for a in alive if a.class_name.startswith(class_prefix)]

    def where(self, class_prefix: str) -> list[str]:
        """The node IPs of the alive actors whose class starts with ``class_prefix``."""
        ips = self.node_ips()
        return [ips.get(a.node_id, "?") for a in self.actors(class_prefix)]

    def generate(self, endpoint: str, headers: Optional[dict[str, str]] = None, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(f"{endpoint}/v1/generate", timeout=30,
                          headers={"Authorization": f"Bearer {self.gold}", **(headers or {})},
                          json={"prompt": "hello", "max_tokens": max_tokens})

    def admin_call(self, method: str, path: str, endpoint: Optional[str] = None, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{endpoint or self.workers[0].endpoint}{path}", headers=self.admin, timeout=30, **kw)

    def events(self, endpoint: str) -> list[dict[str, Any]]:
        """The controller's recent recycle/kill events (``/admin/replicas``)."""
        return self.admin_call("GET", "/admin/replicas", endpoint).json()["events"]


def wait_until(pred: Callable[[], Any], timeout_s: float, interval_s: float = 1.0, what: str = "condition") -> Any:
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
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def wait_clean(load: Any, since: float, window_s: float = 12.0, timeout_s: float = 150.0) -> float:
    """Wait for ``window_s`` of traffic without one failure (longer than a request's
    timeout, so a late failure cannot hide); returns when the failures stopped."""

    def clean() -> Optional[float]:
        last = load.report.last_failure(since) or since
        if time.monotonic() - last >= window_s and load.report.count(since=last + 1) > 0:
            return last
        return None

    return wait_until(clean, timeout_s, 1.0, f"{window_s:.0f} s of traffic without a failure")


def report_row(fault: str, load: Any, t_fault: float, t_recovered: Optional[float], **extra: Any) -> dict[str, Any]:
    """One line of the fault report: requests, failures by cause (keyed / not), recovery."""
    rep = load.report
    row = {
        "fault": fault,
        "requests": rep.count(),
        "keyed_failures": dict(rep.failures(True)),
        "other_failures": dict(rep.failures(False)),
        "recover_s": None if t_recovered is None else round(t_recovered - t_fault, 1),
        "failures_stop_s": None if rep.last_failure(t_fault) is None else round(rep.last_failure(t_fault) - t_fault, 1),
        "max_level": rep.max_level(),
        **extra,
    }
    REPORT.append(row)
    return row


