"""The local cluster's plan (loadtest/netcluster.py): cluster.yaml's own start
commands as one machine runs them, the deploy config, and where load may go.

The cluster itself (namespaces, ``ray start``, faults) runs in tests/cluster.
"""

from __future__ import annotations

import re

import pytest
import yaml

from ballast.config import load_config
from loadtest import netcluster
from loadtest.cluster_load import ClusterLoad, LevelSample, LoadReport, Outcome, _Progress, check_own, message_kind

NODES = netcluster.nodes(2)
HEAD, W1 = NODES[0], NODES[1]


def cloud_commands(kind: str) -> list[str]:
    spec = yaml.safe_load((netcluster.REPO / "cluster" / "cluster.yaml").read_text())
    return [" ".join(c.split()) for c in spec[f"{kind}_start_ray_commands"]]


def ray_start(commands: list[str]) -> str:
    (cmd,) = [c for c in commands if "ray start" in c]
    return cmd


@pytest.mark.parametrize("kind,node", [("head", HEAD), ("worker", W1)])
def test_the_local_nodes_run_cluster_yamls_own_start_commands(kind, node):
    local = netcluster.start_commands(kind, node, HEAD, redis=False)
    cloud = [c for c in cloud_commands(kind) if not c.endswith("ray stop")]
    assert len(local) == len(cloud) == (2 if kind == "head" else 1)  # the head starts the batch store too
    # Every flag and variable the cloud command sets is set here too, unchanged...
    for token in ray_start(cloud).replace("~/ballast", str(netcluster.REPO)).replace("$RAY_HEAD_IP", HEAD.ip).split():
        if not token.startswith("--autoscaling-config"):
            assert token in ray_start(local).split(), token
    # ...and what one machine adds: the node's IP, its own temp dir and HAProxy files.
    assert f"--node-ip-address={node.ip}" in ray_start(local)
    assert f"--temp-dir={node.temp_dir / 'ray'}" in ray_start(local)
    assert f"RAY_SERVE_HAPROXY_SOCKET_PATH={node.haproxy_dir}/admin.sock" in ray_start(local)
    assert "--autoscaling-config" not in ray_start(local) and "RAY_REDIS_ADDRESS" not in ray_start(local)


def test_the_local_head_starts_the_batch_store_as_the_clouds_does():
    (cloud,) = [c for c in cloud_commands("head") if "batch_store.sh" in c]
    (local,) = [c for c in netcluster.start_commands("head", HEAD, HEAD, redis=False) if "batch_store.sh" in c]
    # The cloud's command, before Ray's; here the script of this checkout, its data in the
    # head's temp dir, its password in the cluster's state (where `up` writes it), and the
    # address the head's namespace has, as the head's machine has its own.
    assert cloud_commands("head").index(cloud) < cloud_commands("head").index(ray_start(cloud_commands("head")))
    script, data, *_ = local.split()
    assert script == f"{netcluster.REPO}/cluster/batch_store.sh" and data == str(HEAD.temp_dir / "store")
    assert local.endswith(f" 6380 {netcluster.STORE_PASSWORD}") and "~" not in local
    assert "\"$(hostname -I | cut -d' ' -f1)\"" in local and "hostname -I" in cloud
    assert not any("batch_store" in c for c in netcluster.start_commands("worker", W1, HEAD, redis=False))


def test_ray_stop_is_not_run_on_a_machine_every_node_shares():
    for kind in ("head", "worker"):
        assert any(c.endswith("ray stop") for c in cloud_commands(kind))
        assert not any(re.search(r"ray stop", c) for c in netcluster.start_commands(kind, W1, HEAD, redis=False))


def test_gcs_fault_tolerance_points_the_head_and_only_the_head_at_redis():
    head = ray_start(netcluster.start_commands("head", HEAD, HEAD, redis=True))
    worker = ray_start(netcluster.start_commands("worker", W1, HEAD, redis=True))
    assert f"RAY_REDIS_ADDRESS={netcluster.REDIS_IP}:{netcluster.GCS_PORT}" in head
    assert "RAY_REDIS_ADDRESS" not in worker
    assert f"--address={HEAD.ip}:{netcluster.GCS_PORT}" in worker
    # The head authenticates to Redis with the password `up --redis` wrote, read when the
    # command runs (the command itself, logged in start.log, holds no password).
    assert f'--redis-username=default --redis-password="$(cat {netcluster.REDIS_PASSWORD})"' in head
    assert "redis-password" not in worker
    assert "redis-password" not in ray_start(netcluster.start_commands("head", HEAD, HEAD, redis=False))


