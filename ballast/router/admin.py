"""Admin and status routes: ``/v1/status`` and ``/admin/*`` (kill switches, LoRA adapters,
chaos, recycles, replicas, every tenant's batches, the batch dead-letter queue), all behind
the admin token (401 without a token, 403 with another).

The dead-letter routes act on the batch store (``GET /admin/dlq``, ``POST
/admin/dlq/{id}/retry``: the line back on its model's queue with its attempts from 0,
``DELETE /admin/dlq/{id}``: the line to its batch's error file); each action is then
written to the controller's audit trail as the kill switch's are (``operator_claimed``);
when the controller cannot be reached the action stands and its audit event is logged
here instead.

Each admin action is a call to the controller (never on the generate path), answered
422 when the controller refuses the input, with the controller's typed error where it
raises one (409 ``ADAPTER_CONFLICT``), and 503 when it cannot be reached. The operator an
action names (``X-Ballast-Operator``) is a claim: every holder of the one admin token may
name anyone, so the audit trail records it as ``operator_claimed``.
``Admin`` holds what those routes read: the controller link, the snapshot cache and
the pipeline's own status; the Router deployment (app.py) declares the routes.
"""

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ballast.batch import shapes
from ballast.errors import (
    AdapterConflict,
    AdapterInConfig,
    AdapterRefused,
    AdaptersDisabled,
    BallastError,
    ChaosDisabled,
    ControllerUnavailable,
    Forbidden,
    InvalidRequest,
    ModelUnavailable,
    NotFound,
    Unauthenticated,
)
from ballast.policies import adapters as adapter_rule
from ballast.policies import killswitch
from ballast.policies.adapters import EVERY_TENANT, MAX_PATH_CHARS, MAX_RUNTIME_ADAPTERS, MAX_TENANTS, RuntimeAdapter
from ballast.policies.catalog import MAX_NAME_CHARS
from ballast.router.adapters import runtime_catalog
from ballast.router.api import bearer_token, read_json, validate_body
from ballast.router.ingress import running_fast_path, running_ingress
from ballast.router.serve_status import ServeStatusView

log = logging.getLogger("ballast.router")

#: A kill switch's id is 12 hex characters; a longer one names none (404, never sent on).
MAX_ENTRY_ID_CHARS = 64


class KillSwitchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: str = Field(max_length=32)  # which ones exist: checked by the controller, 422 naming them
    value: str | None = Field(None, max_length=200)
    reason: str = Field(min_length=1, max_length=killswitch.MAX_REASON_CHARS)
    expires_in_s: int = Field(gt=0, le=killswitch.MAX_EXPIRES_IN_S)


class ChaosRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field(pattern="^(primary|fallback)$")
    error_ratio: float = Field(0.0, ge=0, le=1)
    latency_ms: int = Field(0, ge=0, le=600_000)
    hang: bool = False
    stall: bool = False
    step_delay_ms: int = Field(0, ge=0, le=10_000)  # before each decode step: a slow device
    leak_mb_per_s: float = Field(0.0, ge=0, le=1024)
    vram_leak_mb_per_s: float = Field(0.0, ge=0, le=1024)  # a GPU replica's device memory; nothing on CPU


class RecycleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replica_id: str | None = Field(None, min_length=1, max_length=200)
    # A model deployment of this config (checked by the handler): BallastModel[-<model>],
    # BallastFallbackModel[-<model>].
    deployment: str | None = Field(None, max_length=200, pattern="^(BallastModel|BallastFallbackModel)(-.+)?$")
    all: bool = False  # every replica of the deployment (or of every one), in turn


