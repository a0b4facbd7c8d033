"""Grafana dashboards as code: Panel/Target dataclasses rendered to committed JSON.

``python -m serve_app.dashboards`` writes ``cluster/grafana/dashboards/*.json``; a unit
test regenerates them and fails on any difference, and an integration test runs
every panel's query against a real Prometheus scraping a live local Ray.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "cluster/grafana/dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        panels = []
        for i, p in enumerate(self.panels):
            panels.append(
                {
                    "id": i + 1,
                    "type": p.kind,
                    "title": p.title,
                    "description": p.description,
                    "datasource": DATASOURCE,
                    "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                    "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                    "targets": [
                        {"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend}
                        for j, t in enumerate(p.targets)
                    ],
                }
            )
        return {
            "uid": self.uid,
            "title": self.title,
            "schemaVersion": 39,
            "version": 1,
            "editable": True,
            "time": {"from": "now-1h", "to": "now"},
            "refresh": "10s",
            "tags": ["ballast"],
            "templating": {
                "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
            },
            "panels": panels,
        }


REQ = "ray_ballast_requests_total"

OVERVIEW = Dashboard(
    uid="ballast-overview",
    title="Ballast overview",
    panels=(
        Panel("Degradation level", (Target("max(ray_ballast_degradation_level)", "level"),), description="0 normal … 4 nothing new admitted"),
        Panel(
            "Replicas: desired vs running",
            (
                Target("max by (deployment) (ray_ballast_desired_replicas)", "desired {{deployment}}"),
                Target('sum by (deployment) (ray_serve_deployment_replica_healthy{application="ballast"})', "running {{deployment}}"),
            ),
        ),
        Panel("Goodput (answered OK)", (Target(f'sum(rate({REQ}{{code="OK"}}[1m]))', "ok/s"),), unit="reqps"),
        Panel("Shed by criticality", (Target(f'sum by (criticality) (rate({REQ}{{code="OVERLOADED"}}[1m]))', "{{criticality}}"),), unit="reqps"),
        Panel("Tokens per tenant", (Target("sum by (tenant) (rate(ray_ballast_tenant_tokens_total[1m]))", "{{tenant}}"),), unit="short"),
        Panel(
            "Refusals per tenant",
            (Target(f'sum by (tenant, code) (rate({REQ}{{code=~"QUOTA_EXCEEDED|CONCURRENCY_LIMIT|KILL_SWITCH"}}[1m]))', "{{tenant}} {{code}}"),),
            unit="reqps",
        ),
        Panel("Breaker state", (Target("max by (backend) (ray_ballast_breaker_state)", "{{backend}}"),), description="0 closed, 1 open, 2 half-open"),
        Panel("Fallbacks", (Target("sum by (kind) (rate(ray_ballast_fallbacks_total[5m]))", "{{kind}}"),), unit="reqps"),
        Panel("Retries", (Target("sum by (backend, kind) (rate(ray_ballast_retries_total[5m]))", "{{backend}} {{kind}}"),), unit="reqps"),
        Panel(
            "Latency percentiles",
            tuple(
                Target(f"histogram_quantile({q}, sum by (le) (rate(ray_ballast_request_latency_ms_bucket[1m])))", f"p{int(q * 100)}")
                for q in (0.5, 0.95, 0.99)
            ),
            unit="ms",
        ),
        Panel("Queue length", (Target("max(ray_ballast_queue_length)", "queue"),)),
        Panel("Controller snapshot age", (Target("max(ray_ballast_snapshot_age_s)", "age"),), unit="s"),
    ),
)

DASHBOARDS = (OVERVIEW,)


def render_all() -> dict[str, str]:
    return {f"{d.uid}.json": json.dumps(d.to_json(), indent=2, sort_keys=True) + "\n" for d in DASHBOARDS}


def panel_queries() -> list[str]:
    return [t.expr for d in DASHBOARDS for p in d.panels for t in p.targets]


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
