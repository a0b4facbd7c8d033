"""Grafana dashboards as code: Panel/Target dataclasses rendered to committed JSON.

``python -m ballast.ops.dashboards`` writes ``cluster/grafana/dashboards/*.json``; a unit
test regenerates them and fails on any difference, and an integration test runs
every panel's query against a real Prometheus scraping a live local Ray.

Two dashboards: the service overview, and "Ballast replicas" (one line per model
replica from its watchdog, and the controller's recycling). A target that a healthy
stack may rightly answer with nothing (VRAM without a GPU; time-to-limit while no
series is rising) says why in ``sparse``; ``panel_queries()`` leaves those out unless
asked, so the integration test's "every query finds series" stays a real check.

Ray exports a counter only after its first increment, so the event panels (recycles,
watchdog actions, hung replicas killed) show ``increase`` over 15 minutes: rare events
read as counts, and an event stays visible for a while after its replica is gone.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[2] / "cluster/grafana/dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Each waiting tenant's weighted service per second (the fairness panel's series).
FAIR_WAITING = (
    "sum by (tenant) (rate(ray_ballast_fair_served_tokens_total[1m]))"
    " and on (tenant) (max by (tenant) (ray_ballast_fair_backlogged) == 1)"
)


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    sparse: str = ""  # why a healthy stack may answer this with no series ("" = it must not)


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

    def to_json(self) -> dict[str, Any]:
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
BATCH_LINES = "ray_ballast_batch_lines_total"

PREFIX_HITS = "rate(ray_ballast_model_prefix_cache_hits_total[5m])"
PREFIX_QUERIES = "rate(ray_ballast_model_prefix_cache_queries_total[5m])"
ROUTED = "ray_ballast_route_decisions_total"
NEEDS_VLLM = "needs a vLLM model with prefix caching"
NEEDS_VLLM_ENGINE = "needs a vLLM model (its engine's own metrics)"
VLLM_TTFT = "ray_vllm_time_to_first_token_seconds"
VLLM_ITL = "ray_vllm_inter_token_latency_seconds"

OVERVIEW = Dashboard(
    uid="ballast-overview",
    title="Ballast overview",
    panels=(
        Panel(
            "Degradation level by model",
            (Target("max by (model) (ray_ballast_degradation_level)", "{{model}}"),),
            description="Each model's own level: 0 normal … 4 nothing new admitted",
        ),
        Panel(
            "Replicas: desired vs running",
            (
                Target("max by (deployment) (ray_ballast_desired_replicas)", "desired {{deployment}}"),
                Target(
                    'sum by (deployment) (ray_serve_deployment_replica_healthy{application="ballast"})',
                    "running {{deployment}}",
                ),
            ),
        ),
        Panel(
            "Goodput (interactive answered OK) by model",
            (Target(f'sum by (model) (rate({REQ}{{code="OK",criticality!="batch"}}[1m]))', "{{model}}"),),
            unit="reqps",
        ),
        Panel(
            "Shed by model and criticality",
            (
                Target(
                    f'sum by (model, criticality) (rate({REQ}{{code="OVERLOADED"}}[1m]))', "{{model}} {{criticality}}"
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Tokens per tenant",
            (Target("sum by (tenant) (rate(ray_ballast_tenant_tokens_total[1m]))", "{{tenant}}"),),
            unit="short",
        ),
        Panel(
            "Fairness among waiting tenants (Jain's index)",
            (
                Target(
                    f"(sum({FAIR_WAITING}))^2 / (count({FAIR_WAITING}) * sum(({FAIR_WAITING})^2))",
                    "Jain's index",
                    sparse="no series while no tenant waits at a gate",
                ),
                Target(
                    f"{FAIR_WAITING}",
                    "{{tenant}} weighted tokens/s",
                    sparse="no series while no tenant waits at a gate",
                ),
            ),
            description="Over the tenants waiting at a gate: each one's service, weighted as its fair-share counter "
            "weighs it. 1: shares exactly by weight; 1/n: one tenant takes all.",
        ),
        Panel(
            "Refusals per tenant",
            (
                Target(
                    f'sum by (tenant, code) (rate({REQ}{{code=~"QUOTA_EXCEEDED|CONCURRENCY_LIMIT|KILL_SWITCH"}}[1m]))',
                    "{{tenant}} {{code}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Breaker state",
            (Target("max by (model, backend) (ray_ballast_breaker_state)", "{{model}} {{backend}}"),),
            description="0 closed, 1 open, 2 half-open",
        ),
        Panel(
            "Fallbacks", (Target("sum by (kind) (rate(ray_ballast_fallbacks_total[5m]))", "{{kind}}"),), unit="reqps"
        ),
        Panel(
            "Retries",
            (
                Target(
                    "sum by (model, backend, kind) (rate(ray_ballast_retries_total[5m]))",
                    "{{model}} {{backend}} {{kind}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Latency percentiles by model",
            tuple(
                Target(
                    f"histogram_quantile({q}, sum by (model, le) (rate(ray_ballast_request_latency_ms_bucket[1m])))",
                    f"{{{{model}}}} p{int(q * 100)}",
                )
                for q in (0.5, 0.95, 0.99)
            ),
            unit="ms",
        ),
        Panel("Queue length by model", (Target("max by (model) (ray_ballast_queue_length)", "{{model}}"),)),
        Panel(
            "Prefix-cache hit rate (vLLM)",
            (
                Target(
                    f"sum by (deployment) ({PREFIX_HITS}) / sum by (deployment) ({PREFIX_QUERIES})",
                    "{{deployment}}",
                    sparse=NEEDS_VLLM,
                ),
                Target(
                    f"sum by (deployment, replica) ({PREFIX_HITS}) / sum by (deployment, replica) ({PREFIX_QUERIES})",
                    "{{deployment}} {{replica}}",
                    sparse=NEEDS_VLLM,
                ),
            ),
            unit="percentunit",
            description="Prompt tokens found in vLLM's prefix cache over those looked up, per model deployment and "
            "per replica (vLLM's own counters)",
        ),
        Panel(
            "Requests routed, by why that replica",
            (Target(f"sum by (model, reason) (rate({ROUTED}[1m]))", "{{model}} {{reason}}"),),
            unit="reqps",
            description="prefix: it holds the start of the prompt; home: a prompt no replica holds, to its home; "
            "adapter: where its LoRA adapter is; balance: by load alone (no view, or the level at "
            "model.routing.balance_from_level)",
        ),
        Panel(
            "Share routed by prefix",
            (
                Target(
                    f'sum by (model) (rate({ROUTED}{{reason="prefix"}}[5m])) / sum by (model) (rate({ROUTED}[5m]))',
                    "{{model}}",
                    sparse=NEEDS_VLLM,
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "vLLM time to first token by model",
            (
                Target(
                    f"histogram_quantile(0.5, sum by (model_name, le) (rate({VLLM_TTFT}_bucket[5m])))",
                    "{{model_name}} p50",
                    sparse=NEEDS_VLLM_ENGINE,
                ),
                Target(
                    f"histogram_quantile(0.99, sum by (model_name, le) (rate({VLLM_TTFT}_bucket[5m])))",
                    "{{model_name}} p99",
                    sparse=NEEDS_VLLM_ENGINE,
                ),
            ),
            unit="s",
            description="vLLM's own figure, in the engine (from the request's arrival at the engine to its first "
            "token); Ballast's queue before it is the gate panels'",
        ),
        Panel(
            "vLLM inter-token latency and preemptions by model",
            (
                Target(
                    f"histogram_quantile(0.5, sum by (model_name, le) (rate({VLLM_ITL}_bucket[5m])))",
                    "{{model_name}} ITL p50 (s)",
                    sparse=NEEDS_VLLM_ENGINE,
                ),
                Target(
                    f"histogram_quantile(0.99, sum by (model_name, le) (rate({VLLM_ITL}_bucket[5m])))",
                    "{{model_name}} ITL p99 (s)",
                    sparse=NEEDS_VLLM_ENGINE,
                ),
                Target(
                    "sum by (model_name) (rate(ray_vllm_num_preemptions_total[5m]))",
                    "{{model_name}} preemptions /s",
                    sparse=NEEDS_VLLM_ENGINE,
                ),
            ),
            description="vLLM's own figures: the time between two tokens of a stream, and requests preempted "
            "(their KV cache taken back) per second",
        ),
        Panel(
            "Replica load imbalance",
            (Target("max by (model) (ray_ballast_model_load_imbalance_ratio)", "{{model}}"),),
            description="The most loaded replica's requests (running + queued) over the mean of the model's "
            "replicas; affinity keeps it within model.routing.load_bound_ratio while the load bound binds",
        ),
        Panel(
            "Gate to each model",
            (
                Target("sum by (model, kind) (ray_ballast_gate)", "{{model}} {{kind}}"),
                Target(
                    "sum by (model, reason, criticality) (rate(ray_ballast_gate_refused_total[1m]))",
                    "{{model}} refused {{criticality}} {{reason}}",
                    sparse="no series until a request is refused at the gate",
                ),
            ),
            description=(
                "Per-router adaptive limit, requests at the model (batch_in_flight: those of them batch lines), "
                "requests waiting (summed over routers); refusals per second"
            ),
        ),
        Panel("Controller snapshot age", (Target("max(ray_ballast_snapshot_age_s)", "age"),), unit="s"),
        Panel(
            "Recycles (per 15 min)",
            (Target("sum by (outcome) (increase(ray_ballast_recycles_total[15m]))", "{{outcome}}"),),
            description="Replica recycles by outcome; per replica on the Ballast replicas dashboard",
        ),
        Panel(
            "Batch lines vs interactive requests by model",
            (
                Target(f"sum by (model, outcome) (rate({BATCH_LINES}[1m]))", "{{model}} batch {{outcome}}"),
                Target(f'sum by (model) (rate({REQ}{{criticality!="batch"}}[1m]))', "{{model}} interactive"),
            ),
            unit="reqps",
            description="Batch lines taken off each model's queue per second, by what became of them (completed, "
            "failed: to the error file, expired, retried, deferred: quota or kill switch, dead_lettered, skipped), "
            "against the model's interactive requests per second (every outcome; batch lines, which "
            'ray_ballast_requests_total counts as criticality "batch", left out). Batch runs only at level 0, in '
            "the gate's room the interactive load leaves",
        ),
        Panel(
            "Batch queue and dead letters by model",
            (
                Target("max by (model) (ray_ballast_batch_queue_depth)", "{{model}} queued or running"),
                Target("max by (model) (ray_ballast_dlq_depth)", "{{model}} dead letters"),
                Target(
                    "sum by (model) (increase(ray_ballast_dlq_messages_total[15m]))",
                    "{{model}} dead-lettered (per 15 min)",
                    sparse="no series until a line is dead-lettered",
                ),
                Target(
                    "sum by (model) (increase(ray_ballast_dlq_reprocessed_total[15m]))",
                    "{{model}} re-driven (per 15 min)",
                    sparse="no series until an operator re-drives a dead letter",
                ),
            ),
            description="Lines on each model's queue (the store's, the same at every router: max over routers) and "
            "on its dead-letter queue (BallastDLQBacklog after 15 min above 0); lines moved to it and put back "
            "by POST /admin/dlq/{id}/retry",
        ),
        Panel(
            "Oldest batch line by model",
            (Target("max by (model) (ray_ballast_batch_queue_age_seconds)", "{{model}}"),),
            unit="s",
            description="How long the first line on each model's queue has waited since its batch was created "
            "(0: none queued); it grows while interactive load leaves no room, up to the batch's completion window",
        ),
        Panel(
            "Flex requests held by model",
            (Target("sum by (model) (ray_ballast_flex_held)", "{{model}}"),),
            description='service_tier "flex" requests held for spare capacity, summed over routers (each holds at '
            "most resilience.gate.max_waiting per model)",
        ),
    ),
)

BY_REPLICA = "deployment, replica"
PER_REPLICA = "{{deployment}} {{replica}}"
EVENTS = "15m"  # window of the event panels: counters that move rarely read as counts


def _events_panel(title: str, counter: str, by: tuple[str, ...], description: str = "") -> Panel:
    """A rarely moving counter as counts per ``EVENTS`` window, one series per ``by`` labels."""
    labels = ", ".join(by)
    return Panel(
        f"{title} (per 15 min)",
        (
            Target(
                f"sum by ({labels}) (increase(ray_ballast_{counter}[{EVENTS}]))", " ".join(f"{{{{{b}}}}}" for b in by)
            ),
        ),
        description=description,
    )


def _replica_gauge(title: str, metric: str, unit: str = "short", description: str = "", sparse: str = "") -> Panel:
    return Panel(
        title,
        (Target(f"max by ({BY_REPLICA}) (ray_ballast_replica_{metric})", PER_REPLICA, sparse=sparse),),
        unit=unit,
        description=description,
    )


REPLICAS = Dashboard(
    uid="ballast-replicas",
    title="Ballast replicas",
    panels=(
        _replica_gauge("RSS per replica", "rss_bytes", "bytes"),
        _replica_gauge(
            "VRAM per replica", "vram_bytes", "bytes", "Only replicas that hold a GPU report VRAM", sparse="needs a GPU"
        ),
        _replica_gauge("Threads per replica", "threads"),
        _replica_gauge("Open file descriptors per replica", "fds"),
        Panel(
            "Leak slope: memory (per hour)",
            (
                Target(
                    f"max by ({BY_REPLICA}, series) "
                    '(ray_ballast_replica_leak_slope_per_hour{series=~"rss_bytes|vram_bytes"})',
                    "{{deployment}} {{replica}} {{series}}",
                ),
            ),
            unit="bytes",
            description=(
                "Robust trend over watchdog.leak_window_s, or leak_short_window_s when that one names a leak sooner, "
                "in bytes per hour"
            ),
        ),
        Panel(
            "Leak slope: threads and fds (per hour)",
            (
                Target(
                    f'max by ({BY_REPLICA}, series) (ray_ballast_replica_leak_slope_per_hour{{series=~"threads|fds"}})',
                    "{{deployment}} {{replica}} {{series}}",
                ),
            ),
            description=(
                "Robust trend over watchdog.leak_window_s, or leak_short_window_s when that one names a leak sooner, "
                "per hour"
            ),
        ),
        Panel(
            "Leaking series",
            (
                Target(
                    f"max by ({BY_REPLICA}, series) (ray_ballast_replica_leaking)",
                    "{{deployment}} {{replica}} {{series}}",
                ),
            ),
            description="1 while the watchdog reads the series' trend as a leak (BallastLeakDetected after 10 min)",
        ),
        Panel(
            "Time to limit (rising series)",
            (
                Target(
                    f"min by ({BY_REPLICA}, series) (ray_ballast_replica_time_to_limit_seconds >= 0)",
                    "{{deployment}} {{replica}} {{series}}",
                    sparse="empty while no series rises credibly (-1 is hidden)",
                ),
            ),
            unit="s",
            description="Series not rising credibly (-1) are hidden. Under watchdog.critical_tto_s (1 h) the watchdog "
            "stops intake and asks for a recycle; BallastTimeToOOMUnderOneHour if that does not help",
        ),
        _replica_gauge(
            "Work loop stalled",
            "stalled_seconds",
            "s",
            "How long the replica's work loop has not moved with work in flight, on its own clock; "
            "hung past watchdog.hang_missed_heartbeats intervals",
        ),
        _replica_gauge(
            "Heartbeat age",
            "heartbeat_age_seconds",
            "s",
            "Time since the replica's last heartbeat reached its watchdog; hung past "
            "watchdog.silent_missed_heartbeats intervals with work last seen in flight",
        ),
        Panel(
            "Ready and hung",
            (
                Target(f"max by ({BY_REPLICA}) (ray_ballast_replica_ready)", "ready {{deployment}} {{replica}}"),
                Target(f"max by ({BY_REPLICA}) (ray_ballast_replica_hung)", "hung {{deployment}} {{replica}}"),
            ),
            description=(
                "ready 0: the watchdog stopped intake (or a recycle was asked for); hung 1: killed by the controller"
            ),
        ),
        _events_panel(
            "Watchdog actions",
            "watchdog_actions_total",
            ("deployment", "action"),
            description="The action ladder: gc_collect, empty_cache, stop_intake, request_recycle",
        ),
        _events_panel("Hung replicas killed", "hung_replicas_killed_total", ("deployment",)),
        _events_panel(
            "Recycles by outcome",
            "recycles_total",
            ("deployment", "outcome"),
            description="started, completed, stuck (past recycle.recycle_timeout_s), lease_expired, killed_hung",
        ),
        _events_panel(
            "Recycles started by reason",
            'recycles_total{outcome="started"}',
            ("deployment", "reason"),
            description="critical, forced_max_age, manual, watchdog, max_age, hung",
        ),
        Panel("Recycles in flight", (Target("max by (deployment) (ray_ballast_recycle_in_flight)", "{{deployment}}"),)),
        Panel(
            "Oldest recycle in progress",
            (Target("max by (deployment) (ray_ballast_recycle_oldest_seconds)", "{{deployment}}"),),
            unit="s",
            description="0 when none; stuck past recycle.recycle_timeout_s (600 s by default): BallastRecycleStuck",
        ),
        Panel(
            "Availability under recycling",
            (Target("max by (kind, deployment) (ray_ballast_availability)", "{{kind}} {{deployment}}"),),
            unit="percentunit",
            description="expected, per model deployment: a rolling restart's availability for the schedule (absent "
            "without max_age_s); measured, over the fleet: 1 - replica time out for recycles / replica time",
        ),
    ),
)

DASHBOARDS = (OVERVIEW, REPLICAS)


def render_all() -> dict[str, str]:
    return {f"{d.uid}.json": json.dumps(d.to_json(), indent=2, sort_keys=True) + "\n" for d in DASHBOARDS}


def panel_queries(sparse: bool = False) -> list[str]:
    """Every target's query; with ``sparse=False``, only those a healthy stack must answer."""
    return [t.expr for d in DASHBOARDS for p in d.panels for t in p.targets if sparse or not t.sparse]


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