class AdapterRequest(BaseModel):
    """``POST /admin/adapters``: a LoRA adapter of a vLLM model, from a directory under
    ``adapters_root``, for the tenants it names (``["*"]`` or ``"*"``: every tenant the
    model admits; never implied)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)  # what requests name; checked by the catalog
    # Under adapters_root on every replica's node (a relative one: taken under it).
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    tenants: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=MAX_TENANTS, description='Who may use it; ["*"]: every tenant the model admits.'
    )

    @field_validator("tenants", mode="before")
    @classmethod
    def _every_tenant(cls, v: Any) -> Any:
        return [EVERY_TENANT] if v == EVERY_TENANT else v


#: How long the trial load on one replica may take (vLLM reads, checks and copies it in).
ADAPTER_TRIAL_LOAD_S = 150.0


class Admin:
    """``/v1/status`` and ``/admin/*``: every handler checks the admin token first."""

    def __init__(
        self,
        cfg: Any,
        keys: Any,
        link: Any,
        exchange: Any,
        cache: Any,
        pipeline: Any,
        router_id: str,
        handle_for: Callable[[str], Any],
        serve_status: ServeStatusView | None = None,
        batches: Any = None,
        dispatch: Any = None,
    ) -> None:
        self._cfg = cfg
        self._batches = batches  # router/batches.py's BatchFront: the store (None: no batch routes' store)
        self._dispatch = dispatch  # router/dispatcher.py's BatchDispatch (None: no store here)
        self._limits = cfg.limits
        self._keys = keys
        self._link = link  # calls to the controller
        self._exchange = exchange  # the snapshot exchange: a change is fetched at once
        self._cache = cache
        self._pipeline = pipeline
        self._router_id = router_id
        self._handle_for = handle_for  # model name -> its deployment's handle (the adapters' trial load)
        self._serve_status = serve_status  # Serve's word on each deployment (a replica it cannot place yet)

    async def status(self, request: Request) -> dict[str, Any]:
        """``GET /v1/status``. Per model, in two maps keyed alike by model: ``snapshot.models``,
        the controller's state of each (``ModelState``: level, target, reason, inputs, ...),
        and ``models``, each as this router acts on it (level, source, constraints, breakers,
        retry budget, lost capacity, gate). Nothing about a model at the top level."""
        self._require_admin(request)
        snap = self._cache.snapshot
        return {
            "router_id": self._router_id,
            "ingress": running_ingress(),
            "fast_path": running_fast_path(),
            "snapshot": None
            if snap is None
            else {
                "epoch": snap.epoch,
                "version": snap.version,
                "age_s": round(self._cache.age_s() or 0.0, 3),
                "models": {name: state.to_dict() for name, state in snap.models.items()},
            },
            "replicas": self._replicas(snap),
            **self._pipeline.status(),
            "batch": self._dispatch.status() if self._dispatch is not None else None,
            "chaos": snap.chaos if snap else {},
            "recycle": snap.recycle if snap else {},
            **await self._deployments(),
        }

    async def _deployments(self) -> dict[str, Any]:
        """``{"deployments": ...}``: Serve's status of each deployment (``ServeStatusView``);
        nothing when it could not be read."""
        got = await self._serve_status.get() if self._serve_status is not None else None
        return {"deployments": got} if got is not None else {}

    @staticmethod
    def _replicas(snap: Any) -> dict[str, Any]:
        if snap is None:
            return {}
        return {
            dep: {
                "desired": snap.desired_replicas.get(dep),
                "running": snap.running_replicas.get(dep),
                **({"autoscale": snap.autoscale[dep]} if dep in snap.autoscale else {}),
            }
            for dep in sorted(set(snap.desired_replicas) | set(snap.running_replicas))
        }

    # -- admin: kill switch and chaos ------------------------------------------------
    def _operator(self, request: Request) -> str:
        """The operator the call claims to act for (``X-Ballast-Operator``, unverified); ""
        when it names none."""
        return (request.headers.get("x-ballast-operator") or "")[:64]

    async def set_kill_switch(self, request: Request) -> JSONResponse:
        self._require_admin(request)
        body = validate_body(KillSwitchRequest, await self._read_json(request))
        entry = await self._controller(
            "set_kill_switch", body.scope, body.value, body.reason, body.expires_in_s, self._operator(request)
        )
        await self._exchange.exchange_once()  # this router enforces it at once
        return JSONResponse(entry, status_code=201)

    async def list_kill_switches(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        switches: dict[str, Any] = await self._controller("kill_switches")  # the entries and the audit trail
        return switches

    async def delete_kill_switch(self, entry_id: str, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        if len(entry_id) > MAX_ENTRY_ID_CHARS or not await self._controller(
            "delete_kill_switch", entry_id, self._operator(request)
        ):
            raise NotFound(f"no active kill switch {entry_id!r}")
        await self._exchange.exchange_once()
        return {"deleted": entry_id}

    async def set_chaos(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        if not self._cfg.chaos.enabled:
            raise ChaosDisabled("chaos hooks are disabled in this deployment's config (chaos.enabled)")
        body = validate_body(ChaosRequest, await self._read_json(request))
        settings = body.model_dump(exclude={"target"})
        chaos = await self._controller("set_chaos", body.target, settings, self._operator(request))
        return {"chaos": chaos}

    async def recycle(self, request: Request) -> JSONResponse:
        """Ask for replicas to be recycled: they go in turn, under the planner's rules."""
        self._require_admin(request)
        body = validate_body(RecycleRequest, await self._read_json(request))
        served = self._model_deployments()
        if body.deployment is not None and body.deployment not in served:
            raise InvalidRequest(f"deployment: not one of {', '.join(served)}", field="deployment")
        if body.replica_id is None and not body.all:
            raise InvalidRequest("name a replica_id, or set all: true", field="replica_id")
        marked = await self._controller(
            "request_recycle", body.replica_id, body.deployment, body.all, self._operator(request)
        )
        return JSONResponse({"accepted": marked}, status_code=202)

    def _model_deployments(self) -> list[str]:
        """Every model's deployment and its fallback's, in the config's order."""
        out = []
        for m in self._cfg.models:
            out.append(self._cfg.deployment_name(m.name))
            if self._cfg.fallback_of(m.name) is not None:
                out.append(self._cfg.fallback_deployment_name(m.name))
        return out

    async def replicas(self, request: Request) -> dict[str, Any]:
        """Every replica as its watchdog sees it, plus recycles in flight and recent events."""
        self._require_admin(request)
        status: dict[str, Any] = await self._controller("replica_status")
        return status

    async def clear_chaos(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        if not self._cfg.chaos.enabled:
            raise ChaosDisabled("chaos hooks are disabled in this deployment's config (chaos.enabled)")
        await self._controller("clear_chaos", self._operator(request))
        return {"chaos": {}}

    # -- admin: LoRA adapters added at run time ----------------------------------------
    async def add_adapter(self, request: Request) -> JSONResponse:
        """Add a LoRA adapter, a step at a time, the first refusal answering and nothing
        recorded: run-time adapters on (``adapters_root``: else 409 ADAPTERS_DISABLED); the
        body; the name free among the snapshot's run-time adapters (409 ADAPTER_CONFLICT)
        and ``adapter_rule.check`` against the config's catalog with them (400
        ADAPTER_REFUSED naming the field); the controller reserves the name (409 while
        another add of it runs); a trial load on one replica of the model, which checks
        the directory on its node; then the controller's record, which ends the
        reservation (every replica loads it from the next snapshot). A trial load that
        fails gives the name back."""
        self._require_admin(request)
        if self._cfg.adapters_root is None:
            raise AdaptersDisabled("adapters may not be added at run time here: the config sets no adapters_root")
        body = validate_body(AdapterRequest, await self._read_json(request))
        self._check_adapter(body)
        await self._refused_as_adapter(body, "reserve_adapter", body.model, body.name, body.path, body.tenants)
        try:
            await self._trial_load(body.model, body.name, body.path)
        except Exception:
            await self._release(body.name, body.path)
            raise
        entry = await self._refused_as_adapter(
            body, "set_adapter", body.model, body.name, body.path, body.tenants, self._operator(request)
        )
        await self._exchange.exchange_once()  # this router routes to it at once
        return JSONResponse(entry, status_code=201)

    def _check_adapter(self, body: AdapterRequest) -> None:
        """What this router can check without the node: the name not a run-time adapter's
        already (409), ``adapter_rule.check`` (400 ADAPTER_REFUSED naming the field: the
        path under ``adapters_root`` by its text, then the catalog's model, name, tenants),
        and the run-time table's bound."""
        snap = self._cache.snapshot
        running = list(snap.adapters) if snap is not None else []
        if body.name in {a.get("name") for a in running if isinstance(a, dict)}:
            raise AdapterConflict(f"name: {body.name!r} is an adapter added at run time; delete it first")
        try:
            entry = RuntimeAdapter.create(body.model, body.name, body.path, body.tenants, 0.0, "")
            adapter_rule.check(runtime_catalog(self._pipeline.base_catalog, running), entry, self._cfg.adapters_root)
        except (TypeError, ValueError) as e:  # CatalogError is one: "field: reason"
            raise AdapterRefused(body.name, body.path, str(e), field=str(e).split(":", 1)[0]) from None
        if len(running) >= MAX_RUNTIME_ADAPTERS:
            raise AdapterRefused(
                body.name, body.path, f"name: at most {MAX_RUNTIME_ADAPTERS} adapters may be added at run time", "name"
            )

    async def _refused_as_adapter(self, body: AdapterRequest, method: str, *args: Any) -> Any:
        """A controller call of the add: its refusal of the input (the state moved since
        this router's snapshot) is 400 ADAPTER_REFUSED naming the field; a conflict stays 409."""
        try:
            return await self._controller(method, *args)
        except InvalidRequest as e:
            raise AdapterRefused(body.name, body.path, e.message, e.field) from None

    async def _release(self, name: str, path: str) -> None:
        """Give the name back after a failed trial load; when the controller cannot be
        reached, its reservation expires on its own."""
        try:
            await self._controller("release_adapter", name, path)
        except BallastError:
            pass

    async def _trial_load(self, model: str, name: str, path: str) -> None:
        """Load the adapter on one replica of ``model`` now: vLLM's refusal of the directory is
        this call's 400 ADAPTER_REFUSED, never a request's. The replica keeps it; the others
        load it from the snapshot once the controller lists it."""
        try:
            await asyncio.wait_for(self._handle_for(model).add_adapter.remote(name, path), ADAPTER_TRIAL_LOAD_S)
        except AdapterRefused as e:  # Ray re-raises the replica's error as a subclass of it
            raise AdapterRefused(e.name, e.path, e.reason, e.field) from None
        except Exception as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, AdapterRefused):
                raise AdapterRefused(cause.name, cause.path, cause.reason, cause.field) from None
            raise ModelUnavailable(
                f"model {model!r}: no replica could try the adapter ({type(e).__name__})", retry_after_s=5.0
            ) from None

    async def list_adapters(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        return {"adapters": await self._controller("adapters")}

    async def delete_adapter(self, name: str, request: Request) -> dict[str, Any]:
        """Remove a run-time adapter (every replica unloads it from the next snapshot); 409 for
        one the config declares, 404 when no run-time adapter has that name."""
        self._require_admin(request)
        snap = self._cache.snapshot
        running = {a.get("name") for a in snap.adapters if isinstance(a, dict)} if snap is not None else set()
        target = self._pipeline.base_catalog.resolve(name) if len(name) <= MAX_NAME_CHARS else None
        if target is not None and target.adapter == name and name not in running:
            raise AdapterInConfig(
                f"adapter {name!r} is declared in the config (models[].adapters); remove it from the config "
                "and redeploy"
            )
        if len(name) > MAX_NAME_CHARS or not await self._controller("delete_adapter", name, self._operator(request)):
            raise NotFound(f"no adapter {name!r} was added at run time")
        await self._exchange.exchange_once()
        return {"deleted": name}

    # -- admin: batches and the dead-letter queue --------------------------------------
    async def list_batches(self, request: Request) -> dict[str, Any]:
        """``GET /admin/batches``: every tenant's batches, newest first (``limit``, ``after``),
        each with its ``tenant``."""
        self._require_admin(request)
        limit, after = _admin_paging(request)
        page = await self._batches.store().list_batches(None, limit, after)
        data = [{**shapes.batch_object(b.to_dict()), "tenant": b.tenant} for b in page.items]
        return shapes.list_page(data, page.has_more)

    async def list_dlq(self, request: Request) -> dict[str, Any]:
        """``GET /admin/dlq``: dead letters oldest first, of ``model`` or of every model."""
        self._require_admin(request)
        limit, after = _admin_paging(request)
        model = request.query_params.get("model")
        if model is not None and model not in self._pipeline.lanes:
            raise InvalidRequest(f"model: one of {', '.join(self._pipeline.lanes)}", field="model")
        page = await self._batches.store().dlq_list(model, limit, after)
        return {"object": "list", "data": [d.to_dict() for d in page.items], "has_more": page.has_more}

    async def retry_dlq(self, dlq_id: str, request: Request) -> dict[str, Any]:
        """``POST /admin/dlq/{id}/retry``: the line back on its model's queue (attempts 0)."""
        self._require_admin(request)
        store = self._batches.store()
        dead = await store.dlq_get(dlq_id) if len(dlq_id) <= MAX_ENTRY_ID_CHARS else None
        if dead is None or await store.dlq_retry(dlq_id) is None:
            raise NotFound(f"no dead letter {dlq_id[:MAX_ENTRY_ID_CHARS]!r}")
        self._pipeline.metrics.dlq_reprocessed.inc(tags={"model": dead.model})
        await self._audit_dlq("dlq_retry", request, dead.to_dict())
        return {"retried": dlq_id, "model": dead.model}

    async def delete_dlq(self, dlq_id: str, request: Request) -> dict[str, Any]:
        """``DELETE /admin/dlq/{id}``: the dead letter gone, its line in its batch's error file."""
        self._require_admin(request)
        store = self._batches.store()
        dead = await store.dlq_get(dlq_id) if len(dlq_id) <= MAX_ENTRY_ID_CHARS else None
        if dead is None:
            raise NotFound(f"no dead letter {dlq_id[:MAX_ENTRY_ID_CHARS]!r}")
        line = shapes.error_line(
            shapes.new_line_id(),
            dead.line.custom_id,
            "dead_lettered",
            f"The request failed {dead.line.attempts} times and was removed from the dead-letter queue "
            f"by an operator; its last error: {dead.last_error}",
        )
        if not await store.dlq_delete(dlq_id, json.dumps(line, separators=(",", ":"))):
            raise NotFound(f"no dead letter {dlq_id[:MAX_ENTRY_ID_CHARS]!r}")
        await self._audit_dlq("dlq_delete", request, dead.to_dict())
        return {"deleted": dlq_id, "model": dead.model}

    async def _audit_dlq(self, action: str, request: Request, dead_letter: dict[str, Any]) -> None:
        """The action in the controller's audit trail; logged here when it cannot be reached."""
        operator = self._operator(request)
        try:
            await self._controller("audit_dlq", action, operator, dead_letter)
        except BallastError:
            event = {"action": action, "operator_claimed": operator or None, "dead_letter": dead_letter}
            log.warning("ballast.audit (controller unreachable) %s", json.dumps(event, sort_keys=True))

    # -- helpers ---------------------------------------------------------------------
    def _require_admin(self, request: Request) -> None:
        token = bearer_token(request)
        if token is None:
            raise Unauthenticated("missing 'Authorization: Bearer <admin token>' header")
        if not self._keys.is_admin(token):
            raise Forbidden("this route needs the admin token")

    async def _read_json(self, request: Request) -> Any:
        return await read_json(request, self._limits)

    async def _controller(self, method: str, *args: Any) -> Any:
        """An admin call to the controller (never on the generate path)."""
        try:
            return await asyncio.wait_for(self._link.call(method, *args), timeout=5.0)
        except ValueError as e:  # the controller refused the input
            msg = str(e.args[0] if e.args else e)
            raise InvalidRequest(msg, field=msg.split(":", 1)[0]) from None
        except Exception as e:
            cause = getattr(e, "cause", None) or e  # Ray's RayTaskError carries the actor's error
            if isinstance(cause, BallastError):  # a typed refusal (AdapterConflict): its own status
                raise cause from None
            if isinstance(cause, ValueError):
                msg = str(cause.args[0] if cause.args else cause)
                raise InvalidRequest(msg, field=msg.split(":", 1)[0]) from None
            raise ControllerUnavailable(f"controller unreachable: {type(e).__name__}", retry_after_s=2.0) from None


def _admin_paging(request: Request) -> tuple[int, str | None]:
    """An admin list's ``limit`` (1 to 100, default 20) and ``after`` cursor (422 naming them)."""
    raw = request.query_params.get("limit", "20")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 3 and 1 <= int(raw) <= 100):
        raise InvalidRequest("limit: an integer from 1 to 100", field="limit")
    after = request.query_params.get("after")
    if after is not None and not 0 < len(after) <= MAX_ENTRY_ID_CHARS:
        raise InvalidRequest(f"after: an id of 1 to {MAX_ENTRY_ID_CHARS} characters", field="after")
    return int(raw), after
