"""``ballast`` (``python -m ballast.ops.cli``): the local stack behind ``make serve`` / ``make stop``,
and the operator's commands over the admin API: ``status`` (a summary; ``--json`` the
document), ``tenants``,
``kill-switch on|off|list``, ``chaos on|off`` (admin token from ``$BALLAST_ADMIN_TOKEN``).

``serve`` starts the Batch API's embedded store (``.run/redis/<port>/``, unless
``batch.store_url`` names one or ``batch.enabled`` is false), a local Ray inside this
process, the controller actor and the app, waits until ``/healthz/ready`` answers, prints
the URL and a curl example, and stays in the foreground. SIGINT (Ctrl-C) or SIGTERM shuts
Serve, the controller and Ray down cleanly, then the store (its data kept). ``stop``
signals only the process recorded in ``.run/ballast-<port>.pid`` (one file per HTTP port:
stacks on other ports, a test run beside ``make serve``, are left alone).

The admin token goes only where the operator points: ``--url``, else ``$BALLAST_URL``,
else the stack ``serve`` started here, else ``http://127.0.0.1:8000``. A pid file is
believed (for its URL, and by ``stop`` for its pid) only when it is the operator's own
(:func:`read_pid`): a regular file, not a symlink, owned by this user and writable by no
one else, in a ``.run`` directory that is the same, naming a loopback URL. ``serve``
makes ``.run`` mode 0700 and its pid file 0600 (O_EXCL, O_NOFOLLOW). With
``http.admin_port`` the pid file names the admin port's URL too, and the admin
commands use it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import typer

from ballast.ops.status_text import format_status, tenant_rows

if TYPE_CHECKING:
    from ballast.batch.embedded import EmbeddedRedis
    from ballast.config import BallastConfig


def pidfile(port: int) -> Path:
    return Path(f".run/ballast-{port}.pid")


DEFAULT_URL = "http://127.0.0.1:8000"
MAX_PID_FILE_BYTES = 4096


def _owned(st: os.stat_result, kind: int) -> bool:
    """Of this kind (stat.S_IFDIR / S_IFREG), this user's, writable by no one else."""
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o022 == 0


def is_loopback_url(url: str) -> bool:
    """An http(s) URL whose host is this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        if parts.scheme not in ("http", "https") or host is None:
            return False
        parts.port  # noqa: B018 -- raises ValueError on a bad port
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_pid(path: Path) -> dict[str, Any] | None:
    """The pid file's document when it is the operator's own, else None: ``path`` and its
    directory are this user's, writable by no one else, not symlinks (the file is opened
    O_NOFOLLOW and checked on the open descriptor), and it holds a pid and a URL."""
    try:
        if not _owned(os.lstat(path.parent), stat.S_IFDIR):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not _owned(os.fstat(f.fileno()), stat.S_IFREG):
                return None
            doc = json.loads(f.read(MAX_PID_FILE_BYTES + 1)[:MAX_PID_FILE_BYTES])
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("pid"), int) or not isinstance(doc.get("url"), str):
        return None
    return doc


def write_pid(path: Path, doc: dict[str, Any]) -> None:
    """``doc`` as a new pid file (mode 0600, O_EXCL, O_NOFOLLOW) in a ``.run`` made 0700;
    raises OSError when either is not this user's own or the file exists."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if not _owned(os.lstat(path.parent), stat.S_IFDIR):
        raise PermissionError(f"{path.parent} is not a directory of this user's that only it may write")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc))


def default_url(run_dir: Path = Path(".run")) -> str:
    """Where the admin commands go without ``--url`` or ``$BALLAST_URL``: the stack
    ``make serve`` started here (its pid file, if :func:`read_pid` believes it and its URL
    is a loopback one: the default config's port, else the only stack running; its admin
    port's URL when it has one), else the default port."""
    try:
        found = sorted(run_dir.glob("ballast-*.pid"))
    except OSError:
        found = []
    default = run_dir / pidfile(8000).name
    for path in [default] if default in found else found if len(found) == 1 else []:
        doc = read_pid(path)
        url = doc.get("admin_url") or doc["url"] if doc is not None else None
        if isinstance(url, str) and is_loopback_url(url):
            return url
    return DEFAULT_URL


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


