"""The soak: a compressed (or real) day of load against a local Ballast stack, then its report.

``python -m loadtest.soak [--time-scale 96] [--peak-users N] [--port 8125]
[--out .run/soak/<timestamp>] [--faults soak|none] [--config cluster/local.yaml]``

1. Starts its own embedded Ray (a new local instance, never an existing cluster)
   and the app on ``127.0.0.1:<port>`` (loopback only), as the benchmarks do, and
   waits for ``/healthz/ready``.
2. Runs Locust headless as a subprocess on ``loadtest/locustfile.py`` with
   ``BALLAST_SHAPE=diurnal`` (one simulated day at ``--time-scale``; the shape ends
   the run by itself), the fault schedule (``--faults soak``), ``--csv <out>/locust
   --csv-full-history`` and ``BALLAST_REPORT_JSON=<out>/report.json``.
3. Meanwhile a sampler thread polls ``GET /v1/status`` and ``GET /admin/replicas``
   (admin token) every ``--sample-interval-s`` into ``<out>/status.jsonl``, one
   compact line per poll (``loadtest.report.status_sample``), at most
   ``MAX_SAMPLES`` lines.
4. Bounded in time: Locust gets the scaled day plus ``--margin-s``; past that it is
   sent SIGTERM (Locust then writes its CSVs and report.json) and, if it still runs,
   SIGKILL. Ctrl-C / SIGTERM on this process does the same. Then the sampler stops,
   Serve and the controller are shut down, Ray is shut down.
5. ``loadtest.report.build(<out>)`` writes ``<out>/report.md`` and its PNGs; the
   path is printed.

``--time-scale 1`` is the real 24 h soak (``make soak-24h``); Locust's history
interval and the sample interval grow with the day so that the files stay a few MB.

A compressed day compresses the replicas' day too (``compressed_config``): the
watchdog's leak window, its action ladder and its time-to-limit thresholds, and the
recycler's age limits are divided by the time scale (with floors), and the recycle
window (wall-clock hours) is dropped. Without this a leak lasting two simulated
hours (75 real seconds) could never reach a verdict from a one-hour trend window, and
no replica would ever reach its six-hour age. Load, deadlines and the degradation
level stay in real time: they are what the soak measures.

Written with ``subprocess`` and a thread rather than Locust's library API: Locust
monkey-patches the process with gevent, which Ray's own threads and gRPC do not
expect; a separate process keeps the two apart and is killed cleanly by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.report import STATUS_JSONL, build, status_sample
from loadtest.shapes import TimeScale

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
HOST = "127.0.0.1"  # loopback only: the soak injects faults
DEFAULT_PORT = 8125
MAX_SAMPLES = 50_000
READY_TIMEOUT_S = 300.0
LOCUST_TERM_GRACE_S = 30.0
#: Runs Locust's own CLI with its CSV history interval set first (Locust has no flag for
#: it; a module constant read by its CSV writer loop). argv[1] is the interval.
_LOCUST_BOOT = (
    "import sys; import locust.stats as s; s.CSV_STATS_INTERVAL_SEC = float(sys.argv.pop(1)); "
    "from locust.main import main; sys.argv[0] = 'locust'; sys.exit(main())"
)


# =========================================================================== settings (pure)


def sample_interval_s(day_real_s: float) -> float:
    """About 300 samples per day, between every 2 s and every 30 s."""
    return min(30.0, max(2.0, day_real_s / 300.0))


def history_interval_s(day_real_s: float) -> float:
    """Locust's history row interval: every second for a compressed day, 10 s for a real one."""
    return min(10.0, max(1.0, round(day_real_s / 8640.0)))