def test_the_gcs_redis_requires_its_password_and_its_files_are_private(tmp_path):
    conf = netcluster.redis_conf("pw-123", tmp_path)
    lines = conf.splitlines()
    assert "requirepass pw-123" in lines and f"bind {netcluster.REDIS_IP}" in lines
    assert f"port {netcluster.GCS_PORT}" in lines and "protected-mode no" not in lines
    path = tmp_path / "redis.conf"
    netcluster._write_private(path, conf)
    assert path.read_text() == conf and path.stat().st_mode & 0o777 == 0o600


def test_every_node_authenticates_and_the_head_runs_no_work():
    head, worker = cloud_commands("head")[-1], cloud_commands("worker")[-1]
    assert "RAY_AUTH_MODE=token" in head and "RAY_AUTH_MODE=token" in worker
    assert "--num-cpus=0" in head and "--num-cpus" not in worker


def test_haproxy_socket_paths_fit_haproxys_limit_with_serves_node_id():
    # Serve puts its files under <dir>/<56-character node id>/; HAProxy takes 97 at most.
    for node in NODES:
        assert len(f"{node.haproxy_dir}/{'x' * 56}/metrics.sock") <= 97


def test_the_deploy_config_is_serve_config_yaml_with_keys_from_files(tmp_path):
    spec = netcluster.serve_config(tmp_path / "keys", tmp_path / "admin", workers=2)
    keys = tmp_path / "keys"
    keys.write_text("k-gold=gold\n")
    (tmp_path / "admin").write_text("adm\n")
    cfg = load_config(spec["applications"][0]["args"]["config"])
    assert cfg.environment == "production" and not cfg.auth.demo_keys and not cfg.chaos.enabled
    assert cfg.auth.api_keys_file == str(keys)
    assert cfg.model.device == "cpu" and cfg.deployments.model.num_gpus == 0
    assert cfg.deployments.model.min_replicas == 2 and cfg.deployments.router.num_replicas == 2
    # Off the head: the controller asks for a CPU share the head (--num-cpus=0) has not.
    assert cfg.controller.num_cpus > 0
    assert spec["proxy_location"] == "EveryNode"
    # A router on each worker, so each worker runs Serve's proxy (Serve starts one only
    # where a replica runs), the one that replaces a lost worker too.
    from ballast.router.app import router_deployment

    assert cfg.deployments.router.max_replicas_per_node == 1
    assert router_deployment(cfg)._replica_config.max_replicas_per_node == 1
    # The batch store on the head's address, at serve_config.yaml's port, with the password
    # `up` writes; the admin routes on the public port, where the tests (the operator) are.
    assert cfg.batch.enabled and cfg.batch.store_url == f"redis://{HEAD.ip}:6380/0"
    assert cfg.batch.store_password_file == str(netcluster.STORE_PASSWORD)
    assert cfg.http.admin_port is None


def test_no_privilege_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(netcluster.os, "geteuid", lambda: 1000)
    assert "root" in netcluster.can_make_namespaces()
    with pytest.raises(netcluster.ClusterError, match="cannot make the local cluster here: .*root"):
        netcluster.up()


@pytest.mark.parametrize("url", ["http://10.77.0.11:8000", "http://127.0.0.1:8123"])
def test_load_goes_to_loopback_and_the_clusters_own_namespaces(url):
    assert check_own(url) == url


@pytest.mark.parametrize("url", ["http://10.77.1.11:8000", "http://192.168.1.5:8000", "http://8.8.8.8"])
def test_load_refuses_any_other_address(url):
    with pytest.raises(ValueError, match="only to loopback"):
        check_own(url)


def test_the_load_report_counts_failures_by_cause_and_time():
    rep = LoadReport(
        [
            Outcome(1.0, "a", True, "ok", level=1),
            Outcome(2.0, "a", False, "connect"),
            Outcome(3.0, "b", False, "http_503_OVERLOADED"),
            Outcome(4.0, "b", True, "ok", attempts=2, level=2),
            Outcome(5.0, "b", False, "ok"),
        ]
    )
    assert rep.failures(keyed=False) == {"connect": 1, "http_503_OVERLOADED": 1}
    assert rep.failures(keyed=False, since=2.5) == {"http_503_OVERLOADED": 1}
    assert rep.failures(keyed=True) == {}
    assert rep.count() == 5 and rep.count(keyed=True) == 2 and rep.count(since=3.0, until=5.0) == 2
    assert rep.max_level() == 2 and rep.last_failure() == 3.0 and rep.last_failure(since=3.5) is None


