"""``python -m serve_app.cli serve|stop``: the embedded local stack behind ``make serve`` / ``make stop``.

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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
