"""Dashboards as data: every query parses, names only metrics Ballast exports, and the
replicas dashboard shows every watchdog and recycling metric.

The committed JSON matching the code is checked in test_docs.py; that every query finds
series on a live stack, in tests/integration/test_observability.py.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ballast.ops.dashboards import DASHBOARDS, REPLICAS, panel_queries, render_all

ROOT = Path(__file__).resolve().parents[2]
promtool = shutil.which("promtool")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def exported_metrics() -> set[str]:
    """Metric names ballast registers: literals, and families built as f"ballast_x_{k}" for k in (...)."""
    names = set()
    for path in (ROOT / "ballast").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r'"(ballast_[a-z_]+)"', text))
        for prefix, _, keys in re.findall(r'f"(ballast_[a-z_]*)\{(\w+)\}".*?for \2 in \(([^)]*)\)', text, flags=re.S):
            names |= {prefix + k for k in re.findall(r'"([a-z_]+)"', keys)}
    return names


def used_metrics(exprs: list[str]) -> set[str]:
    return {HISTOGRAM_SUFFIX.sub("", m) for e in exprs for m in re.findall(r"\bray_(ballast_[a-z_]+)", e)}


def test_exported_metrics_include_the_watchdog_gauge_family():
    # the watchdog builds these names in a loop; the helper must see them or the checks below are hollow
    assert {
        "ballast_replica_rss_bytes",
        "ballast_replica_heartbeat_age_seconds",
        "ballast_replica_ready",
    } <= exported_metrics()


def test_dashboards_only_use_metrics_ballast_exports():
    used = used_metrics(panel_queries(sparse=True))
    exported = exported_metrics()
    assert used and used <= exported, used - exported


def test_replicas_dashboard_shows_every_watchdog_and_recycling_metric():
    families = re.compile(r"^ballast_(replica_|recycle|watchdog_|hung_|availability)")
    wanted = {m for m in exported_metrics() if families.match(m)}
    shown = used_metrics([t.expr for p in REPLICAS.panels for t in p.targets])
    assert len(wanted) >= 14
    assert wanted <= shown, wanted - shown


def test_sparse_targets_say_why_and_only_they_are_left_out():
    targets = [t for d in DASHBOARDS for p in d.panels for t in p.targets]
    sparse = [t for t in targets if t.sparse]
    assert sparse and all(len(t.sparse) > 5 for t in sparse)
    assert panel_queries() == [t.expr for t in targets if not t.sparse]
    assert panel_queries(sparse=True) == [t.expr for t in targets]
    for d in DASHBOARDS:  # every dashboard is covered by the live check
        assert any(not t.sparse for p in d.panels for t in p.targets), d.uid


def test_time_to_limit_panel_hides_not_rising():
    (tto,) = [t for p in REPLICAS.panels for t in p.targets if "time_to_limit" in t.expr]
    assert ">= 0" in tto.expr


def test_dashboards_are_distinct_and_well_formed():
    import json

    rendered = render_all()
    assert (
        sorted(rendered)
        == sorted(f"{d.uid}.json" for d in DASHBOARDS)
        == ["ballast-overview.json", "ballast-replicas.json"]
    )
    assert len({d.title for d in DASHBOARDS}) == len(DASHBOARDS)
    for name, text in rendered.items():
        board = json.loads(text)
        ids = [p["id"] for p in board["panels"]]
        assert len(set(ids)) == len(ids), name
        cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in board["panels"]}
        assert len(cells) == len(ids), f"{name}: panels overlap"
        for p in board["panels"]:
            assert p["targets"] and all(t["expr"] and t["legendFormat"] for t in p["targets"]), (name, p["title"])


@pytest.mark.skipif(promtool is None, reason="promtool not installed (apt-get install prometheus)")
def test_every_panel_query_parses(tmp_path):
    """promtool parses each query as a recording rule: a typo fails here, not on a live Prometheus."""
    rules = {
        "groups": [
            {
                "name": "panels",
                "rules": [{"record": f"panel:q{i}", "expr": e} for i, e in enumerate(panel_queries(sparse=True))],
            }
        ]
    }
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", "panels.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_vllm_panels_read_vllms_own_metric_names():
    """vLLM's names (``vllm:...`` in its PrometheusStatLogger) reach Prometheus through Ray's
    metrics as ``ray_vllm_...``: every ``ray_vllm_`` name a panel reads is one vLLM defines."""
    pytest.importorskip("vllm")
    import inspect

    from vllm.v1.metrics import loggers

    defined = set(re.findall(r'"vllm:([a-z_]+)"', inspect.getsource(loggers)))
    used = {
        HISTOGRAM_SUFFIX.sub("", m).removesuffix("_total")
        for e in panel_queries(sparse=True)
        for m in re.findall(r"\bray_vllm_([a-z_]+)", e)
    }
    assert {"time_to_first_token_seconds", "inter_token_latency_seconds", "num_preemptions"} <= used
    assert used <= defined, used - defined