def test_what_the_load_sends_again_as_a_balancer_and_the_sdk_would():
    nothing, streamed, from_fallback = _Progress(), _Progress(2, [104, 105], 2), _Progress(1, [], 3, resumable=False)
    resend = ClusterLoad._resend
    assert resend("connect", False, nothing) and resend("dropped", False, nothing)  # no answer at all
    assert resend("cut", False, streamed) and streamed.resume() == {"ids": [104, 105], "text_chars": 2}
    assert not resend("cut", False, from_fallback)  # the fallback's tokens carry no ids to resume from
    assert nothing.resume() is None  # nothing reached the client: a plain re-send
    assert not resend("timeout", False, nothing) and resend("timeout", True, nothing)  # only with a key
    assert resend("http_503_REPLICA_LOST", True, nothing) and not resend("http_503_REPLICA_LOST", False, nothing)
    assert not resend("http_422_INVALID_REQUEST", True, nothing)


def test_streams_resumed_by_the_client_count_as_migrated():
    rep = LoadReport(
        [
            Outcome(1.0, "a", False, "ok", stream=True, migrations=1),
            Outcome(2.0, "b", False, "ok", attempts=2, stream=True, resumed=1),
            Outcome(3.0, "b", False, "ok", stream=True),
        ]
    )
    assert rep.migrated() == (2, 2) and rep.migrated(since=1.5) == (1, 1)
    assert rep.resent() == 1 and rep.failures() == {}


def test_refusals_count_together_by_the_policy_that_refused():
    why_level = message_kind("degradation level 2 does not admit criticality 'sheddable'")
    why_gate = message_kind("no model capacity for 'critical' within the request's deadline (slow)")
    assert why_level == message_kind("degradation level 3 does not admit criticality 'critical'")
    assert why_level != why_gate
    rep = LoadReport(
        [
            Outcome(1.0, "a", False, "http_503_OVERLOADED", why=why_gate),
            Outcome(2.0, "a", True, "http_503_OVERLOADED", why=why_gate),
            Outcome(3.0, "b", False, "http_503_OVERLOADED", why=why_level),
            Outcome(4.0, "b", False, "connect"),
        ]
    )
    assert rep.refusals() == {f"http_503_OVERLOADED: {why_gate}": 2, f"http_503_OVERLOADED: {why_level}": 1}
    assert rep.refusals(since=2.5) == {f"http_503_OVERLOADED: {why_level}": 1}


def test_the_level_counts_where_nothing_was_answered():
    # At level 4 no request is answered: only the sampled status sees it.
    rep = LoadReport(
        [Outcome(1.0, "a", True, "ok", level=1), Outcome(2.0, "a", True, "http_503_OVERLOADED")],
        levels=[
            LevelSample(1.5, 4, "up 3->4: queue_wait_ms_p95=900>=800"),
            LevelSample(2.5, 3, "up 2->3: error_rate=0.2>=0.1 (n=50)"),
            LevelSample(3.5, 1, "down 3->1"),
        ],
    )
    assert rep.max_level() == 4 and rep.max_level(since=2.0) == 3
    assert rep.level_reasons(3) == {
        message_kind("up 3->4: queue_wait_ms_p95=900>=800"): 1,
        message_kind("up 2->3: error_rate=0.2>=0.1 (n=50)"): 1,
    }


def test_a_bridge_left_by_a_killed_cluster_is_cleared(monkeypatch):
    # A cluster killed mid-way whose namespaces were removed by hand keeps its bridge;
    # the next `up` failed on `ip link add` (a clean clone's CI did). A real bridge, under
    # a name of its own so that no running cluster's is touched.
    why = netcluster.can_make_namespaces()
    if why:
        pytest.skip(why)
    monkeypatch.setattr(netcluster, "BRIDGE", "blsttest0")
    netcluster._sh("ip", "link", "add", "blsttest0", "type", "bridge")
    try:
        assert "blsttest0" in netcluster.clear_links()
        assert netcluster._sh("ip", "link", "show", "blsttest0", check=False).returncode != 0
        assert "blsttest0" not in netcluster.clear_links()  # nothing left: nothing named
    finally:
        netcluster._sh("ip", "link", "del", "blsttest0", check=False)
