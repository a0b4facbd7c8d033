"""Faults on a real three-node cluster (a head, two workers, each in its own network
namespace) under steady load through every node's endpoint.

``make test`` runs what matters most and costs least: where watchdogs sit, an
Idempotency-Key retried through another node, and a worker killed under load with no
request lost (keyed or not, unary or stream) and the level no higher than 1. ``make test-cluster`` runs every fault
(``BALLAST_CLUSTER_SUITE=full``) and prints the report. Each fault starts from a
whole cluster (conftest.py makes a new one after a test broke it).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from clusterkit import (
    MIN_REPLICAS,
    MODEL,
    REPORT,
    ROUTER,
    full_suite,
    model_replicas_on,
    report_row,
    steady,
    wait_clean,
    wait_until,
    worker_without_controller,
)

from loadtest import netcluster


def test_every_watchdog_sits_on_its_replicas_node(cluster):
    steady(cluster)
    ips = cluster.node_ips()
    replicas = {a.name: ips.get(a.node_id) for a in cluster.actors(MODEL)}
    # A replica starts its watchdog once its model is loaded: wait for each one's.
    wait_until(
        lambda: {f"Watchdog({n})" for n in replicas} <= {a.repr_name for a in cluster.actors("Watchdog")},
        60,
        1,
        "a watchdog for every replica",
    )
    watchdogs = {a.repr_name: ips.get(a.node_id) for a in cluster.actors("Watchdog")}
    # The head starts with --num-cpus=0: no model replica, router or controller there.
    assert replicas and cluster.head.ip not in replicas.values(), replicas
    assert cluster.head.ip not in cluster.where(ROUTER) + cluster.where("Controller")
    for name, ip in replicas.items():
        assert watchdogs.get(f"Watchdog({name})") == ip, (name, ip, watchdogs)


def test_an_idempotency_key_sent_through_every_node_is_answered_once(cluster):
    steady(cluster)
    assert len(set(cluster.where(ROUTER))) == 2  # a router on each worker: keys cross routers
    for _ in range(3):
        key = uuid.uuid4().hex
        # Two at once through each node's endpoint: the retries a client sends when it
        # times out on one node and tries the next.
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(
                    lambda e, key=key: cluster.generate(e, {"Idempotency-Key": key}, max_tokens=24),
                    cluster.endpoints * 2,
                )
            )
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert len({a.json()["text"] for a in answers}) == 1
        generated = [a for a in answers if a.headers.get("x-ballast-idempotent-replay") != "true"]
        assert len(generated) == 1, [dict(a.headers) for a in answers]
        # A retry later through another node: the first answer again, nothing generated.
        again = cluster.generate(cluster.head.endpoint, {"Idempotency-Key": key}, max_tokens=24)
        assert (
            again.headers.get("x-ballast-idempotent-replay") == "true"
            and again.json()["text"] == answers[0].json()["text"]
        )


def lost_nothing(rep, row) -> None:
    """No request failed, of any kind, and the level stayed where the survivors could
    carry the load: a lost node is a capacity gap, not a model error. What the routers
    cannot mend, the balancer and the client do (loadtest/cluster_load.py): a request
    that got no answer from the lost node's endpoint is sent again elsewhere, and a
    stream cut at its router there is resumed by its client (counted as migrated)."""
    assert rep.failures() == {}, row
    assert rep.max_level() <= 1, row


def test_a_worker_killed_under_load_loses_no_request(cluster):
    steady(cluster)
    victim = worker_without_controller(cluster)  # the controller's node lost is its own fault
    survivor = next(w for w in cluster.workers if w != victim)
    lost = cluster.replica_ids_on(victim.ip)
    load = cluster.load(duration_s=240)
    try:
        time.sleep(8)  # steady traffic before the fault
        t_fault = time.monotonic()
        cluster.broken = True
        killed = netcluster.kill_node(victim)
        # Serve starts the lost replicas again on the worker that is left.
        wait_until(
            lambda: model_replicas_on(cluster, survivor.ip) >= MIN_REPLICAS,
            180,
            2,
            "the model's replicas back on the surviving worker",
        )
        t_recovered = time.monotonic()
        # Others fail only around the loss (in flight there, or sent to its endpoint
        # before the balancer marked it down), then stop.
        wait_clean(load, t_fault)
    finally:
        load.stop()
    rep = load.report
    row = report_row(
        "worker killed",
        load,
        t_fault,
        t_recovered,
        notes=f"{killed} processes of {victim.name} killed; "
        f"replicas killed as hung: {cluster.hung_kills(survivor.endpoint, lost)}; "
        f"{cluster.router_views([survivor.endpoint, cluster.head.endpoint])}",
    )
    lost_nothing(rep, row)
    # The lost node's watchdogs died with it (once Ray has seen the node go); the new
    # replicas have theirs beside them.
    wait_until(lambda: victim.ip not in cluster.where("Watchdog"), 60, 1, "the lost node's watchdogs gone")
    wait_until(
        lambda: cluster.where("Watchdog").count(survivor.ip) >= MIN_REPLICAS, 60, 1, "the new replicas' watchdogs"
    )


@full_suite
def test_a_partitioned_worker_loses_no_request_and_nothing_stays_stuck(cluster):
    steady(cluster)
    victim = worker_without_controller(cluster)
    survivor = next(w for w in cluster.workers if w != victim)
    lost = cluster.replica_ids_on(victim.ip)
    load = cluster.load(duration_s=300)
    try:
        time.sleep(8)
        t_fault = time.monotonic()
        cluster.broken = True
        netcluster.link(victim, up=False)
        time.sleep(30)
        netcluster.link(victim, up=True)
        t_healed = time.monotonic()
        # Ray takes the node back, or declares it dead once it hears from it again (its
        # raylet then stops). A dead node is replaced, as ray up's autoscaler would: here
        # by starting it again in its namespace.
        end = time.monotonic() + 60
        while time.monotonic() < end and cluster.ray_state(victim.ip) == "ALIVE":
            time.sleep(2)
        rejoined = cluster.ray_state(victim.ip) == "ALIVE"
        if not rejoined:
            t_dead = time.monotonic()
            netcluster.kill_node(victim)
            netcluster.start_node(victim, cluster.head, redis=False)
        wait_until(
            lambda: netcluster.ready(victim) and cluster.ray_state(victim.ip) == "ALIVE",
            180,
            2,
            f"the partitioned node serving again ({'rejoined' if rejoined else 'started again'})",
            diagnose=lambda: cluster.diagnose(victim),
        )
        wait_until(lambda: len(cluster.where(MODEL)) >= MIN_REPLICAS, 180, 2, "the model's replicas")
        t_recovered = time.monotonic()
        wait_clean(load, t_fault)  # nothing stays stuck: failures stop
    finally:
        load.stop()
    rep = load.report
    fate = "rejoined" if rejoined else f"declared dead {t_dead - t_healed:.0f} s after it, started again"
    row = report_row(
        "network partition (30 s)",
        load,
        t_fault,
        t_recovered,
        notes=f"link back after {t_healed - t_fault:.0f} s; {victim.name} {fate}; "
        f"replicas killed as hung: {cluster.hung_kills(survivor.endpoint, lost)}; "
        f"{cluster.router_views([survivor.endpoint, cluster.head.endpoint])}",
    )
    lost_nothing(rep, row)


@full_suite
def test_the_controllers_node_lost_brings_it_back_elsewhere_with_its_state(cluster):
    steady(cluster)
    home = cluster.node(cluster.where("Controller")[0])
    survivor = next(w for w in cluster.workers if w != home)
    switch = cluster.admin_call(
        "POST",
        "/admin/kill-switch",
        survivor.endpoint,
        json={"scope": "tenant", "value": "free", "reason": "survives the controller's node", "expires_in_s": 600},
    ).json()
    epoch = cluster.admin_call("GET", "/v1/status", survivor.endpoint).json()["snapshot"]["epoch"]
    lost = cluster.replica_ids_on(home.ip)
    load = cluster.load(duration_s=300)
    try:
        time.sleep(8)
        t_fault = time.monotonic()
        cluster.broken = True
        netcluster.kill_node(home)
        wait_until(lambda: cluster.where("Controller") == [survivor.ip], 120, 1, "the controller on the other worker")
        status = lambda: cluster.admin_call("GET", "/v1/status", survivor.endpoint).json()  # noqa: E731
        wait_until(
            lambda: (
                status()["snapshot"]["epoch"] != epoch
                and {m["source"] for m in status()["models"].values()} == {"snapshot"}
            ),
            60,
            1,
            "routers following the new controller",
        )
        t_recovered = time.monotonic()
        wait_until(lambda: model_replicas_on(cluster, survivor.ip) >= MIN_REPLICAS, 180, 2, "replicas on the survivor")
        wait_clean(load, t_fault)
    finally:
        load.stop()
    after = status()
    row = report_row(
        "controller's node killed",
        load,
        t_fault,
        t_recovered,
        notes=f"controller back on {survivor.name}; "
        f"replicas killed as hung: {cluster.hung_kills(survivor.endpoint, lost)}",
    )
    lost_nothing(load.report, row)
    # Its state came back: the kill switch is enforced, quota leases are issued again.
    assert [k["id"] for k in after["kill_switches"]] == [switch["id"]], after["kill_switches"]
    free = {"Authorization": f"Bearer {cluster.state['keys']['free']}"}
    r = cluster.generate(survivor.endpoint, free)
    assert r.status_code == 503 and r.json()["error"]["code"] == "KILL_SWITCH"
    wait_until(lambda: status()["quotas"].get("gold", {}).get("lease"), 30, 1, "a quota lease for gold")


@full_suite
def test_the_head_lost_with_gcs_fault_tolerance_workers_keep_answering(redis_cluster):
    cluster = redis_cluster
    steady(cluster)
    head = cluster.head
    workers = [w.endpoint for w in cluster.workers]
    load = cluster.load(workers, duration_s=300)
    try:
        time.sleep(8)
        t_fault = time.monotonic()
        cluster.broken = True
        netcluster.kill_node(head)
        time.sleep(20)  # the head is down: the workers' endpoints keep answering
        t_back = time.monotonic()
        netcluster.start_node(head, head, redis=True)
        wait_until(lambda: netcluster.ready(head), 180, 2, "the head's endpoint")
        wait_until(lambda: len(cluster.where(MODEL)) >= MIN_REPLICAS, 120, 2, "the cluster's state back")
        t_recovered = time.monotonic()
        wait_clean(load, t_fault)
    finally:
        load.stop()
    rep = load.report
    down = [o for o in rep.outcomes if t_fault <= o.t < t_back]
    row = report_row(
        "head killed (GCS on Redis), back after 20 s",
        load,
        t_fault,
        t_recovered,
        notes=f"{len(down)} requests while the head was down, "
        f"{sum(o.cause != 'ok' for o in down)} failed; "
        f"replicas killed as hung: {cluster.hung_kills(cluster.workers[0].endpoint)}",
    )
    assert len(down) > 0 and rep.failures(keyed=True) == {}, row
    assert all(o.cause == "ok" for o in down if not o.keyed), row


@full_suite
def test_a_recycle_in_flight_on_a_lost_worker_does_not_block_the_next(cluster):
    steady(cluster)
    victim = worker_without_controller(cluster)
    survivor = next(w for w in cluster.workers if w != victim)
    ips = cluster.node_ips()
    doomed = next(a.name.rsplit("#", 1)[1] for a in cluster.actors(MODEL) if ips.get(a.node_id) == victim.ip)
    r = cluster.admin_call("POST", "/admin/recycle", survivor.endpoint, json={"replica_id": doomed})
    assert r.status_code == 202 and r.json()["accepted"] == [doomed], r.text

    def recycling(replica_id: str) -> bool:
        state = cluster.admin_call("GET", "/admin/replicas", survivor.endpoint).json()
        return replica_id in repr([state["in_flight"], state["surging"], state["leases"]])

    wait_until(lambda: recycling(doomed), 60, 1, "the recycle of the victim's replica in flight")
    t_fault = time.monotonic()
    cluster.broken = True
    netcluster.kill_node(victim)  # with its replica's recycle lease open
    wait_until(lambda: model_replicas_on(cluster, survivor.ip) >= MIN_REPLICAS, 180, 2, "replicas on the survivor")
    # The next recycle goes: the lost replica's lease was released or expired, not left to block it.
    ips = cluster.node_ips()
    nxt = next(a.name.rsplit("#", 1)[1] for a in cluster.actors(MODEL) if ips.get(a.node_id) == survivor.ip)
    wait_until(
        lambda: nxt in repr(cluster.admin_call("GET", "/admin/replicas", survivor.endpoint).json()["replicas"]),
        60,
        1,
        "the new replica reporting to the controller",
    )
    t_asked = time.monotonic()
    r = cluster.admin_call("POST", "/admin/recycle", survivor.endpoint, json={"replica_id": nxt})
    assert r.status_code == 202 and r.json()["accepted"] == [nxt], r.text
    wait_until(lambda: nxt not in repr([a.name for a in cluster.actors(MODEL)]), 240, 2, "the next recycle done")
    took = time.monotonic() - t_asked
    events = [e["outcome"] for e in cluster.events(survivor.endpoint)]
    REPORT.append(
        {
            "fault": "worker killed mid-recycle",
            "requests": 0,
            "keyed_failures": {},
            "other_failures": {},
            "per_10s": "-",
            "failures_stop_s": None,
            "recover_s": None,
            "max_level": "-",
            "notes": f"next recycle asked {t_asked - t_fault:.0f} s after the loss, its replica gone "
            f"{took:.0f} s later; controller events: {events}",
        }
    )