def _held_by_another(pid_path: Path) -> bool:
    """Whether ``pid_path`` stops this stack from starting (said on stderr): a pid file
    that is not this user's own, or a stack still running. A stale one is removed."""
    if not os.path.lexists(pid_path):
        return False
    doc = read_pid(pid_path)
    if doc is None:
        print(
            f"{pid_path} is not this user's own pid file (owner, mode, symlink or URL); remove it if it is stale",
            file=sys.stderr,
        )
        return True
    try:
        os.kill(doc["pid"], 0)
    except OSError:
        pid_path.unlink(missing_ok=True)  # left behind by a stack that died
        return False
    print(f"a Ballast stack is already running (pid {doc['pid']}); `make stop` first", file=sys.stderr)
    return True


def embedded_store(cfg: BallastConfig, run_dir: Path = Path(".run")) -> tuple[BallastConfig, EmbeddedRedis | None]:
    """The Batch API's store for ``serve``: with ``batch.enabled`` and no ``batch.store_url``,
    an embedded redis-server started on ``run_dir/redis/<HTTP port>/`` (one per stack, as the
    pid files are) and ``cfg`` pointing the routers at it (its URL and password file); else
    ``cfg`` as it is and no store."""
    if not cfg.batch.enabled or cfg.batch.store_url is not None:
        return cfg, None
    from ballast.batch.embedded import EmbeddedRedis

    for d in (run_dir, run_dir / "redis"):
        d.mkdir(mode=0o700, exist_ok=True)
    store = EmbeddedRedis(run_dir / "redis" / str(cfg.http.port))
    store.start()
    batch = cfg.batch.model_copy(update={"store_url": store.url, "store_password_file": str(store.password_file)})
    return cfg.model_copy(update={"batch": batch}), store


def cmd_serve(args: argparse.Namespace) -> int:
    from ballast.config import load_config

    cfg = load_config(
        args.config,
        model_dir=getattr(args, "model", None) or None,
        engine=getattr(args, "engine", None) or "transformers",
    )
    pid_path = pidfile(cfg.http.port)
    if _held_by_another(pid_path):
        return 1
    cfg, store = embedded_store(cfg)
    try:
        return _serve(cfg, pid_path, args.dashboard)
    finally:
        if store is not None:
            store.stop()  # after the app and Ray: no router writes to it any more


def _serve(cfg: BallastConfig, pid_path: Path, dashboard: bool) -> int:
    """Ray, the app and the controller up until SIGINT or SIGTERM, then down."""
    import ray

    from ballast.ops.app import shutdown, start
    from ballast.router.ingress import apply_ingress_env

    apply_ingress_env(cfg)
    ray.init(include_dashboard=dashboard, logging_level=logging.WARNING)
    # After ray.init: Ray's core installs its own SIGTERM handler (it aborts the
    # process); ours replaces it so that both signals shut down cleanly.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start(cfg, cfg.http.host, cfg.http.port)
        base = f"http://{cfg.http.host}:{cfg.http.port}"
        local = f"http://127.0.0.1:{cfg.http.port}" if cfg.http.host in ("0.0.0.0", "::", "") else base
        record: dict[str, Any] = {"pid": os.getpid(), "url": local}
        if cfg.http.admin_port is not None:
            record["admin_url"] = f"http://127.0.0.1:{cfg.http.admin_port}"
        write_pid(pid_path, record)
        ready = _wait_ready(f"{base}/healthz/ready", 120)
        print(f"\nBallast is {'ready' if ready else 'up (not ready yet)'} at {base}")
        if cfg.auth.demo_keys:
            key = next(iter(cfg.auth.demo_keys))
            print(
                f"  curl -s {base}/v1/generate -H 'Authorization: Bearer {key}' "
                '-H \'Content-Type: application/json\' -d \'{"prompt": "Hello", "max_tokens": 32}\''
            )
            print(
                f"  curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {key}' "
                "-H 'Content-Type: application/json' "
                f'-d \'{{"model": "{cfg.model.name}", '
                '"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}\''
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
            pid_path.unlink(missing_ok=True)
    print("stopped.")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from ballast.config import load_config

    pid_path = pidfile(load_config(args.config).http.port)
    doc = read_pid(pid_path)
    if doc is None:
        if os.path.lexists(pid_path):
            print(
                f"{pid_path} is not this user's own pid file (owner, mode, symlink or URL): not signalling it",
                file=sys.stderr,
            )
            return 1
        print("no Ballast stack started by `make serve` is running here")
        return 0
    pid = doc["pid"]
    try:
        os.kill(pid, signal.SIGINT)  # what Ctrl-C sends: the same clean shutdown
    except ProcessLookupError:
        pid_path.unlink(missing_ok=True)
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


# -- the operator's commands: they talk to the admin API of a running stack -------------
app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Ballast: run the local stack, operate a running one."
)
ks_app = typer.Typer(no_args_is_help=True, help="Kill switches: refuse traffic by scope, with a reason and an expiry.")
chaos_app = typer.Typer(no_args_is_help=True, help="Fault injection (only where the config enables chaos).")
app.add_typer(ks_app, name="kill-switch")
app.add_typer(chaos_app, name="chaos")