#: What a compressed day divides by the time scale, and the floor under each (seconds).
COMPRESSED = {
    ("watchdog", "leak_window_s"): 30.0,
    ("watchdog", "leak_short_window_s"): 20.0,  # 1 s samples: min_points (10) need >= 10 s of span
    ("watchdog", "leak_short_min_span_s"): 10.0,
    ("watchdog", "leak_short_horizon_s"): 30.0,
    ("watchdog", "step_interval_s"): 1.0,
    ("watchdog", "warn_tto_s"): 60.0,
    ("watchdog", "critical_tto_s"): 30.0,
    ("recycle", "max_age_s"): 120.0,
    ("recycle", "forced_max_age_s"): 240.0,
}


def compressed_config(data: Mapping[str, Any], time_scale: float) -> dict[str, Any]:
    """The config (as loaded YAML) for a day played ``time_scale`` times faster.

    The replicas' own clocks (leak trend, action ladder, time-to-limit, age) are
    compressed like the day; each value is divided by the scale, never below its floor
    in ``COMPRESSED``, and a value left null (off) stays null. The recycle window is
    wall-clock hours, which a compressed day cannot keep: it is dropped. Scale 1
    returns the config unchanged. Field defaults are read from the config's models,
    so a config that does not set a field is compressed too.
    """
    from ballast.config import RecycleSettings, WatchdogSettings

    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    if time_scale == 1:
        return out
    defaults = {"watchdog": WatchdogSettings(), "recycle": RecycleSettings()}
    for (section, name), floor in COMPRESSED.items():
        sect = out.setdefault(section, {})
        value = sect.get(name, getattr(defaults[section], name))
        if value is not None:
            sect[name] = max(floor, float(value) / time_scale)
    w = out["watchdog"]
    w["critical_tto_s"] = min(w["critical_tto_s"], w["warn_tto_s"])
    r = out["recycle"]
    if r.get("max_age_s") is not None and r.get("forced_max_age_s") is not None:
        r["forced_max_age_s"] = max(r["forced_max_age_s"], r["max_age_s"])
    r["window_start_hour"] = r["window_end_hour"] = None
    return out


def default_out_dir(now: datetime | None = None) -> Path:
    now = now or datetime.now(timezone.utc)
    return REPO / ".run" / "soak" / now.strftime("%Y%m%dT%H%M%SZ")


def admin_token(cfg: Any, env: Mapping[str, str]) -> str:
    """The stack's admin token as the router resolves it: env, then file, then the demo token."""
    a = cfg.auth
    if env.get(a.admin_token_env, "").strip():
        return env[a.admin_token_env].strip()
    if a.admin_token_file:
        return Path(a.admin_token_file).read_text(encoding="utf-8").strip()
    if a.demo_admin_token:
        return a.demo_admin_token
    raise SystemExit(f"no admin token: set ${a.admin_token_env} (the sampler reads /v1/status and /admin/replicas)")


def locust_command(out: Path, base_url: str, history_s: float) -> list[str]:
    return [
        sys.executable,
        "-c",
        _LOCUST_BOOT,
        f"{history_s:g}",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        base_url,
        "--csv",
        str(out / "locust"),
        "--csv-full-history",
        "--only-summary",
        "--logfile",
        str(out / "locust.log"),
        "--loglevel",
        "WARNING",
    ]


def locust_env(
    base: Mapping[str, str], out: Path, args: argparse.Namespace, base_url: str, token: str
) -> dict[str, str]:
    env = dict(base)
    env.update(
        {
            "BALLAST_SHAPE": "diurnal",
            "BALLAST_TIME_SCALE": f"{args.time_scale:g}",
            "BALLAST_PEAK_USERS": str(args.peak_users),
            "BALLAST_FAULTS": "soak" if args.faults == "soak" else "none",
            "BALLAST_REPORT_JSON": str(out / "report.json"),
            "BALLAST_HOST": base_url,
            "BALLAST_ADMIN_TOKEN": token,  # the fault runner's token: the same stack's
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        }
    )
    return env


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# =========================================================================== sampler


