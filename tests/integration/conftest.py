"""One real local Ray + Serve for the whole integration session (starting Ray costs ~5 s).

The app runs with ``tests/integration/test_config.yaml``'s differences applied on top
of ``cluster/local.yaml``: a smaller model (CPU speed), short windows, and low
queue thresholds so overload and scaling happen within seconds. It listens on
port 8123 so that a developer's ``make serve`` on 8000 is left alone.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ballast.ops.status_text import model_view, sole_model

ROOT = Path(__file__).resolve().parents[2]
PORT = 8123
BASE = f"http://127.0.0.1:{PORT}"
GOLD = {"Authorization": "Bearer dev-key-gold"}
FREE = {"Authorization": "Bearer dev-key-free"}
ADMIN = {"Authorization": "Bearer dev-admin-token"}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_config_dict() -> dict[str, Any]:
    base = yaml.safe_load((ROOT / "cluster/local.yaml").read_text())
    over = yaml.safe_load((Path(__file__).parent / "test_config.yaml").read_text())
    return _merge(base, over)


def wait_until(pred: Callable[[], Any], timeout_s: float, interval_s: float = 0.25, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def _own_stack(item: Any) -> bool:
    """Whether the test's module deploys a stack of its own (its ``OWN_STACK``)."""
    return bool(getattr(item.module, "OWN_STACK", False))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``last`` run after all others (they read what the others left behind);
    before them, the modules on the suite's default stack, then the modules that deploy a
    stack of their own (``OWN_STACK = True``). A module leaves its own stack running and
    the next module on the default stack deploys the default again (``_default_stack``),
    so the default comes back once, before the ``last`` tests, not after each own stack
    (a vLLM stack's redeploy is 15-20 s here)."""
    items.sort(key=lambda item: (item.get_closest_marker("last") is not None, _own_stack(item)))


class _Deployed:
    """The config the session's app runs now: the suite's default (``ballast``) or a module's own."""

    default: Any = None  # the session's config, set by the ``ballast`` fixture
    now: Any = None


def _deploy(cfg: Any, model_name: str) -> None:
    """Redeploy the app with ``cfg`` in place, the controller's config included (Serve
    rolls every replica over), and wait until the models route lists ``model_name``."""
    from ray import serve

    from ballast.ops.app import deploy

    _Deployed.now = None  # unknown until it serves: a failed deploy is redeployed by the next module
    deploy(cfg)

    def serving() -> bool:
        try:
            r = httpx.get(f"{BASE}/v1/models", headers=GOLD, timeout=5)
        except httpx.HTTPError:
            return False
        app = serve.status().applications[cfg.app_name]
        return (
            r.status_code == 200 and model_name in r.text and str(getattr(app.status, "value", app.status)) == "RUNNING"
        )

    wait_until(serving, 180, 0.5, f"the app serving {model_name}")
    _Deployed.now = cfg


@pytest.fixture(scope="module", autouse=True)
def _default_stack(request):
    """A module on the suite's default stack gets the default back if a module before it
    left its own stack running (nothing to do for a module with ``OWN_STACK``, or when the
    default runs already)."""
    if not getattr(request.module, "OWN_STACK", False) and _Deployed.now is not _Deployed.default:
        cfg = request.getfixturevalue("ballast")
        _deploy(cfg, cfg.model.name)
    yield


@pytest.fixture(scope="session")
def batch_store(tmp_path_factory):
    """The Batch API's store for the session: an embedded redis-server under the session's
    temporary directory (append-only file on), as ``make serve`` runs one, on a port fixed
    for the session."""
    import socket

    from ballast.batch.embedded import EmbeddedRedis

    with socket.socket() as s:  # a fixed port: a test restarts the store where the routers look
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = EmbeddedRedis(tmp_path_factory.mktemp("redis"), port=port)
    store.start()
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture(scope="session")
def ballast(batch_store):
    import ray

    from ballast.config import load_config
    from ballast.ops.app import shutdown, start
    from ballast.router.ingress import apply_ingress_env

    settings = test_config_dict()
    settings["batch"] = {
        **settings.get("batch", {}),
        "store_url": batch_store.url,
        "store_password_file": str(batch_store.password_file),
    }
    cfg = load_config(settings)
    apply_ingress_env(cfg)
    # The dashboard brings Ray's metrics agent, which the observability test scrapes.
    ray.init(include_dashboard=True, logging_level="ERROR", num_cpus=4)
    try:
        start(cfg, "127.0.0.1", PORT)
        wait_until(lambda: _ready(), 120, 0.5, "/healthz/ready")
        _Deployed.default = _Deployed.now = cfg
        yield cfg
    finally:
        try:
            shutdown(cfg)
        finally:
            ray.shutdown()


def _ready() -> bool:
    try:
        return httpx.get(f"{BASE}/healthz/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def client(ballast):
    with httpx.Client(base_url=BASE, timeout=60) as c:
        yield c


def status(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/v1/status", headers=ADMIN)
    r.raise_for_status()
    return r.json()


def model_status(client: httpx.Client, name: str | None = None) -> dict[str, Any]:
    """One model in /v1/status (the only one the stack serves, when unnamed): this router's
    view of it (level, source, breakers, retry budget, lost capacity, gate) and the
    controller's state of it under ``controller`` (target, reason, inputs)."""
    doc = status(client)
    return model_view(doc, name if name is not None else sole_model(doc))


async def flood(stop: asyncio.Event, clients: int = 40) -> None:
    """Critical load until ``stop`` is set: ``clients`` connections, each sending
    ``/v1/generate`` (200 tokens) back to back, which raises the level past the test
    config's queue thresholds (6/12)."""
    async with httpx.AsyncClient(base_url=BASE, timeout=60) as c:

        async def one() -> None:
            while not stop.is_set():
                await c.post("/v1/generate", headers=GOLD, json={"prompt": "load", "max_tokens": 200})

        await asyncio.gather(*(one() for _ in range(clients)))


async def level_raised(client: httpx.Client, timeout_s: float = 60) -> None:
    """Returns once the model's level is 1 or more, read every 0.5 s off the event loop, or
    after ``timeout_s`` either way (the caller's own assertion then says what did not happen)."""
    for _ in range(int(timeout_s / 0.5)):
        await asyncio.sleep(0.5)
        if (await asyncio.to_thread(model_status, client))["level"] >= 1:
            return


def serve_replica_states(deployment: str = "BallastModel") -> dict[str, int]:
    """Serve's own count of a deployment's replicas by state (RUNNING, STARTING, STOPPING, ...).

    Ballast's controller sees a replica only once it reports; Serve sees it from the
    moment it decides to start it, so a scale-up still arriving shows here first.
    """
    from ray import serve

    dep = serve.status().applications["ballast"].deployments[deployment]
    return {str(getattr(state, "value", state)): n for state, n in dep.replica_states.items() if n}


CHAOS_DEPLOYMENTS = {"primary": "BallastModel", "fallback": "BallastFallbackModel"}


def wait_chaos(client: httpx.Client, target: str, settings: dict[str, Any] | None, timeout_s: float = 15) -> None:
    """Wait until every replica of the target reports applying ``settings`` (None: no chaos).

    Replicas pick chaos up from their next snapshot and say what they apply in their
    report (``chaos`` in /admin/replicas), so a test waits for exactly that.
    """
    deployment = CHAOS_DEPLOYMENTS[target]

    def applied() -> bool:
        r = client.get("/admin/replicas", headers=ADMIN)
        rows = [row for row in r.json()["replicas"] if row["deployment"] == deployment] if r.status_code == 200 else []
        if not rows:
            return False
        if settings is None:
            return all(row.get("chaos") is None for row in rows)
        return all(row.get("chaos") and all(row["chaos"].get(k) == v for k, v in settings.items()) for row in rows)

    wait_until(applied, timeout_s, 0.2, f"every {deployment} replica applying chaos {settings}")


def breaker(client, role="primary") -> str:
    return model_status(client)["breakers"][role]["state"]


def heal(client, role="primary", timeout_s=30.0) -> None:
    """Send traffic until the breaker has gone half-open and closed again."""

    def closed() -> bool:
        client.post("/v1/generate", headers=GOLD, json={"prompt": f"heal {time.monotonic()}", "max_tokens": 4})
        return breaker(client, role) == "closed"

    wait_until(closed, timeout_s, 0.3, f"{role} breaker closed")


def set_chaos(client: httpx.Client, target: str, **settings: Any) -> None:
    """Set chaos on a target and wait until every replica of it applies it."""
    r = client.post("/admin/chaos", headers=ADMIN, json={"target": target, **settings})
    assert r.status_code == 200, r.text
    wait_chaos(client, target, settings)


def clear_chaos(client: httpx.Client) -> None:
    """Clear chaos and wait until no replica applies any."""
    r = client.delete("/admin/chaos", headers=ADMIN)
    assert r.status_code in (200, 204), r.text
    for target in CHAOS_DEPLOYMENTS:
        wait_chaos(client, target, None)


def wait_quiet(client: httpx.Client, timeout_s: float = 120) -> None:
    """Level 0 and one model replica, wanted and running: the state every load test starts from.

    ``desired`` matters: a scale-up decided by an earlier test may still be arriving.
    """
    seen: dict[str, Any] = {}

    def quiet() -> bool:
        seen.update(status(client))
        model = seen["replicas"]["BallastModel"]
        levels = {m["level"] for m in seen["models"].values()}
        return levels == {0} and model["desired"] == model["running"] == 1

    try:
        wait_until(quiet, timeout_s, 0.5, "level 0 with one model replica")
    except AssertionError as e:
        raise AssertionError(f"{e}; last /v1/status: {seen}") from None
