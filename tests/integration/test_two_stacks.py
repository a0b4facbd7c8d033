"""Two Ballast stacks on one host: the session's (port 8123) and a `ballast serve` beside it.

Serve's HAProxy mode binds a stats and a metrics listener, a fallback proxy and the
router replicas' direct-ingress ports besides the HTTP port; at Serve's defaults two
stacks on one host collide on them (a `make test` beside `make serve` failed 53
tests at set-up). Each stack's ports now follow its HTTP port
(``ballast.router.ingress.stack_ports``): here a second stack, with its own local
Ray, starts through the CLI on port 8126 while the session's stack keeps serving,
both answer, and each HAProxy answers on its own stats and metrics ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import conftest as integration
import httpx
import pytest
import yaml
from conftest import BASE, GOLD, ROOT, _merge, wait_until

from ballast.router.ingress import stack_ports

pytestmark = pytest.mark.integration

OTHER_PORT = 8126


def _haproxy_ports(port: int) -> tuple[int, int]:
    env = stack_ports(port)
    return int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])


@pytest.fixture(scope="module")
def other_stack(ballast, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("other-stack")
    cfg = tmp / "other.yaml"
    cfg.write_text(yaml.safe_dump(_merge(integration.test_config_dict(), {"http": {"port": OTHER_PORT}})))
    # Its own Ray: nothing of this process's Ray or ingress settings leaks into it.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_SERVE_"))}
    log = (tmp / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ballast.ops.cli", "serve", "--config", str(cfg), "--no-dashboard"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"the second stack exited ({proc.returncode}):\n{(tmp / 'serve.log').read_text()[-3000:]}"
            )
        try:
            return httpx.get(f"http://127.0.0.1:{OTHER_PORT}/healthz/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop() -> int:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what `make stop` sends: Serve and its Ray shut down
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return proc.returncode

    try:
        wait_until(ready, 240, 1.0, "the second stack ready on its port")
        yield f"http://127.0.0.1:{OTHER_PORT}", stop
    finally:
        stop()
        log.close()


def test_two_stacks_answer_side_by_side_each_on_its_own_ports(other_stack):
    other, _ = other_stack
    for base in (BASE, other):
        r = httpx.post(
            f"{base}/v1/generate", headers=GOLD, json={"prompt": "side by side", "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 200, (base, r.text)
    seen = set()
    for port in (integration.PORT, OTHER_PORT):
        stats, metrics = _haproxy_ports(port)
        assert httpx.get(f"http://127.0.0.1:{stats}/stats", timeout=10).status_code == 200, port
        body = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        assert "haproxy_process_" in body, port  # HAProxy's own exporter, this stack's
        seen |= {stats, metrics}
    assert len(seen) == 4


def test_stopping_the_other_stack_leaves_this_one_serving(other_stack):
    other, stop = other_stack
    assert stop() == 0  # a clean shutdown of its Serve and its Ray
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{other}/healthz/ready", timeout=2)
    r = httpx.post(f"{BASE}/v1/generate", headers=GOLD, json={"prompt": "still here", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