class StatusSampler:
    """Polls the status routes on a daemon thread into ``status.jsonl``.

    Threading: only the sampler thread writes the file; ``stop()`` sets the event
    (every wait goes through it) and joins. Bounded: at most ``max_samples`` lines;
    each line is small (``status_sample``). A failed poll is a line with ``error``,
    so the report shows the gap instead of hiding it.
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        path: Path,
        interval_s: float,
        *,
        max_samples: int = MAX_SAMPLES,
        wall_clock: Callable[[], float] = time.time,
        timeout_s: float = 5.0,
    ) -> None:
        self._http = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
        self._path = path
        self._interval_s = interval_s
        self._max = max_samples
        self._wall = wall_clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ballast-soak-sampler", daemon=True)
        self.samples = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._http.close()

    def _get(self, path: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            r = self._http.get(path)
        except httpx.HTTPError as e:
            return None, f"{path}: {type(e).__name__}: {e}"
        if r.status_code != 200:
            return None, f"{path}: {r.status_code} {r.text[:120]}"
        try:
            body = r.json()
        except ValueError:
            return None, f"{path}: answer is not JSON"
        return (body, None) if isinstance(body, dict) else (None, f"{path}: answer is not an object")

    def poll_once(self) -> dict[str, Any]:
        t_s = self._wall()
        status, err1 = self._get("/v1/status")
        replicas, err2 = self._get("/admin/replicas")
        error = "; ".join(e for e in (err1, err2) if e) or None
        return status_sample(t_s, status, replicas, error)

    def _run(self) -> None:
        with self._path.open("a", encoding="utf-8") as f:
            while not self._stop.is_set() and self.samples < self._max:
                started = time.monotonic()
                f.write(json.dumps(self.poll_once(), separators=(",", ":")) + "\n")
                f.flush()
                self.samples += 1
                self._stop.wait(max(0.0, self._interval_s - (time.monotonic() - started)))


# =========================================================================== the run


def wait_ready(base_url: str, timeout_s: float, stop: threading.Event) -> bool:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, timeout=5.0) as c:
        while time.monotonic() < deadline and not stop.is_set():
            try:
                if c.get("/healthz/ready").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            stop.wait(1.0)
    return False


def run_locust(cmd: list[str], env: dict[str, str], limit_s: float, stop: threading.Event) -> tuple[int, str]:
    """Locust until it exits, ``limit_s`` passes or ``stop`` is set; returns (exit code, why it ended)."""
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), start_new_session=True)
    deadline = time.monotonic() + limit_s
    reason = "the shape's end (Locust exited)"
    try:
        while proc.poll() is None:
            if stop.is_set():
                reason = "a signal to the soak"
                break
            if time.monotonic() >= deadline:
                reason = f"the hard time limit ({limit_s:.0f} s)"
                break
            stop.wait(1.0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # Locust stops its users, writes its CSVs, runs its quit hooks
            try:
                proc.wait(LOCUST_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10.0)
                reason += "; Locust killed after SIGTERM"
    return proc.returncode, reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--time-scale", type=float, default=96.0, help="simulated seconds per real second (96: 15 min; 1: 24 h)"
    )
    parser.add_argument("--peak-users", type=int, default=20, help="Locust users at the day's peak")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the stack's HTTP port on 127.0.0.1")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default .run/soak/<UTC timestamp>)")
    parser.add_argument("--faults", choices=("soak", "none"), default="soak")
    parser.add_argument("--config", default="cluster/local.yaml")
    parser.add_argument(
        "--sample-interval-s", type=float, default=None, help="status poll interval (default: ~300 per day, 2-30 s)"
    )
    parser.add_argument(
        "--margin-s",
        type=float,
        default=None,
        help="time past the scaled day before Locust is stopped (default 10 %%, at least 60 s)",
    )
    args = parser.parse_args(argv)

    try:
        day_real_s = TimeScale(args.time_scale).day_real_s
    except ValueError as e:
        parser.error(str(e))
    if args.peak_users < 1:
        parser.error("--peak-users: must be >= 1")
    if not 1 <= args.port <= 65535:
        parser.error("--port: must be within 1..65535")
    interval_s = args.sample_interval_s or sample_interval_s(day_real_s)
    if interval_s <= 0:
        parser.error("--sample-interval-s: must be > 0")
    margin_s = args.margin_s if args.margin_s is not None else max(60.0, 0.1 * day_real_s)
    if not port_free(HOST, args.port):
        print(f"soak: port {HOST}:{args.port} is in use; pick another with --port", file=sys.stderr)
        return 2

    import yaml

    from ballast.config import load_config
    from ballast.errors import ConfigError

    try:
        with open(args.config, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        cfg = load_config(compressed_config(raw, args.time_scale) if isinstance(raw, dict) else raw)
    except (OSError, yaml.YAMLError, ConfigError) as e:
        parser.error(f"--config {args.config}: {e}")
    token = admin_token(cfg, os.environ)
    out = (args.out or default_out_dir()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base_url = f"http://{HOST}:{args.port}"
    run: dict[str, Any] = {
        "time_scale": args.time_scale,
        "peak_users": args.peak_users,
        "faults": args.faults,
        "config": args.config,
        "port": args.port,
        "day_real_s": day_real_s,
        "limit_s": day_real_s + margin_s,
        "sample_interval_s": interval_s,
        "history_interval_s": history_interval_s(day_real_s),
        "compressed": {f"{section}.{name}": getattr(getattr(cfg, section), name) for section, name in COMPRESSED},
    }
    run_json = out / "run.json"
    run_json.write_text(json.dumps(run, indent=2), encoding="utf-8")
    print(
        f"soak: one simulated day in {day_real_s / 60:.1f} min (scale {args.time_scale:g}), "
        f"peak {args.peak_users} users, "
        f"faults {args.faults}; output {out}",
        flush=True,
    )

    import ray

    from ballast.ops.app import shutdown, start
    from ballast.router.ingress import apply_ingress_env

    stop = threading.Event()
    apply_ingress_env(cfg)
    # address="local": always a fresh instance of our own, never a cluster already on this machine.
    # log_to_driver=False: Serve's per-request access lines (a day of them) stay in Ray's
    # session logs (/tmp/ray/session_latest/logs) instead of flooding this terminal.
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    # After ray.init (it installs its own SIGTERM handler): both signals end the soak cleanly.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    sampler: StatusSampler | None = None
    rc = 1
    try:
        start(cfg, HOST, args.port)
        if not wait_ready(base_url, READY_TIMEOUT_S, stop):
            run["stop_reason"] = "the stack never became ready" if not stop.is_set() else "a signal before the start"
            print(f"soak: {run['stop_reason']} ({base_url}/healthz/ready)", file=sys.stderr)
            return 1
        sampler = StatusSampler(base_url, token, out / STATUS_JSONL, interval_s)
        sampler.start()
        run["started_at_s"] = time.time()
        run_json.write_text(json.dumps(run, indent=2), encoding="utf-8")
        locust_rc, reason = run_locust(
            locust_command(out, base_url, run["history_interval_s"]),
            locust_env(os.environ, out, args, base_url, token),
            run["limit_s"],
            stop,
        )
        run.update({"ended_at_s": time.time(), "locust_rc": locust_rc, "stop_reason": reason})
        print(f"soak: Locust ended ({reason}), exit code {locust_rc}", flush=True)
        rc = 0 if locust_rc in (0, 1) else 1  # 1: some requests failed, which the report shows
    finally:
        if sampler is not None:
            sampler.stop()
            run["status_samples"] = sampler.samples
        run_json.write_text(json.dumps(run, indent=2), encoding="utf-8")
        try:
            shutdown(cfg)
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    path = build(out)
    print(f"soak: report {path}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
