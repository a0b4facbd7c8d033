"""A 30-second headless Locust run of ``loadtest/locustfile.py`` against the integration stack.

Constant users (``BALLAST_SHAPE`` unset, no fault schedule), both tenants, plain
and streaming requests. Passes when Locust reports no failure at all (a 200 with
a bad body, a stream without ``done``, a 5xx other than the documented refusals, a
401, a timeout all count as failures), no exception in the user code, and every
kind (tenant × plain/stream) got successful answers. Expected refusals (429/503
with a documented code) are successes under ``"<kind> shed:<CODE>"`` and are only
checked to carry a documented code.

Bounded: Locust stops itself after 30 s (``-t``); the subprocess has a hard timeout.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BASE, ROOT, wait_quiet

pytestmark = pytest.mark.integration

RUN_S = 30  # a smoke run of every kind; the soak (make soak) is the long one
KINDS = ("gold plain", "gold stream", "free plain", "free stream")
DOCUMENTED_REFUSALS = {"QUOTA_EXCEEDED", "CONCURRENCY_LIMIT", "OVERLOADED", "KILL_SWITCH", "MODEL_UNAVAILABLE"}


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _locust_bin() -> Path:
    for candidate in (Path(sys.executable).with_name("locust"), ROOT / ".venv/bin/locust"):
        if candidate.exists():
            return candidate
    pytest.fail("locust is not installed in the venv (make install installs the [load] extra)")


def test_locust_smoke_has_no_unexpected_failure(client, tmp_path):
    wait_quiet(client)
    prefix = tmp_path / "smoke"
    report = tmp_path / "report.json"
    # The stack uses the demo keys; a developer's BALLAST_* settings (keys, shape,
    # faults) must not leak into this run, nor the unit tests' monkey-patch switch.
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_") and k != "LOCUST_SKIP_MONKEY_PATCH"}
    env["BALLAST_REPORT_JSON"] = str(report)
    cmd = [
        str(_locust_bin()),
        "-f",
        "loadtest/locustfile.py",
        "--headless",
        "--host",
        BASE,
        "-u",
        "8",
        "-r",
        "4",
        "-t",
        f"{RUN_S}s",
        "--csv",
        str(prefix),
        "--exit-code-on-error",
        "1",
        "--only-summary",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_S + 120)
    out = f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"

    stats_path = Path(f"{prefix}_stats.csv")
    assert stats_path.exists(), f"locust wrote no stats (rc {proc.returncode})\n{out}"
    stats = {r["Name"]: r for r in _rows(stats_path) if r["Name"] != "Aggregated"}
    failures = _rows(Path(f"{prefix}_failures.csv"))
    exceptions = _rows(Path(f"{prefix}_exceptions.csv"))

    assert not failures, f"unexpected failures: {failures}\n{out}"
    assert not exceptions, f"exceptions in the user code: {exceptions}\n{out}"
    failed = {name: r["Failure Count"] for name, r in stats.items() if int(r["Failure Count"])}
    assert not failed, f"failure counts: {failed}\n{out}"

    # Every row is a kind or a kind's shed with a documented code.
    for name in stats:
        kind, _, shed = name.partition(" shed:")
        assert kind in KINDS, name
        assert not shed or shed in DOCUMENTED_REFUSALS, name
    ok = {kind: int(stats[kind]["Request Count"]) if kind in stats else 0 for kind in KINDS}
    assert all(n > 0 for n in ok.values()), f"a kind got no successful answer: {ok}\n{out}"
    assert proc.returncode == 0, f"locust exited {proc.returncode}\n{out}"

    sheds = json.loads(report.read_text())["sheds"] if report.exists() else []
    assert {s["code"] for s in sheds} <= DOCUMENTED_REFUSALS, sheds
    shed_total = sum(int(r["Request Count"]) for name, r in stats.items() if " shed:" in name)
    by_reason = ", ".join(f"{name} {r['Request Count']}" for name, r in stats.items() if " shed:" in name) or "none"
    print(f"\nlocust smoke: {ok} ok, {shed_total} expected refusals ({by_reason}), 0 failures")
