"""A real Prometheus scrapes the live local Ray that ran the suite: every dashboard panel's
query and every alert expression must parse and find series (no panel may point at a
metric nobody exports). Runs last, so the other tests' traffic (sheds, quota refusals,
fallbacks, retries, breaker trips) is there to be found.
"""

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import ADMIN, GOLD, wait_chaos, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.last]

ROOT = Path(__file__).resolve().parents[2]
SD_FILE = Path("/tmp/ray/prom_metrics_service_discovery.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(ballast, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (apt-get install prometheus; `make test` tries)")
    wait_until(SD_FILE.exists, 30, 0.5, "Ray's Prometheus service-discovery file")
    work = tmp_path_factory.mktemp("prometheus")
    cfg = yaml.safe_load((ROOT / "cluster/prometheus/prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["rule_files"] = [str(ROOT / "cluster/prometheus/alerts.yml")]
    cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(SD_FILE)]
    cfg["scrape_configs"][0]["file_sd_configs"][0]["refresh_interval"] = "1s"
    (work / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ok(f"{url}/-/ready"), 30, 0.5, "prometheus ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _query(url: str, expr: str) -> dict:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]


def test_every_panel_and_alert_finds_series(prometheus, client, ballast):
    from ballast.ops.dashboards import panel_queries

    # One retry for the retries panel: a hung primary, a deadline with room for a second
    # attempt after the first attempt's timeout (the fallback answers in the end).
    attempt_s = ballast.resilience.attempt_timeout_s
    client.post("/admin/chaos", headers=ADMIN, json={"target": "primary", "hang": True})
    wait_chaos(client, "primary", {"hang": True})
    try:
        r = client.post(
            "/v1/generate",
            headers={**GOLD, "X-Request-Timeout-Ms": str(int((attempt_s + 2) * 1000))},
            json={"prompt": "retry me", "max_tokens": 4},
        )
        assert r.status_code in (200, 504), r.text
    finally:
        client.delete("/admin/chaos", headers=ADMIN)

    # a little fresh traffic, so rates have two samples inside their windows
    stop = time.monotonic() + 8
    while time.monotonic() < stop:
        client.post("/v1/generate", headers=GOLD, json={"prompt": "observe", "max_tokens": 4})
        time.sleep(0.2)
    wait_until(
        lambda: _query(prometheus, "count(ray_ballast_requests_total)")["result"], 60, 1, "ballast metrics scraped"
    )

    def empty() -> list[str]:
        return [expr for expr in panel_queries() if not _query(prometheus, expr)["result"]]

    # Ray's agent exports every few seconds; give late series (fresh replicas) time to arrive.
    missing = empty()
    deadline = time.monotonic() + 45
    while missing and time.monotonic() < deadline:
        time.sleep(2)
        missing = empty()
    assert not missing, f"panels whose query finds no series: {missing}"

    rules = yaml.safe_load((ROOT / "cluster/prometheus/alerts.yml").read_text())
    for rule in (r for g in rules["groups"] for r in g["rules"]):
        _query(prometheus, rule["expr"])  # parses and evaluates
        for metric in set(re.findall(r"\b(ray_[a-z_]+)", rule["expr"])):
            assert _query(prometheus, f"count({metric})")["result"], (
                f"{rule.get('alert') or rule.get('record')}: no {metric}"
            )

    # the rules were loaded and evaluated by this Prometheus too
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert {r["name"] for g in groups for r in g["rules"]} >= {"BallastBreakerOpen", "BallastErrorBudgetFastBurn"}
