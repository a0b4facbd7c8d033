"""`ballast status`'s summary (ballast.ops.cli.format_status) against a /v1/status document.

The document is assembled the way the router's status route assembles it
(ballast/router/admin.py), from the real pieces on fake clocks: a ControllerCore fed an
overloaded replica and a kill switch, a CircuitBreaker tripped by failures, and a quota
table with one tenant's bucket nearly empty. A sample document written by hand in the
route's shape (tests/unit/data/status_sample.json) checks the fail-static, recycle and
gate lines, which the core alone does not reach without Ray.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ballast.config import load_config
from ballast.control.controller import ControllerCore
from ballast.names import MODEL_DEPLOYMENT, ROUTER_DEPLOYMENT
from ballast.ops.cli import main
from ballast.ops.status_text import format_status
from ballast.policies.breaker import BreakerConfig, CircuitBreaker
from ballast.policies.control import RoutingSummary
from ballast.policies.reports import ModelLoad, ReplicaReport, RouterReport
from tests.unit.fakes import FakeClock

SAMPLE = Path(__file__).parent / "data" / "status_sample.json"
MODEL = "tiny-decoder"  # the default config's one model


def live_document() -> dict[str, Any]:
    clock, wall = FakeClock(0), FakeClock(1_000_000)
    cfg = {
        "deployments": {"model": {"min_replicas": 1, "max_replicas": 4}},
        "tenants": {"free": {}},
    }  # a kill switch names a tenant that exists
    core = ControllerCore(load_config(cfg), clock=clock, wall_clock=wall)
    core.report_router(RouterReport(router_id="r1", models={MODEL: ModelLoad(inflight=0)}))
    core.report_replica(ReplicaReport(replica_id="m1", deployment=MODEL_DEPLOYMENT, running=8, queued=600))
    clock.advance(1)
    wall.advance(1)
    core.tick()
    core.admin.set_kill_switch("tenant", "free", "abuse from one key", 600, "alice")
    snap = core.snapshot()

    breaker = CircuitBreaker(
        "primary", BreakerConfig(window_size=100, min_calls=10, failure_rate_threshold=0.5), clock=clock
    )
    for _ in range(10):
        permit = breaker.allow()
        assert permit is not None
        breaker.record(permit, False, 0.1)

    # The route's shape (ballast/router/admin.py, GET /v1/status), from the pieces above.
    state = snap["models"][MODEL]
    return {
        "router_id": "r1",
        "snapshot": {"epoch": snap["epoch"], "version": snap["version"], "age_s": 0.4, "models": snap["models"]},
        "models": {
            MODEL: {
                "level": state["level"],
                "source": "snapshot",
                "constraints": state["constraints"],
                "breakers": {"primary": {**breaker.snapshot(), "failed_attempts": {"timeout": 10}}},
                "lost_capacity": {"migrated": 0, "not_migrated": 0, "streams_carried_on": 0},
                "gate": None,
            }
        },
        "replicas": {
            dep: {
                "desired": snap["desired_replicas"].get(dep),
                "running": snap["running_replicas"].get(dep),
                **({"autoscale": snap["autoscale"][dep]} if dep in snap["autoscale"] else {}),
            }
            for dep in sorted(set(snap["desired_replicas"]) | set(snap["running_replicas"]))
        },
        "kill_switches": snap["kill_switches"],
        "quotas": {
            "gold": {"rate_tokens_per_s": 1000.0, "burst_tokens": 4000.0, "tokens": 3900.0, "lease": True},
            "free": {"rate_tokens_per_s": 100.0, "burst_tokens": 200.0, "tokens": 12.5, "lease": True},
        },
        "chaos": snap["chaos"],
        "recycle": snap["recycle"],
    }


def model_block(text: str, name: str = MODEL) -> list[str]:
    """The summary's lines about model ``name``: its head line and the indented ones under it."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"model {name}: "))
    end = next((i for i in range(at + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[at:end]


def test_summary_shows_each_models_level_and_reason_from_the_controller() -> None:
    doc = live_document()
    state = doc["snapshot"]["models"][MODEL]
    assert doc["models"][MODEL]["level"] == state["level"] >= 1, "600 queued requests must raise the level"
    text = format_status(doc)
    assert text.splitlines()[0] == f"snapshot v{doc['snapshot']['version']} ({doc['snapshot']['epoch']}), age 0.4 s"
    head, *rest = model_block(text)
    assert head.startswith(f"model {MODEL}: level {state['level']} (target {state['target_level']}): ")
    assert head.endswith(state["reason"])
    assert rest[0] == "  inputs: queue_length 600, queue_wait_p95_ms -, kv_util_pct -, gpu_util_pct -, vram_pct -, " + (
        "error_rate -"
    )
    assert (
        f"  replicas running / desired: 1 / {doc['replicas'][MODEL_DEPLOYMENT]['desired']} ({MODEL_DEPLOYMENT})" in rest
    )
    assert "acting on" not in text  # a fresh snapshot: no fail-static line


def test_summary_shows_desired_and_running_per_deployment() -> None:
    doc = live_document()
    text = format_status(doc)
    model = doc["replicas"][MODEL_DEPLOYMENT]
    assert f"  {MODEL_DEPLOYMENT}: {model['desired']} / 1" in text
    assert f"  {ROUTER_DEPLOYMENT}: - / 1" in text  # routers are counted, never desired by the controller


def test_summary_names_an_open_breaker_and_its_failures() -> None:
    lines = format_status(live_document()).splitlines()
    # Opening resets the window, so an open breaker shows when it will let a probe through.
    assert any(line.startswith("    primary: open, half-open in ") for line in lines)


def test_summary_shows_lost_capacity_apart_from_breakers_only_when_there_was_some() -> None:
    doc = live_document()
    assert "lost capacity" not in format_status(doc)
    doc["models"][MODEL]["lost_capacity"] = {"migrated": 7, "not_migrated": 1, "streams_carried_on": 2}
    block = model_block(format_status(doc))
    assert any(
        line.startswith("  lost capacity: 7 carried on elsewhere, 1 not (to the fallback, else 503 REPLICA_LOST)")
        for line in block
    )


def test_summary_shows_hedges_only_when_some_were_sent() -> None:
    doc = live_document()
    assert "hedges" not in format_status(doc)
    doc["models"][MODEL]["hedges"] = {"in_flight": 0, "limit": 1, "sent": 5, "denied": 2, "won": 4, "delay_s": {}}
    block = model_block(format_status(doc))
    assert "  hedges: 5 sent (4 answered first), 2 denied by the budget" in block


# Serve's message for a replica it could not place (deployment_state.py), here a group of
# four one-GPU ranks on a cluster of one-GPU nodes, as serve.status() gives it.
PENDING = (
    "Deployment 'BallastModel' in application 'ballast' has 1 replicas that have taken more than 30s to be "
    "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to be "
    'installed. Resources required for each replica: [{"GPU": 1, "CPU": 1}, {"GPU": 1}, {"GPU": 1}, '
    '{"GPU": 1}], total resources available: {"CPU": 60.0, "GPU": 4.0}. Use `ray status` for more details.'
)


def test_summary_shows_a_replica_serve_cannot_place_and_why() -> None:
    doc = live_document()
    assert "deployments not healthy" not in format_status(doc)  # no section: nothing said
    healthy = {"status": "HEALTHY", "message": "", "replicas": {"RUNNING": 1}}
    doc["deployments"] = {"BallastRouter": healthy, "BallastModel": healthy}
    assert "deployments not healthy" not in format_status(doc)
    doc["deployments"]["BallastModel"] = {"status": "UPDATING", "message": PENDING, "replicas": {"STARTING": 1}}
    lines = format_status(doc).splitlines()
    at = lines.index("deployments not healthy (Serve's word):")
    assert lines[at + 1 : at + 3] == ["  BallastModel: UPDATING (1 STARTING)", f"    {PENDING}"]


def test_serves_word_is_read_at_most_once_per_interval_and_a_failure_leaves_it_out(monkeypatch) -> None:
    import asyncio

    import ray

    from ballast.router.serve_status import ServeStatusView

    clock, reads = FakeClock(0), []

    def read(app: str) -> dict[str, Any]:
        reads.append(app)
        if len(reads) == 2:
            raise RuntimeError("Serve's controller is restarting")
        return {"BallastModel": {"status": "HEALTHY", "message": "", "replicas": {"RUNNING": 1}}}

    view = ServeStatusView("ballast", ttl_s=2.0, read=read, clock=clock)

    async def walk() -> list[Any]:
        got = [await view.get(), await view.get()]  # the second within the interval: not read again
        clock.advance(2)
        got.append(await view.get())
        clock.advance(2)
        got.append(await view.get())
        return got

    first, again, failed, later = asyncio.run(walk())
    assert first == again and first["BallastModel"]["status"] == "HEALTHY"
    assert failed is None and later == first and reads == ["ballast"] * 3
    # No Ray in this process (`make test` runs the unit tests after the integration
    # session's Ray: it is taken away here, not assumed absent): Serve is not asked.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert asyncio.run(ServeStatusView("ballast").get()) is None


def test_summary_lists_only_tenants_near_their_quota() -> None:
    text = format_status(live_document())
    assert "tenants near their quota (bucket <= 20% of burst): 1" in text
    assert "  free: 12.5 of 200.0 tokens, refills 100.0/s" in text
    assert "  gold:" not in text


def test_summary_lists_kill_switches_with_scope_reason_and_who() -> None:
    doc = live_document()
    entry = doc["kill_switches"][0]
    text = format_status(doc)
    assert "kill switches: 1" in text
    assert f"  tenant=free: abuse from one key (by alice, id {entry['id']})" in text


def test_recorded_document_two_models_fail_static_recycle_and_gate() -> None:
    text = format_status(json.loads(SAMPLE.read_text()))
    lines = text.splitlines()
    assert lines[0] == "snapshot v4812 (3f9c2a1b), age 41.7 s"
    small = model_block(text, "small")
    assert small[0] == "model small: level 2 (target 1): hold 2: stable window"
    assert "  acting on: fail-static (no fresh word from the controller on this model)" in small
    assert (
        "  gate: limit 12, 12 at the model, 30 waiting, reserving slots for critical, refused drain 4, no_time 7"
        in (small)
    )
    large = model_block(text, "large")  # the second model: its own level, reason, replicas and gate
    assert large[0] == "model large: level 3 (target 4): up 2->3: queue_length=140>=100"
    assert "  replicas running / desired: 1 / 2 (BallastModel-large)" in large
    assert "  gate: limit 4, 4 at the model, 9 waiting" in large
    assert "    primary: open, 8 failed and 0 slow of 10 calls, half-open in 20 s" in large
    assert "recycles in flight: 1" in lines
    assert "  BallastModel#a1b2 (BallastModel): max_age, 14 s" in lines
    assert "  BallastModel: 3 / 2  [stable: desired 2 -> 2, +1 recycle surge]" in lines
    assert "kill switches: none" in lines
    assert "tenants near their quota (bucket <= 20% of burst): none" in lines


def test_json_flag_prints_the_raw_document(monkeypatch, capsys) -> None:
    doc = json.loads(SAMPLE.read_text())
    import ballast.ops.cli as cli

    monkeypatch.setattr(cli, "_admin_call", lambda ctx, method, path, body=None, show=True: doc)
    assert main(["--token", "t", "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == doc
    assert main(["--token", "t", "status"]) == 0
    assert capsys.readouterr().out.startswith("snapshot v4812 (3f9c2a1b)")


def test_an_answer_that_is_not_ballasts_is_a_clear_error_not_a_traceback(capsys) -> None:
    """A real loopback server answering as Serve does while the app deploys (404, plain text)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class NotBallast(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"Path '/v1/status' not found."
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), NotBallast)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["--url", url, "--token", "t", "status"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert "answered 404 with no JSON document" in err and "not found" in err


def test_without_url_the_commands_go_to_the_stack_make_serve_started(tmp_path: Path) -> None:
    from ballast.ops.cli import DEFAULT_URL, default_url

    run = tmp_path / ".run"
    assert default_url(run) == DEFAULT_URL  # nothing started here
    run.mkdir()
    (run / "ballast-8123.pid").write_text(json.dumps({"pid": 1, "url": "http://127.0.0.1:8123"}))
    assert default_url(run) == "http://127.0.0.1:8123"  # the only stack running
    (run / "ballast-8000.pid").write_text(json.dumps({"pid": 2, "url": "http://127.0.0.1:8000"}))
    assert default_url(run) == "http://127.0.0.1:8000"  # make serve's, of two
    (run / "ballast-8000.pid").write_text("not json")
    assert default_url(run) == DEFAULT_URL


def test_status_without_url_reads_the_pid_file_and_says_when_nothing_answers(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".run").mkdir()
    (tmp_path / ".run" / "ballast-8123.pid").write_text(json.dumps({"pid": 1, "url": "http://127.0.0.1:9"}))
    monkeypatch.setenv("BALLAST_ADMIN_TOKEN", "t")
    assert main(["status"]) != 0
    assert "cannot reach Ballast at http://127.0.0.1:9" in capsys.readouterr().err


def test_an_option_the_subcommand_does_not_have_is_a_usage_error_not_a_traceback(capsys) -> None:
    # --url belongs before the subcommand (``ballast --url U status``); after it, click's usage error.
    assert main(["status", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "No such option: --url" in err and "Traceback" not in err


def _fair_gate() -> dict[str, Any]:
    """The gate's part of /v1/status with fair shares, from a real TenantCounters."""
    from ballast.policies.fairness import TenantCounters

    clock = FakeClock(0)
    fair = TenantCounters({"gold": 3.0, "free": 1.0, "batch": 1.0}, clock=clock)
    fair.backlogged("free")
    fair.settle(fair.charge("free", 30, 10), 10)
    fair.adopt({"gold": 5.0, "free": 0.0, "batch": 0.0})
    return {"limit": 16, "in_flight": 3, "waiting": 2, "fairness": fair.view()}


def test_tenants_rows_join_quotas_and_fair_shares() -> None:
    from ballast.ops.status_text import tenant_rows

    doc = live_document()
    doc["models"][MODEL]["gate"] = _fair_gate()
    rows = tenant_rows(doc)
    assert rows["free"]["tokens"] == 12.5  # the quota fields are kept as they were
    free, gold = rows["free"]["fair_shares"][MODEL], rows["gold"]["fair_shares"][MODEL]
    assert free["waiting"] is True and free["served_per_s"] == round(50 / 30, 1)
    assert (gold["counter"], gold["waiting"], gold["view"]) == (5.0, False, "cluster")
    assert rows["batch"] == {
        "fair_shares": {MODEL: {"counter": 0.0, "served_per_s": 0.0, "waiting": False, "view": "cluster"}}
    }
    assert tenant_rows(live_document()) == live_document()["quotas"]  # no gate: the quotas alone


def test_summary_says_whose_counters_order_the_line() -> None:
    doc = live_document()
    doc["models"][MODEL]["gate"] = _fair_gate()
    assert "  fair shares: cluster-wide counters; tenants waiting: free" in model_block(format_status(doc))
    doc["models"][MODEL]["gate"]["fairness"]["view"] = "router"
    assert "  fair shares: this router's own counters (no controller reply); tenants waiting: free" in model_block(
        format_status(doc)
    )


def test_each_model_says_how_its_requests_spread_over_its_replicas() -> None:
    # The controller's routing summary from the replicas' vLLM counters and the routers'
    # decisions (ballast.policies.control.routing_summary), as `ballast status` shows it.
    clock, wall = FakeClock(0), FakeClock(1_000_000)
    core = ControllerCore(load_config({}), clock=clock, wall_clock=wall)
    core.report_router(
        RouterReport(router_id="r1", models={MODEL: ModelLoad(routed={"prefix": 6, "home": 1, "balance": 1})})
    )
    core.report_router(RouterReport(router_id="r2", models={MODEL: ModelLoad(routed={"prefix": 3, "home": 1})}))
    for rid, running, queries, hits in (("m1", 6, 1000, 900), ("m2", 2, 1000, 700)):
        core.report_replica(
            ReplicaReport(
                replica_id=rid,
                deployment=MODEL_DEPLOYMENT,
                running=running,
                prefix_cache_queries=queries,
                prefix_cache_hits=hits,
                prefix_blocks=40,
            )
        )
    clock.advance(1)
    wall.advance(1)
    snap = core.tick()
    (name,) = snap.models
    routing = snap.models[name].routing
    assert routing == RoutingSummary(prefix_hit_ratio=0.8, routed_by_prefix_ratio=0.75, load_max_over_mean=1.5)
    doc = {"snapshot": snap.to_dict()}
    assert "  routing: prefix-cache hits 80%, routed by prefix 75%, most loaded replica 1.50x the mean" in (
        model_block(format_status(doc), name)
    )
    # A model with nothing to say (one replica, no vLLM counters, nothing routed) says nothing.
    core = ControllerCore(load_config({}), clock=clock, wall_clock=wall)
    core.report_replica(ReplicaReport(replica_id="m1", deployment=MODEL_DEPLOYMENT, running=3))
    snap = core.tick()
    assert snap.models[name].routing == RoutingSummary()
    assert "routing:" not in format_status({"snapshot": snap.to_dict()})
