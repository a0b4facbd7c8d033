"""The router deployment: Ballast's HTTP ingress (FastAPI under Ray Serve).

Where things are:

- pipeline.py: the request path every front shares, where a request is identified,
  admitted, given its ticket (ticket.py: tenant place, quota charge, gate slot) and
  sent to the model (its docstring walks it);
- generate.py and openai.py: the native and OpenAI fronts, each holding the pipeline;
  openai_api.py: the OpenAI protocol's requests, openai_answers.py its answers;
  embeddings.py: ``/v1/embeddings`` on the same pipeline, embeddings_api.py its protocol;
- batches.py: OpenAI's Batch API (``/v1/files``, ``/v1/batches``) on the durable store;
  dispatcher.py: the loops that run batch lines on spare capacity and end batches;
- admin.py: ``/v1/status`` and ``/admin/*``; admin_port.py: those routes on a local-only
  port instead (``http.admin_port``);
- readiness.py: the cached model probe the health routes answer from;
- reporter.py: the router's side of the control loop (reports out; snapshots, leases
  and the edge's map in); tally.py: what it counts between two reports;
- gate.py, quotas.py, idempotency.py, resilience.py: the pieces the pipeline holds;
- api.py: the FastAPI app, the error mapping, body and SSE helpers; metrics.py: the
  router's metrics;
- this module: the ``Router`` deployment, which builds those parts once and declares
  the routes, each handing its request to its front.

Decisions are ballast/policies/'s: admission, quota, the gate (ballast/policies/gate.py) and the
per-request rules (ballast/policies/tokens.py, outcome.py, criticality.py, json_bounds.py); this
package gathers inputs and applies them.
"""

import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve

from ballast.batch.store import BatchStore
from ballast.batch.store import connect as connect_store
from ballast.config import BallastConfig, load_config
from ballast.control.link import connect
from ballast.errors import NotFound
from ballast.names import ROUTER_DEPLOYMENT
from ballast.policies.breaker import BreakerEvent
from ballast.router.admin import Admin
from ballast.router.admin_port import AdminListener, admin_app
from ballast.router.api import app
from ballast.router.auth import KeyStore
from ballast.router.batches import BatchFront
from ballast.router.calls import CallHooks
from ballast.router.contract import VERSION, openapi_document
from ballast.router.dispatcher import BatchDispatch, BatchHooks, Finalizer, ModelDispatcher
from ballast.router.edge import Edge
from ballast.router.embeddings import EmbeddingsFront
from ballast.router.generate import NativeFront
from ballast.router.idempotency import IdempotencyStore, SharedKeys
from ballast.router.lanes import build_lanes
from ballast.router.metrics import RouterMetrics
from ballast.router.openai import OpenAIFront
from ballast.router.pipeline import Pipeline
from ballast.router.quotas import Quotas
from ballast.router.readiness import CachedProbe
from ballast.router.reporter import Reporter, log
from ballast.router.responses import ResponsesFront
from ballast.router.serve_status import ServeStatusView


def _ping(handle: Any) -> Callable[[], Awaitable[object]]:
    """The readiness probe of one model: a ping through its Serve handle."""
    return lambda: handle.ping.remote()


