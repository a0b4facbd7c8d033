"""``python -m serve_app.cli serve|stop|kill-switch``: the local stack behind ``make serve`` / ``make stop``,
and the operator's kill switch (``ballast kill-switch set|list|clear``, over the admin API).

``serve`` starts a local Ray inside this process, the controller actor and the app,
waits until ``/healthz/ready`` answers, prints the URL and a curl example, and stays
in the foreground. SIGINT (Ctrl-C) or SIGTERM shuts Serve, the controller and Ray
down cleanly. ``stop`` signals only the process recorded in ``.run/ballast.pid``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

PIDFILE = Path(".run/ballast.pid")


def _wait_ready(url: str, timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import load_config

    cfg = load_config(args.config)
    if PIDFILE.exists():
        try:
            other = json.loads(PIDFILE.read_text())["pid"]
            os.kill(other, 0)
            print(f"a Ballast stack is already running (pid {other}); `make stop` first", file=sys.stderr)
            return 1
        except (OSError, ValueError, KeyError):
            PIDFILE.unlink(missing_ok=True)  # left behind by a stack that died

    import ray

    from .app import shutdown, start

    ray.init(include_dashboard=args.dashboard, logging_level="WARNING")
    # After ray.init: Ray's core installs its own SIGTERM handler (it aborts the
    # process); ours replaces it so that both signals shut down cleanly.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start(cfg, cfg.http.host, cfg.http.port)
        base = f"http://{cfg.http.host}:{cfg.http.port}"
        PIDFILE.parent.mkdir(exist_ok=True)
        PIDFILE.write_text(json.dumps({"pid": os.getpid(), "url": base}))
        ready = _wait_ready(f"{base}/healthz/ready", 120)
        print(f"\nBallast is {'ready' if ready else 'up (not ready yet)'} at {base}")
        if cfg.auth.demo_keys:
            key = next(iter(cfg.auth.demo_keys))
            print(
                f"  curl -s {base}/v1/generate -H 'Authorization: Bearer {key}' "
                "-H 'Content-Type: application/json' -d '{\"prompt\": \"Hello\", \"max_tokens\": 32}'"
            )
        print("Ctrl-C (or `make stop` from another shell) stops Serve and Ray.\n", flush=True)
        while not stop.wait(0.5):
            pass
        print("stopping Ballast...", flush=True)
    finally:
        try:
            shutdown(cfg)
        finally:
            ray.shutdown()
            PIDFILE.unlink(missing_ok=True)
    print("stopped.")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        pid = json.loads(PIDFILE.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        print("no Ballast stack started by `make serve` is running here")
        return 0
    try:
        os.kill(pid, signal.SIGINT)  # what Ctrl-C sends: the same clean shutdown
    except ProcessLookupError:
        PIDFILE.unlink(missing_ok=True)
        print("the recorded stack was already gone")
        return 0
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"stopped Ballast (pid {pid})")
            return 0
        time.sleep(0.5)
    print(f"pid {pid} did not stop within {args.timeout_s:g}s", file=sys.stderr)
    return 1


def _admin(args: argparse.Namespace):
    """An httpx client for the admin API of the running stack (URL from .run/ballast.pid)."""
    import httpx

    url = args.url
    if url is None:
        try:
            url = json.loads(PIDFILE.read_text())["url"]
        except (OSError, ValueError, KeyError):
            url = "http://127.0.0.1:8000"
    token = args.token or os.environ.get("BALLAST_ADMIN_TOKEN")
    if not token:
        raise SystemExit("set BALLAST_ADMIN_TOKEN (or --token) to the admin token")
    headers = {"Authorization": f"Bearer {token}", "X-Ballast-Operator": args.operator}
    return httpx.Client(base_url=url, headers=headers, timeout=10)


def _show(r) -> int:
    print(json.dumps(r.json(), indent=2))
    return 0 if r.status_code < 400 else 1


def cmd_kill_switch(args: argparse.Namespace) -> int:
    with _admin(args) as c:
        if args.action == "set":
            body = {"scope": args.scope, "value": args.value, "reason": args.reason, "expires_in_s": args.expires_in_s}
            return _show(c.post("/admin/kill-switch", json=body))
        if args.action == "list":
            return _show(c.get("/admin/kill-switch"))
        return _show(c.delete(f"/admin/kill-switch/{args.id}"))


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(prog="ballast")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_serve = sub.add_parser("serve", help="run the local stack in the foreground")
    p_serve.add_argument("--config", default="cluster/local.yaml")
    p_serve.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True)
    p_serve.set_defaults(func=cmd_serve)
    p_stop = sub.add_parser("stop", help="stop the stack started by `serve`")
    p_stop.add_argument("--timeout-s", type=float, default=60.0)
    p_stop.set_defaults(func=cmd_stop)
    p_ks = sub.add_parser("kill-switch", help="set, list or clear kill switches on the running stack")
    p_ks.add_argument("--url", default=None, help="default: the stack `make serve` started")
    p_ks.add_argument("--token", default=None, help="admin token (default: $BALLAST_ADMIN_TOKEN)")
    p_ks.add_argument("--operator", default=os.environ.get("USER", "cli"), help="recorded as set_by")
    ks_sub = p_ks.add_subparsers(dest="action", required=True)
    ks_set = ks_sub.add_parser("set")
    ks_set.add_argument("--scope", required=True, choices=["global", "tenant", "model", "criticality"])
    ks_set.add_argument("--value", default=None)
    ks_set.add_argument("--reason", required=True)
    ks_set.add_argument("--expires-in-s", type=int, required=True)
    ks_sub.add_parser("list")
    ks_clear = ks_sub.add_parser("clear")
    ks_clear.add_argument("id")
    p_ks.set_defaults(func=cmd_kill_switch)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