@dataclass
class _Target:
    url: str | None
    token: str | None
    operator: str


@app.callback()
def _options(
    ctx: typer.Context,
    url: str | None = typer.Option(
        None,
        envvar="BALLAST_URL",
        help="Ballast's URL, where the admin token goes (default: the stack `make serve` "
        "started here, its admin port if it has one, else http://127.0.0.1:8000)",
    ),
    token: str | None = typer.Option(None, help="admin token (default: $BALLAST_ADMIN_TOKEN)"),
    operator: str = typer.Option(os.environ.get("USER", "cli"), help="recorded in the audit trail"),
) -> None:
    ctx.obj = _Target(url, token, operator)


def _admin_call(
    ctx: typer.Context, method: str, path: str, body: dict[str, Any] | None = None, show: bool = True
) -> Any:
    """One admin request; clear errors when the server is unreachable or the token is refused."""
    import httpx

    t: _Target = ctx.obj
    url = t.url or default_url()
    token = t.token or os.environ.get("BALLAST_ADMIN_TOKEN")
    if not token:
        typer.echo("set BALLAST_ADMIN_TOKEN (or --token) to the admin token", err=True)
        raise typer.Exit(2)
    headers = {"Authorization": f"Bearer {token}", "X-Ballast-Operator": t.operator}
    try:
        r = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=10)
    except httpx.HTTPError as e:
        typer.echo(f"cannot reach Ballast at {url}: {e}", err=True)
        raise typer.Exit(2) from None
    if r.status_code in (401, 403):
        typer.echo(f"the admin token was refused ({r.status_code}): {r.text}", err=True)
        raise typer.Exit(1)
    try:
        doc = r.json()
    except ValueError:  # not Ballast answering (e.g. Serve's 404 while the app deploys)
        typer.echo(f"{url}{path} answered {r.status_code} with no JSON document: {r.text[:200]}", err=True)
        raise typer.Exit(1) from None
    if show or r.status_code >= 400:
        typer.echo(json.dumps(doc, indent=2))
    if r.status_code >= 400:
        raise typer.Exit(1)
    return doc


@app.command()
def serve(
    config: str = typer.Option("cluster/local.yaml", help="the Ballast config (YAML)"),
    dashboard: bool = typer.Option(True, help="start the Ray dashboard (and its metrics agent)"),
    model: str = typer.Option("", help="serve this local Hugging Face model directory as the config's first model"),
    engine: str = typer.Option("transformers", help="the engine for --model: transformers or vllm"),
) -> None:
    """Run the local stack in the foreground (embedded Ray); Ctrl-C stops it."""
    if engine not in ("transformers", "vllm"):
        raise typer.BadParameter(f"{engine!r}: transformers or vllm", param_hint="--engine")
    raise typer.Exit(cmd_serve(argparse.Namespace(config=config, dashboard=dashboard, model=model, engine=engine)))


@app.command()
def stop(
    config: str = typer.Option("cluster/local.yaml", help="the config it was started with (its HTTP port names it)"),
    timeout_s: float = typer.Option(60.0, help="how long to wait for it to exit"),
) -> None:
    """Stop the stack `ballast serve` / `make serve` started here on the config's port."""
    raise typer.Exit(cmd_stop(argparse.Namespace(config=config, timeout_s=timeout_s)))


# -- `ballast status`: GET /v1/status as an operator reads it (ballast.ops.status_text) ------
@app.command()
def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="print the raw /v1/status document"),
) -> None:
    """Each model's level and why, its replicas running/desired, breakers and gate; replicas
    desired/running per deployment, deployments Serve calls unhealthy (a replica it cannot place
    yet, and why), tenants near quota, recycles, kill switches."""
    doc = _admin_call(ctx, "GET", "/v1/status", show=False)
    typer.echo(json.dumps(doc, indent=2) if as_json else format_status(doc))


