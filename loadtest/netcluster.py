"""A real multi-node Ray cluster on one machine: a head and workers, each in its own
network namespace with its own IP, started with cluster/cluster.yaml's own commands.

    python -m loadtest.netcluster up [--workers 2] [--redis]   # make cluster-up
    python -m loadtest.netcluster down                         # make cluster-down
    python -m loadtest.netcluster status

What ``ray up`` does on a cloud, done with what a laptop has: a bridge (``blst0``,
10.77.0.1/24) stands for the VPC, a namespace per node (``ballast-head``,
``ballast-w1``, ...) with a veth link on it for the machine, and each node runs the
``head_start_ray_commands`` / ``worker_start_ray_commands`` of cluster/cluster.yaml,
changed only where one filesystem and no cloud force it (:func:`start_commands`); the
head's commands start the Batch API's store there too (cluster/batch_store.sh).
Ballast is then deployed with ``serve deploy`` from a config built from
cluster/serve_config.yaml (:func:`serve_config`): keys from files, model replicas on
the workers, HAProxy and Serve's proxy on every node, each node's endpoint its own
``http://<ip>:8000``, the batch store on the head's address.

Faults for the tests (tests/cluster): :func:`kill_node` (every process of a node's
namespace, SIGKILL: the machine lost), :func:`link` (the node's link down or up: a
partition), :func:`start_node` (a node back). ``down`` kills only the processes inside
the namespaces it made, then removes them and the bridge: nothing else on the host is
touched. State (keys, the store's password, the deploy config) lives in ``.run/cluster``,
each node's Ray temp dir, logs and HAProxy files in ``/tmp/ballast-cluster/<node>`` (the
head's batch store in its ``store/``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".run" / "cluster"
TEMP = Path("/tmp/ballast-cluster")
BRIDGE = "blst0"
SUBNET = "10.77.0"
GATEWAY = f"{SUBNET}.1"
REDIS_IP = f"{SUBNET}.5"  # the external store for GCS fault tolerance, in a namespace of its own
REDIS_PASSWORD = STATE / "redis_password"  # its password (mode 0600), made by `up --redis`
STORE_PASSWORD = STATE / "store_password"  # the batch store's (mode 0600), made by `up`
HTTP_PORT = 8000
DASHBOARD_PORT = 8265
GCS_PORT = 6379
PREFIX = "ballast-"  # every namespace this module makes, and only those, start with it


class ClusterError(RuntimeError):
    """The cluster cannot be made here (no privilege, no `ip`) or a step failed."""


@dataclass(frozen=True)
class Node:
    name: str  # "head", "w1", "w2", "redis"
    ip: str

    @property
    def netns(self) -> str:
        return PREFIX + self.name

    @property
    def veth(self) -> str:  # the machine's end of the node's link (the node's end is eth0)
        return "blst-" + self.name

    @property
    def haproxy_dir(self) -> Path:  # Serve adds a 56-character node id; HAProxy takes 97 at most
        return Path(f"/tmp/bc-{self.name}")

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{HTTP_PORT}"

    @property
    def temp_dir(self) -> Path:  # Ray's temp dir and HAProxy's files: a short path (socket names)
        return TEMP / self.name


def nodes(workers: int) -> list[Node]:
    return [Node("head", f"{SUBNET}.10")] + [Node(f"w{i}", f"{SUBNET}.{10 + i}") for i in range(1, workers + 1)]


# -- commands -----------------------------------------------------------------------


def _sh(*args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, **kw)


def can_make_namespaces() -> str | None:
    """None when namespaces and links can be made here, else why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    probe = PREFIX + "probe"
    r = _sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def start_commands(kind: str, node: Node, head: Node, redis: bool) -> list[str]:
    """cluster/cluster.yaml's start commands for ``kind`` ("head" or "worker"), as this
    machine runs them in ``node``'s namespace.

    The same commands, changed only where one machine differs from a cloud:
    - ``ray stop`` is dropped: it stops every Ray process on the machine, all nodes' here;
    - ``~/ballast`` is this checkout; ``$RAY_HEAD_IP`` the head's namespace address;
    - the batch store's data (``~/ballast-store``) is in the head's temp dir, its password
      (``/etc/ballast/store_password``, which setup installs on a cloud) in ``STORE_PASSWORD``;
    - ``--autoscaling-config`` is dropped (no cloud to ask for nodes);
    - each node gets its own ``--temp-dir`` and HAProxy file directory (one filesystem
      here, a disk per machine there) and says its IP (``--node-ip-address``);
    - with ``redis``, the head's GCS keeps its tables in the external Redis
      (``RAY_REDIS_ADDRESS``), Ray's GCS fault tolerance, with its password (read from
      ``REDIS_PASSWORD`` when the command runs, so no command line written here holds it).
    """
    spec = yaml.safe_load((REPO / "cluster" / "cluster.yaml").read_text())
    out = []
    for cmd in spec[f"{kind}_start_ray_commands"]:
        cmd = " ".join(cmd.split())
        if re.fullmatch(r"\S*ray stop", cmd):
            continue
        cmd = cmd.replace("~/ballast-store", str(node.temp_dir / "store"))
        cmd = cmd.replace("/etc/ballast/store_password", str(STORE_PASSWORD))
        cmd = cmd.replace("~/ballast", str(REPO)).replace("$RAY_HEAD_IP", head.ip)
        cmd = re.sub(r"\s--autoscaling-config=\S+", "", cmd)
        haproxy = node.haproxy_dir
        local_env = (
            f"export RAY_SERVE_HAPROXY_CONFIG_FILE_LOC={haproxy}/haproxy.cfg"
            f" RAY_SERVE_HAPROXY_SOCKET_PATH={haproxy}/admin.sock"
            f" RAY_SERVE_HAPROXY_SERVER_STATE_BASE={haproxy}"
            f" RAY_SERVE_HAPROXY_SERVER_STATE_FILE={haproxy}/server-state"
            f" RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH={haproxy}/metrics.sock"
        )
        flags = f"--node-ip-address={node.ip} --temp-dir={node.temp_dir / 'ray'} --disable-usage-stats"
        if redis and kind == "head":
            local_env += f" RAY_REDIS_ADDRESS={REDIS_IP}:{GCS_PORT} RAY_external_storage_namespace=ballast-local"
            flags += f' --redis-username=default --redis-password="$(cat {REDIS_PASSWORD})"'
        cmd = re.sub(r"(\S*ray start)", rf"mkdir -p {haproxy}; {local_env}; \1 {flags}", cmd, count=1)
        out.append(cmd)
    return out


