"""serve_app.ingress: which environment selects which HTTP ingress."""

import pytest

from serve_app.config import load_config
from serve_app.ingress import apply_ingress_env, ingress_env, running_ingress


def test_haproxy_is_the_default_with_files_of_its_own_per_port():
    env = ingress_env(load_config({"http": {"port": 8123}}))
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    paths = [v for k, v in env.items() if k != "RAY_SERVE_ENABLE_HA_PROXY"]
    assert paths and all(p.startswith("/tmp/ballast-haproxy-8123") for p in paths)
    other = ingress_env(load_config({"http": {"port": 8000}}))
    assert set(other.values()).isdisjoint(paths)


def test_proxy_turns_haproxy_off_explicitly():
    assert ingress_env(load_config({"http": {"ingress": "proxy"}})) == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}


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