@serve.ingress(app)
class Router:
    """One router replica: builds the pipeline, the fronts and the reporter; declares the routes."""

    def __init__(self, models: Any, settings: dict[str, Any], fallbacks: Any = None) -> None:
        """``models``: each model's Serve handle by name (one model: its handle alone);
        ``settings``: the config as plain data; ``fallbacks``: each fallback's handle by its
        model's name (one model: the handle). Serve's handles are typed Any here."""
        self._cfg = cfg = load_config(settings)
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        one = cfg.models[0].name  # a handle given alone is the one model's
        self._handles = models if isinstance(models, dict) else {one: models}
        fallbacks = fallbacks if isinstance(fallbacks, dict) else ({one: fallbacks} if fallbacks else {})
        self._key_table: Any = None  # the shared idempotency key table's handle, once needed
        self._openapi: dict[str, Any] | None = None  # built at the first GET /openapi.json
        keys = KeyStore.from_config(cfg)
        self.metrics = RouterMetrics()  # every per-model series is recorded with its model's tag
        self._link, self.snapshots, self._exchange = connect(
            cfg,
            "report_router",
            lambda: self.reporter.report(),
            on_snapshot=lambda snap: self.reporter.on_snapshot(snap),
            on_reply=lambda raw: self.reporter.on_reply(raw),
        )
        self.pipeline = Pipeline(
            cfg,
            keys,
            self.snapshots,
            build_lanes(cfg, self._handles, fallbacks, self.metrics, self._call_hooks),
            Quotas(cfg, self._routers, on_rate=lambda t, rate: self.metrics.tenant_rate.set(rate, tags={"tenant": t})),
            # Keys shared by every router (a retry through another node's endpoint gets the
            # first answer); the actor is looked up or created at the first keyed request.
            IdempotencyStore(cfg.resilience.idempotency, shared=SharedKeys(self._keys_handle, self.router_id)),
            self.metrics,
        )
        self.reporter = Reporter(cfg, self.router_id, self.pipeline, Edge.from_env() if cfg.http.edge else None, keys)
        self._native = NativeFront(self.pipeline, cfg.limits)
        self._openai = OpenAIFront(self.pipeline, cfg, created_s=int(time.time()))
        self._embeddings = EmbeddingsFront(self.pipeline, cfg)
        # The Batch API's store (none: batch off, or no batch.store_url; its routes answer 503)
        # and the loops that run its lines here; the online routes never touch it.
        self.store: BatchStore | None = None
        if cfg.batch.enabled and cfg.batch.store_url is not None:
            self.store = connect_store(
                cfg.batch,
                cfg.app_name,
                weights={t: c.weight for t, c in cfg.tenants.items()},
                responses=cfg.responses,
            )
        self._batches = BatchFront(self.pipeline, self._openai, self._embeddings, cfg, self.store)
        self._responses = ResponsesFront(self.pipeline, self._openai, cfg, self.store)
        self.dispatch: BatchDispatch | None = None
        if self.store is not None:
            self.dispatch = self._batch_dispatch(self.store)
        self._admin = Admin(
            cfg,
            keys,
            self._link,
            self._exchange,
            self.snapshots,
            self.pipeline,
            self.router_id,
            handle_for=lambda name: self._handles[name],  # each model's deployment, by its name
            serve_status=ServeStatusView(cfg.app_name),
            batches=self._batches,
            dispatch=self.dispatch,
        )
        # Health routes need no key: they answer from one model ping per interval at most.
        self.readiness = {
            name: CachedProbe(_ping(handle), cfg.http.ready_probe_interval_s) for name, handle in self._handles.items()
        }
        # http.admin_port: the admin routes on 127.0.0.1 alone (admin_port.py), not on the public port.
        self.admin_listener: AdminListener | None = None
        if cfg.http.admin_port is not None:
            self.admin_listener = AdminListener(admin_app(self._admin), cfg.http.admin_port)

    def _batch_dispatch(self, store: BatchStore) -> BatchDispatch:
        """A dispatcher per model (consumer: this router) and the finalizer, reporting to the metrics."""
        m = self.metrics
        hooks = BatchHooks(on_line=m.batch_line, on_depths=m.batch_depths)
        dispatchers = {
            name: ModelDispatcher(
                name,
                lane.gate,
                functools.partial(self.snapshots.heading, name),
                self._batches.run_line,
                store,
                self._cfg,
                self.router_id,
                hooks,
            )
            for name, lane in self.pipeline.lanes.items()
        }
        finalizer = Finalizer(store, list(self.pipeline.lanes), hooks)
        return BatchDispatch(dispatchers, finalizer, self._cfg.controller.report_interval_s)

    def _start(self) -> None:
        """What runs on the replica's event loop, started at the first call that has one."""
        self._exchange.start()
        if self.dispatch is not None:
            self.dispatch.start()
        if self.admin_listener is not None:
            self.admin_listener.start()

    def _public_admin(self) -> Admin:
        """The admin routes' handler on the public port; 404, as for an unknown route, when
        they are served on the admin port instead."""
        if self.admin_listener is not None:
            raise NotFound("no such route")
        return self._admin

    def _call_hooks(self, model: str) -> CallHooks:
        """What model ``model``'s resilient caller tells the metrics and the tally."""
        m = self.metrics
        return CallHooks(
            on_retry=lambda backend, kind: m.retries.inc(tags={"backend": backend, "kind": kind, "model": model}),
            on_fallback=lambda kind: m.fallbacks.inc(tags={"kind": kind}),
            on_breaker_event=lambda event: self._on_breaker_event(model, event),
            on_lost_capacity=lambda backend, outcome: self._on_lost_capacity(model, backend, outcome),
            on_hedge=lambda backend: m.hedges.inc(tags={"backend": backend, "model": model}),
        )

    def _routers(self) -> int:
        """Routers sharing each tenant's rate: the snapshot's count, else the configured one."""
        snap = self.snapshots.snapshot
        running = snap.running_replicas.get(ROUTER_DEPLOYMENT) if snap else None
        return running or self._cfg.deployments.router.num_replicas

    def _keys_handle(self) -> Any:
        if self._key_table is None:
            import ray

            from ballast.control.keys import keys_actor

            if not ray.is_initialized():  # a router object outside Ray (tests): keys stay per router
                raise RuntimeError("no Ray: the shared key table is unreachable")

            self._key_table = keys_actor(self._cfg)
        return self._key_table

    def _on_lost_capacity(self, model: str, backend: str, outcome: str) -> None:
        self.pipeline.lanes[model].tally.lost_capacity += 1
        self.metrics.lost.inc(tags={"backend": backend, "outcome": outcome, "model": model})

    def _on_breaker_event(self, model: str, event: BreakerEvent) -> None:
        tags = {"backend": event.backend, "model": model}
        self.metrics.breaker.set(int(event.to_state), tags=tags)
        if int(event.to_state) == 1:
            self.metrics.trips.inc(tags=tags)
        log.warning(
            "breaker %s of %s: %s -> %s (%s)",
            event.backend,
            model,
            event.from_state.name,
            event.to_state.name,
            event.reason,
        )

    async def check_health(self) -> None:
        self._start()

    # -- the model routes: each hands its request to its front ------------------------------
    @app.post("/v1/generate")
    async def generate(self, request: Request) -> Response:
        self._start()
        return await self._native.generate(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        self._start()
        return await self._openai.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        self._start()
        return await self._openai.complete(request, chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        self._start()
        return await self._embeddings.embed(request)

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> JSONResponse:
        return self._openai.models(request)

    # -- OpenAI's Responses API on the chat path (responses.py) -----------------------------
    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        self._start()
        return await self._responses.create(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request) -> JSONResponse:
        return await self._responses.retrieve(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> JSONResponse:
        return await self._responses.delete(request, response_id)

    # -- OpenAI's Batch API: files and batches (batches.py) ---------------------------------
    @app.post("/v1/files")
    async def upload_file(self, request: Request) -> JSONResponse:
        self._start()
        return await self._batches.upload_file(request)

    @app.get("/v1/files")
    async def list_files(self, request: Request) -> dict[str, Any]:
        return await self._batches.list_files(request)

    @app.get("/v1/files/{file_id}")
    async def get_file(self, file_id: str, request: Request) -> dict[str, Any]:
        return await self._batches.get_file(file_id, request)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(self, file_id: str, request: Request) -> dict[str, Any]:
        return await self._batches.delete_file(file_id, request)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(self, file_id: str, request: Request) -> Response:
        return await self._batches.file_content(file_id, request)

    @app.post("/v1/batches")
    async def create_batch(self, request: Request) -> dict[str, Any]:
        self._start()
        return await self._batches.create_batch(request)

    @app.get("/v1/batches")
    async def list_batches(self, request: Request) -> dict[str, Any]:
        return await self._batches.list_batches(request)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        return await self._batches.get_batch(batch_id, request)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        return await self._batches.cancel_batch(batch_id, request)

    # -- status and admin ----------------------------------------------------------------
    @app.get("/v1/status")
    async def status(self, request: Request) -> dict[str, Any]:
        return await self._public_admin().status(request)

    @app.post("/admin/kill-switch", status_code=201)
    async def set_kill_switch(self, request: Request) -> JSONResponse:
        return await self._public_admin().set_kill_switch(request)

    @app.get("/admin/kill-switch")
    async def list_kill_switches(self, request: Request) -> dict[str, Any]:
        return await self._public_admin().list_kill_switches(request)

    @app.delete("/admin/kill-switch/{entry_id}")
    async def delete_kill_switch(self, entry_id: str, request: Request) -> dict[str, Any]:
        return await self._public_admin().delete_kill_switch(entry_id, request)

    @app.post("/admin/adapters", status_code=201)
    async def add_adapter(self, request: Request) -> JSONResponse:
        """Add a LoRA adapter at run time: checked, loaded on one replica, then recorded."""
        return await self._public_admin().add_adapter(request)

    @app.get("/admin/adapters")
    async def list_adapters(self, request: Request) -> dict[str, Any]:
        return await self._public_admin().list_adapters(request)

    @app.delete("/admin/adapters/{name}")
    async def delete_adapter(self, name: str, request: Request) -> dict[str, Any]:
        return await self._public_admin().delete_adapter(name, request)

    @app.post("/admin/chaos")
    async def set_chaos(self, request: Request) -> dict[str, Any]:
        return await self._public_admin().set_chaos(request)

    @app.delete("/admin/chaos")
    async def clear_chaos(self, request: Request) -> dict[str, Any]:
        return await self._public_admin().clear_chaos(request)

    @app.get("/admin/batches")
    async def admin_batches(self, request: Request) -> dict[str, Any]:
        """Every tenant's batches, newest first."""
        return await self._public_admin().list_batches(request)

    @app.get("/admin/dlq")
    async def list_dlq(self, request: Request) -> dict[str, Any]:
        """The dead-lettered batch lines, oldest first, by model."""
        return await self._public_admin().list_dlq(request)

    @app.post("/admin/dlq/{dlq_id}/retry")
    async def retry_dlq(self, dlq_id: str, request: Request) -> dict[str, Any]:
        """A dead letter back on its model's queue, attempts from 0."""
        return await self._public_admin().retry_dlq(dlq_id, request)

    @app.delete("/admin/dlq/{dlq_id}")
    async def delete_dlq(self, dlq_id: str, request: Request) -> dict[str, Any]:
        """A dead letter removed; its line to its batch's error file."""
        return await self._public_admin().delete_dlq(dlq_id, request)

    @app.post("/admin/recycle", status_code=202)
    async def recycle(self, request: Request) -> JSONResponse:
        """Ask for replicas to be recycled: they go in turn, under the planner's rules."""
        return await self._public_admin().recycle(request)

    @app.get("/admin/replicas")
    async def replicas(self, request: Request) -> dict[str, Any]:
        """Every replica as its watchdog sees it, plus recycles in flight and recent events."""
        return await self._public_admin().replicas(request)

    # -- the contract and health ----------------------------------------------------------
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        if self._openapi is None:
            self._openapi = openapi_document(app.routes)
        return JSONResponse(self._openapi)

    @app.get("/docs", include_in_schema=False)
    async def docs(self) -> HTMLResponse:
        if not self._cfg.http.docs_page:
            raise NotFound("the docs page is off here (http.docs_page); the contract is at /openapi.json")
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Ballast API")

    @app.get("/healthz/live")
    async def live(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/healthz/ready")
    async def ready(self) -> JSONResponse:
        problems = await self._unready()
        if problems:
            return JSONResponse({"error": {"code": "NOT_READY", "message": "; ".join(problems)}}, status_code=503)
        levels = {name: self.snapshots.effective(name).level for name in self.pipeline.lanes}
        return JSONResponse({"status": "ready", "levels": levels})

    @app.get("/health")
    async def health(self) -> Response:
        """vLLM's readiness probe, which its tools call first: 200 and no body when ready."""
        problems = await self._unready()
        return Response(status_code=503 if problems else 200)

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": VERSION}

    async def _unready(self) -> list[str]:
        """Why this router cannot serve now: no model reachable (each model's cached probe,
        ``http.ready_probe_interval_s``; a router that reaches one model still serves it),
        the snapshot stale."""
        self._start()
        problems = []
        unreachable = [p for p in [await probe.problem() for probe in self.readiness.values()] if p is not None]
        if len(unreachable) == len(self.readiness):
            problems.extend(unreachable)
        if not self.snapshots.is_fresh():
            age = self.snapshots.age_s()
            problems.append("controller snapshot " + ("missing" if age is None else f"stale ({age:.1f}s old)"))
        return problems


def router_deployment(cfg: BallastConfig) -> Any:
    """The router's Serve deployment (Serve's ``Deployment``, typed Any at this boundary)."""
    r = cfg.deployments.router
    own: dict[str, Any] = {"num_replicas": r.num_replicas}
    if r.max_replicas_per_node is not None:
        own["max_replicas_per_node"] = r.max_replicas_per_node
    return serve.deployment(Router, **r.serve_options(ROUTER_DEPLOYMENT, cfg.http.access_log, **own))
