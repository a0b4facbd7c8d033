"""A real three-node Ray cluster on this machine (loadtest/netcluster.py) for fault tests.

Made here (about 30 s: three ``ray start`` in their own network namespaces, then
``serve deploy``) and removed when the module's tests end, before the integration
tests start their own local Ray. A test that breaks it (``cluster.broken = True``)
gets the next test a new one, so each fault starts from a whole cluster; a test that
needs GCS fault tolerance asks for ``redis_cluster``. Where namespaces cannot be
made (no root, no ``ip``), or a cluster is already up (``make cluster-up``: these tests
make their own), every test here skips and says why. The session ends by printing the
fault report (clusterkit.REPORT).
"""

from __future__ import annotations

import pytest
from clusterkit import REPORT, Cluster

from loadtest import netcluster


class _Clusters:
    """The cluster the module's tests share, made again when a test broke it."""

    def __init__(self) -> None:
        self.current: Cluster | None = None

    def get(self, redis: bool) -> Cluster:
        c = self.current
        if c is not None and not c.broken and c.state["redis"] == redis:
            return c
        if c is not None:
            netcluster.down()
            self.current = None
        try:
            self.current = Cluster(netcluster.up(redis=redis))
        except BaseException:
            netcluster.down()  # a start that failed half-way leaves nothing behind
            raise
        return self.current

    def close(self) -> None:
        if self.current is not None:
            netcluster.down()
            self.current = None


@pytest.fixture(scope="module")
def _clusters():
    why = netcluster.can_make_namespaces()
    if why is None and netcluster.our_namespaces():
        why = "a local cluster is already up (`make cluster-down` first): these tests make their own"
    if why:
        pytest.skip(f"no local cluster here: {why}")
    clusters = _Clusters()
    try:
        yield clusters
    finally:
        clusters.close()


@pytest.fixture()
def cluster(_clusters) -> Cluster:
    return _clusters.get(redis=False)


@pytest.fixture()
def redis_cluster(_clusters) -> Cluster:
    return _clusters.get(redis=True)


def _refused(row: dict) -> str:
    refused = row.get("refused") or {}
    reasons = row.get("level_reasons") or {}
    out = "; refused: " + ", ".join(f"{k} ×{n}" for k, n in refused.items()) if refused else ""
    if reasons:
        out += "; level >= 2 for: " + ", ".join(f"{k} ×{n} s" for k, n in reasons.items())
    return out


def pytest_terminal_summary(terminalreporter):
    if not REPORT:
        return
    w = terminalreporter
    w.section("local cluster: faults under load")
    w.line(
        "| fault | requests (streams) | keyed failures | other failures (cause: n) "
        "| migrated (requests / moves; resumed by clients) "
        "| sent again by the balancer | failures per 10 s | failures stop after s | recovered after s "
        "| max level | notes |"
    )
    w.line("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in REPORT:
        other = ", ".join(f"{k}: {v}" for k, v in sorted(r["other_failures"].items())) or "0"
        keyed = ", ".join(f"{k}: {v}" for k, v in sorted(r["keyed_failures"].items())) or "0"
        moved = r.get("migrated") or (0, 0)
        w.line(
            f"| {r['fault']} | {r['requests']} ({r.get('streams', 0)}) | {keyed} | {other} "
            f"| {moved[0]} / {moved[1]}; {r.get('resumed', 0)} "
            f"| {r.get('resent', 0)} | {r['per_10s']} | {r['failures_stop_s']} | {r['recover_s']} "
            f"| {r['max_level']} | {r.get('notes', '')}{_refused(r)} |"
        )
    for r in REPORT:
        for t, level, reason in r.get("level_detail") or ():
            w.line(f"  {r['fault']}: level {level} at {t} s after the fault: {reason}")
