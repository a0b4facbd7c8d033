"""Alert rules and scrape config checked by Prometheus' own promtool, and every alert has a runbook.

promtool comes from Debian's prometheus package; `make test` installs it when it can.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "cluster/prometheus"
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (apt-get install prometheus)")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=PROM, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_rules_and_config_are_valid():
    rules = _run("check", "rules", "alerts.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = _run("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


@needs_promtool
def test_alert_unit_tests_pass():
    result = _run("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_runbook_section():
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    runbooks = (ROOT / "docs/runbooks.md").read_text()
    headings = set(re.findall(r"^## (\w+)$", runbooks, flags=re.M))
    assert alerts
    for alert in alerts:
        assert alert["alert"] in headings, f"docs/runbooks.md has no section for {alert['alert']}"
        assert alert["annotations"]["runbook"] == f"docs/runbooks.md#{alert['alert'].lower()}"


def test_alerts_only_use_metrics_ballast_exports():
    """Names in the expressions must be ones the code registers (Ray prefixes them with ray_)."""
    exported = set()
    for path in (ROOT / "ballast").rglob("*.py"):
        exported |= set(re.findall(r'"(ballast_[a-z_]+)"', path.read_text()))
    rules = (PROM / "alerts.yml").read_text()
    used = set(re.findall(r"ray_(ballast_[a-z_]+)", rules))
    assert used and used <= exported, used - exported