def serve_config(keys_file: Path, admin_file: Path, workers: int) -> dict[str, Any]:
    """cluster/serve_config.yaml with what a CPU-only laptop needs: the built-in model on
    CPU in place of its vLLM models on GPUs (half a Ray CPU a replica where a cloud gives
    it a GPU: a worker that is left can take the lost worker's replicas), one replica per
    worker to start, keys from files.

    One router per worker (``max_replicas_per_node: 1``): Serve runs its proxy and HAProxy
    only on nodes with a replica. In a cloud a replaced GPU worker gets a model replica
    back, and with it a proxy; here the worker that is left takes every model replica,
    and only a router kept off it makes the replacing node serve HTTP again.

    Two more changes, where one machine differs from a cloud: the batch store's name
    (``ballast-store``, which a cloud's setup writes into each worker's /etc/hosts) is the
    head's address here, where every namespace shares one /etc/hosts, and its password is
    ``STORE_PASSWORD``; and the admin routes stay on each node's public port
    (``http.admin_port`` dropped): production serves them on each router node's loopback,
    reached over ssh, and the tests, on this machine outside every namespace, stand for
    that operator."""
    spec = yaml.safe_load((REPO / "cluster" / "serve_config.yaml").read_text())
    app = spec["applications"][0]["args"]["config"]
    # The faults are the cluster's, not the engine's: the built-in model, one deployment.
    app.pop("models", None)
    app["model"] = {"name": "tiny-decoder", "device": "cpu"}
    app["deployments"]["model"] = dict(
        min_replicas=workers,
        max_replicas=2 * workers,
        num_gpus=0,
        num_cpus=0.5,
        max_ongoing_requests=16,
        max_queued_requests=32,
    )
    app["deployments"]["router"].update(num_replicas=workers, num_cpus=0.25, max_replicas_per_node=1)
    app["auth"].update(api_keys_file=str(keys_file), admin_token_file=str(admin_file))
    app["http"].pop("admin_port", None)
    store = urlsplit(app["batch"]["store_url"])
    app["batch"].update(
        store_url=store._replace(netloc=f"{nodes(workers)[0].ip}:{store.port}").geturl(),
        store_password_file=str(STORE_PASSWORD),
    )
    # Quotas, so the controller leases each router its share (far above the load the
    # fault tests send: they never refuse it).
    app["tenants"]["gold"].update(rate_tokens_per_s=200_000)
    app["tenants"]["free"].update(rate_tokens_per_s=2_000)
    return spec