@app.command()
def tenants(ctx: typer.Context) -> None:
    """Each tenant's token rate at the answering router, its bucket and whether a lease backs
    it; at each model's gate, its fair-share counter, its service per second and whether it waits."""
    doc = _admin_call(ctx, "GET", "/v1/status", show=False)
    typer.echo(json.dumps(tenant_rows(doc), indent=2))


@app.command()
def replicas(ctx: typer.Context) -> None:
    """Every replica as its watchdog sees it (RSS, VRAM, threads, fds, leak trends), recycles and events."""
    _admin_call(ctx, "GET", "/admin/replicas")


@app.command()
def recycle(
    ctx: typer.Context,
    replica_id: str | None = typer.Argument(None, help="one replica (ids: `ballast replicas`)"),
    all_: bool = typer.Option(False, "--all", help="every replica, one at a time"),
    deployment: str | None = typer.Option(None, help="with --all: only BallastModel or BallastFallbackModel"),
) -> None:
    """Recycle replicas gracefully, in turn, under the planner's limits (max_unavailable, min_available)."""
    if replica_id is None and not all_:
        typer.echo("name a replica id, or pass --all", err=True)
        raise typer.Exit(2)
    _admin_call(ctx, "POST", "/admin/recycle", {"replica_id": replica_id, "deployment": deployment, "all": all_})


@ks_app.command("on")
def kill_switch_on(
    ctx: typer.Context,
    scope: str = typer.Option(..., help="global | tenant | model | criticality"),
    reason: str = typer.Option(..., help="why (shown to refused clients)"),
    expires_in_s: int = typer.Option(..., help="mandatory expiry"),
    value: str | None = typer.Option(None, help="the tenant, model or criticality (none for global)"),
) -> None:
    """Set a kill switch."""
    _admin_call(
        ctx,
        "POST",
        "/admin/kill-switch",
        {"scope": scope, "value": value, "reason": reason, "expires_in_s": expires_in_s},
    )


@ks_app.command("off")
def kill_switch_off(ctx: typer.Context, entry_id: str = typer.Argument(..., help="the id `on` printed")) -> None:
    """Lift a kill switch."""
    _admin_call(ctx, "DELETE", f"/admin/kill-switch/{entry_id}")


@ks_app.command("list")
def kill_switch_list(ctx: typer.Context) -> None:
    """Active kill switches and the audit trail."""
    _admin_call(ctx, "GET", "/admin/kill-switch")


@chaos_app.command("on")
def chaos_on(
    ctx: typer.Context,
    target: str = typer.Option("primary", help="primary | fallback"),
    error_ratio: float = typer.Option(0.0),
    latency_ms: int = typer.Option(0),
    hang: bool = typer.Option(False),
    stall: bool = typer.Option(False, help="stop the work loop mid-batch (the watchdog kills the replica)"),
    step_delay_ms: int = typer.Option(0, help="before each decode step: a slow device"),
    leak_mb_per_s: float = typer.Option(0.0, help="host memory (RSS)"),
    vram_leak_mb_per_s: float = typer.Option(0.0, help="GPU memory, on replicas whose model is on a GPU"),
) -> None:
    """Inject faults into every replica of a model deployment."""
    body = {
        "target": target,
        "error_ratio": error_ratio,
        "latency_ms": latency_ms,
        "hang": hang,
        "stall": stall,
        "step_delay_ms": step_delay_ms,
        "leak_mb_per_s": leak_mb_per_s,
        "vram_leak_mb_per_s": vram_leak_mb_per_s,
    }
    _admin_call(ctx, "POST", "/admin/chaos", body)


@chaos_app.command("off")
def chaos_off(ctx: typer.Context) -> None:
    """Lift all injected faults."""
    _admin_call(ctx, "DELETE", "/admin/chaos")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (tests call this directly)."""
    import click

    try:
        result = typer.main.get_command(app).main(args=argv, prog_name="ballast", standalone_mode=False)
    except (click.exceptions.Exit, typer.Exit) as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except typer.exceptions.TyperException as e:  # typer's own click: a usage error (no such option, a bad value)
        show = getattr(e, "show", None)
        if callable(show):
            show()
        else:
            print(f"Error: {e.message}", file=sys.stderr)
        return e.exit_code
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
