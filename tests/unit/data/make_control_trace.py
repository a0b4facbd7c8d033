"""Writes control_trace.json: 90 control ticks (3 s apart) of router, replica and watchdog reports.

The story: idle (ticks 0-9), a load rise (10-29), a saturated spell with the gate
full and errors (30-44), replica r2 hung for 25 ticks (45-69: killed, and killed
again once the 60 s cooldown has passed), a new replica r3 from tick 48, calm from
tick 60, r1's watchdog asking for its recycle (68-77: the surge asks for one replica
more meanwhile), r1 drained away (78) and its replacement r4 serving (79 on). Regenerate with
``python tests/unit/data/make_control_trace.py`` (the test reads the JSON only).
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL = "BallastModel"
WALL0 = 1_000_000
TICK_S = 3


def tick(k: int) -> dict:
    wall = WALL0 + k * TICK_S
    if k < 10:
        inflight, p95, errors, full = 2, 20.0, 0, False
    elif k < 30:
        inflight, p95, errors, full = 2 + (k - 9) * 20, 100.0 * (k - 9), 0, False
    elif k < 45:
        inflight, p95, errors, full = 600, 4000.0, 8, True
    elif k < 60:
        inflight, p95, errors, full = 120, 600.0, 1, False
    else:
        inflight, p95, errors, full = 6, 30.0, 0, False
    router = {
        "router_id": "rt1",
        "inflight": inflight,
        "requests": 50,
        "errors": errors,
        "queue_wait_p95_ms": p95,
        "gate_waiting": 40 if full else 0,
        "gate_full": full,
        "served_rps": 50.0,
        "demand_rps": {"critical": 60.0, "sheddable": 30.0} if k >= 10 else {"critical": 5.0},
    }
    names = ["r2"] + (["r1"] if k < 78 else []) + (["r3"] if k >= 48 else []) + (["r4"] if k >= 79 else [])
    started = {"r1": WALL0 - 3600, "r2": WALL0 - 3000, "r3": WALL0 + 48 * TICK_S, "r4": WALL0 + 79 * TICK_S}
    n = len(names)
    running_each = min(inflight, 32 * n) // n
    queued_each = max(0, inflight - running_each * n) // n
    replicas, watchdogs = [], []
    for rid in sorted(names):
        hung = rid == "r2" and 45 <= k < 70
        replicas.append(
            {
                "replica_id": rid,
                "deployment": MODEL,
                "queued": queued_each,
                "running": 0 if hung else running_each,
                "queue_wait_p95_ms": p95,
                "started_at_s": float(started[rid]),
                "ready": True,
            }
        )
        wd = {
            "replica_id": rid,
            "deployment": MODEL,
            "ready": True,
            "hung": hung,
            "actor_name": f"SERVE_REPLICA::{MODEL}#{rid}",
            "actor_namespace": "serve",
            "heartbeat_age_s": 9.0 if hung else 0.5,
        }
        if rid == "r1" and 68 <= k < 78:
            wd.update(recycle_requested=True, reason="rss_leak", critical=False)
        watchdogs.append(wd)
    return {"k": k, "wall_s": wall, "routers": [router], "replicas": replicas, "watchdogs": watchdogs}


if __name__ == "__main__":
    out = Path(__file__).with_name("control_trace.json")
    out.write_text(
        json.dumps({"tick_s": TICK_S, "wall0_s": WALL0, "ticks": [tick(k) for k in range(90)]}, indent=None) + "\n"
    )
    print(out)