# -- the namespaces -----------------------------------------------------------------


def _make_node(node: Node) -> None:
    _sh("ip", "netns", "add", node.netns)
    _sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
    _sh("ip", "link", "set", node.veth, "master", BRIDGE, "up")
    _sh("ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
    _sh("ip", "-n", node.netns, "link", "set", "eth0", "up")
    _sh("ip", "-n", node.netns, "link", "set", "lo", "up")
    _sh("ip", "-n", node.netns, "route", "add", "default", "via", GATEWAY)


def our_links() -> list[str]:
    r = _sh("ip", "-o", "link", "show", check=False)
    return [m.group(1) for m in re.finditer(r"^\d+: (blst-[^@:]+)", r.stdout, re.M)]


def our_namespaces() -> list[str]:
    r = _sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(PREFIX)]


def pids_in(netns: str) -> list[int]:
    r = _sh("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in r.stdout.split()]


def kill_node(node: Node, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> int:
    """Every process in the node's namespace gets ``sig``; how many did.

    SIGKILL is the machine lost: sent again until the namespace is empty, since a raylet
    may start a process (a worker, Serve's HAProxy) between the listing and the signal,
    and one such survivor would hold the node's ports against the node started again."""
    hit: set[int] = set()
    end = time.monotonic() + timeout_s
    while True:
        pids = pids_in(node.netns)
        for pid in pids:
            try:
                os.kill(pid, sig)
                hit.add(pid)
            except ProcessLookupError:
                pass
        if sig != signal.SIGKILL or not pids or time.monotonic() > end:
            return len(hit)
        time.sleep(0.1)


def link(node: Node, up: bool) -> None:
    """The node's link to the others up or down (down: a network partition)."""
    _sh("ip", "link", "set", node.veth, "up" if up else "down")


def _clean_env() -> dict[str, str]:
    """This machine's environment without a local stack's Ray and Serve settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "BALLAST_"))}


#: What a client of the cluster (``serve deploy``, Ray's state API) needs: the nodes
#: authenticate with the token in ~/.ray/auth_token (cluster.yaml's RAY_AUTH_MODE=token).
CLIENT_ENV = {"RAY_AUTH_MODE": "token"}


def ensure_token() -> None:
    if not (Path.home() / ".ray" / "auth_token").exists():
        _sh(str(REPO / ".venv" / "bin" / "ray"), "get-auth-token", "--generate", env={**_clean_env(), **CLIENT_ENV})


def start_node(node: Node, head: Node, redis: bool) -> None:
    """The node's Ray, with cluster.yaml's start commands, in its namespace."""
    kind = "head" if node.name == "head" else "worker"
    env = _clean_env()
    # A head started again stands for a new machine, with a disk of its own: the address
    # file its last start left would make `ray start --head` look for a running GCS, and
    # find the workers' raylets here (one process table) pointing at the old one.
    (node.temp_dir / "ray" / "ray_current_cluster").unlink(missing_ok=True)
    log = node.temp_dir / "start.log"
    for cmd in start_commands(kind, node, head, redis):
        with open(log, "a") as f:
            f.write(f"$ {cmd}\n")
            f.flush()
            r = subprocess.run(
                ["ip", "netns", "exec", node.netns, "bash", "-c", cmd],
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
                check=False,
            )
        if r.returncode != 0:
            raise ClusterError(f"{node.name}: `{cmd}` exited {r.returncode}; see {node.temp_dir / 'start.log'}")


def _start_redis() -> None:
    redis = Node("redis", REDIS_IP)
    if shutil.which("redis-server") is None:
        if shutil.which("apt-get") is None:
            raise ClusterError("--redis needs redis-server (Debian: apt-get install redis-server)")
        subprocess.run(
            "apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server",
            shell=True,
            check=True,
            capture_output=True,
        )
    _make_node(redis)
    redis.temp_dir.mkdir(parents=True, exist_ok=True)
    # A password, as production's Redis has one: in files only this user reads, never on a
    # command line (which every local user can read).
    password = secrets.token_hex(24)
    _write_private(REDIS_PASSWORD, password + "\n")
    conf = redis.temp_dir / "redis.conf"
    _write_private(conf, redis_conf(password, redis.temp_dir))
    subprocess.Popen(
        ["ip", "netns", "exec", redis.netns, "redis-server", str(conf)],
        stdout=open(redis.temp_dir / "redis.log", "a"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _wait_tcp(REDIS_IP, GCS_PORT, 20, "redis")


def redis_conf(password: str, data_dir: Path) -> str:
    """The local GCS Redis's config: on its namespace's address, nothing saved to disk, a password."""
    return f'bind {REDIS_IP}\nport {GCS_PORT}\nsave ""\nappendonly no\ndir {data_dir}\nrequirepass {password}\n'


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, created mode 0600 (readable by this user alone from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _wait_tcp(ip: str, port: int, timeout_s: float, what: str) -> None:
    import socket

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            socket.create_connection((ip, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise ClusterError(f"{what} at {ip}:{port} did not answer in {timeout_s:.0f} s")


def ready(node: Node, timeout_s: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(f"{node.endpoint}/healthz/ready", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


# -- up / down ----------------------------------------------------------------------


def up(workers: int = 2, redis: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    why = can_make_namespaces()
    if why:
        raise ClusterError(f"cannot make the local cluster here: {why}")
    if our_namespaces():
        raise ClusterError("a local cluster is already up (`make cluster-down` first)")
    clear_links()  # what a cluster killed mid-way (not taken down) left outside namespaces
    for d in (STATE, TEMP):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    members = nodes(workers)
    head = members[0]
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    if redis:
        _start_redis()
    for node in members:
        node.temp_dir.mkdir(parents=True, exist_ok=True)
        _make_node(node)
    # Keys from files, as in production (serve_config.yaml ships none).
    tenants = {"gold": "bk-gold-" + secrets.token_hex(8), "free": "bk-free-" + secrets.token_hex(8)}
    keys_file, admin_file = STATE / "api_keys", STATE / "admin_token"
    keys_file.write_text("".join(f"{key}={tenant}\n" for tenant, key in tenants.items()))
    admin = "bk-admin-" + secrets.token_hex(8)
    admin_file.write_text(admin + "\n")
    _write_private(STORE_PASSWORD, secrets.token_hex(32) + "\n")  # the head's start commands read it
    deploy = serve_config(keys_file, admin_file, workers)
    state = {
        "workers": workers,
        "redis": redis,
        "keys": tenants,
        "admin_token": admin,
        "nodes": {n.name: n.ip for n in members},
        "endpoints": [n.endpoint for n in members],
        "store_url": deploy["applications"][0]["args"]["config"]["batch"]["store_url"],
    }
    (STATE / "state.json").write_text(json.dumps(state, indent=2))
    started = time.monotonic()
    ensure_token()
    start_node(head, head, redis)
    _wait_tcp(head.ip, DASHBOARD_PORT, 60, "the head's dashboard")
    for node in members[1:]:
        start_node(node, head, redis)
    config = STATE / "serve_config.yaml"
    config.write_text(yaml.safe_dump(deploy, sort_keys=False))
    r = subprocess.run(
        [str(REPO / ".venv" / "bin" / "serve"), "deploy", str(config), "-a", f"http://{head.ip}:{DASHBOARD_PORT}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**_clean_env(), **CLIENT_ENV},
    )
    if r.returncode != 0:
        raise ClusterError(f"serve deploy failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    end = time.monotonic() + timeout_s
    while not all(ready(n) for n in members):
        if time.monotonic() > end:
            raise ClusterError(
                f"not every endpoint was ready within {timeout_s:.0f} s: { {n.name: ready(n) for n in members} }"
            )
        time.sleep(2)
    state["up_s"] = round(time.monotonic() - started, 1)
    (STATE / "state.json").write_text(json.dumps(state, indent=2))
    return state


def down() -> list[str]:
    """Kill every process inside this module's namespaces, remove them and the bridge."""
    removed = []
    for netns in our_namespaces():
        node = Node(netns[len(PREFIX) :], "")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not pids_in(netns):
                break
            kill_node(node, sig)
            end = time.monotonic() + 5
            while pids_in(netns) and time.monotonic() < end:
                time.sleep(0.2)
        _sh("ip", "netns", "del", netns, check=False)
        # The machine's end of the link goes too: a namespace whose sockets still wait on
        # a peer outlives its name for minutes, and would keep the link's name taken.
        _sh("ip", "link", "del", node.veth, check=False)
        removed.append(netns)
    return removed + clear_links()


def clear_links() -> list[str]:
    """Remove this module's links outside any namespace (veths a namespace kept a while,
    the bridge); the names removed. A cluster killed mid-way, its namespaces removed by
    hand, leaves the bridge: the next ``up`` would fail to add it."""
    removed = []
    for veth in our_links():
        _sh("ip", "link", "del", veth, check=False)
        removed.append(veth)
    if _sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        _sh("ip", "link", "del", BRIDGE, check=False)
        removed.append(BRIDGE)
    return removed


def load_state() -> dict[str, Any]:
    try:
        return json.loads((STATE / "state.json").read_text())
    except OSError as e:
        raise ClusterError("no local cluster is up (`make cluster-up`)") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netcluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start a head and workers in namespaces, deploy Ballast")
    p_up.add_argument("--workers", type=int, default=2)
    p_up.add_argument("--redis", action="store_true", help="GCS fault tolerance on an external Redis")
    sub.add_parser("down", help="remove every process and namespace `up` made")
    sub.add_parser("status", help="each node's endpoint and readiness")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            state = up(args.workers, args.redis)
            print(f"local cluster up in {state['up_s']} s (state in {STATE}):")
            for name, ip in state["nodes"].items():
                print(f"  {name:5s} {ip:12s} http://{ip}:{HTTP_PORT}")
            print(f"  dashboard: http://{state['nodes']['head']}:{DASHBOARD_PORT}")
            print(f"  batch store: {state['store_url']} (its password in {STORE_PASSWORD})")
            gold = state["keys"]["gold"]
            print(
                f"  curl -s http://{state['nodes']['w1'] if 'w1' in state['nodes'] else state['nodes']['head']}:"
                f"{HTTP_PORT}/v1/generate -H 'Authorization: Bearer {gold}' "
                '-H \'Content-Type: application/json\' -d \'{"prompt": "Hello", "max_tokens": 16}\''
            )
        elif args.cmd == "down":
            removed = down()
            print("removed: " + (", ".join(removed) if removed else "nothing (no local cluster)"))
        else:
            state = load_state()
            for name, ip in state["nodes"].items():
                node = Node(name, ip)
                print(
                    f"  {name:5s} {ip:12s} {'ready' if ready(node) else 'NOT ready'}  "
                    f"processes: {len(pids_in(node.netns))}"
                )
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
