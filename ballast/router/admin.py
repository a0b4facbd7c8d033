"""Admin and status routes: ``/v1/status`` and ``/admin/*`` (kill switches, LoRA adapters,
chaos, recycles, replicas), all behind the admin token (401 without a token, 403 with another).

Each admin action is a call to the controller (never on the generate path), answered
422 when the controller refuses the input and 503 when it cannot be reached.
``Admin`` holds what those routes read: the controller link, the snapshot cache and
the pipeline's own status; the Router deployment (app.py) declares the routes.
"""

import asyncio
from typing import Annotated, Any, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ballast.policies import killswitch
from ballast.policies.adapters import MAX_PATH_CHARS, MAX_RUNTIME_ADAPTERS, MAX_TENANTS
from ballast.policies.catalog import MAX_NAME_CHARS, CatalogError

from ballast.errors import (
    AdapterInConfig,
    AdapterRefused,
    ChaosDisabled,
    ControllerUnavailable,
    Forbidden,
    InvalidRequest,
    ModelUnavailable,
    NotFound,
    Unauthenticated,
)
from ballast.router.adapters import runtime_catalog
from ballast.router.api import bearer_token, read_json, validate_body
from ballast.router.ingress import running_fast_path, running_ingress
from ballast.router.serve_status import ServeStatusView


#: A kill switch's id is 12 hex characters; a longer one names none (404, never sent on).
MAX_ENTRY_ID_CHARS = 64


class KillSwitchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: str = Field(max_length=32)  # which ones exist: checked by the controller, 422 naming them
    value: Optional[str] = Field(None, max_length=200)
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

    replica_id: Optional[str] = Field(None, min_length=1, max_length=200)
    # A model deployment of this config (checked by the handler): BallastModel[-<model>],
    # BallastFallbackModel[-<model>].
    deployment: Optional[str] = Field(None, max_length=200, pattern="^(BallastModel|BallastFallbackModel)(-.+)?$")
    all: bool = False  # every replica of the deployment (or of every one), in turn


class AdapterRequest(BaseModel):
    """``POST /admin/adapters``: a LoRA adapter of a vLLM model, from a local directory."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)  # what requests name; checked by the catalog
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)  # a directory on every replica's node
    tenants: Optional[list[Annotated[str, Field(max_length=64)]]] = Field(None, max_length=MAX_TENANTS)


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
        serve_status: Optional[ServeStatusView] = None,
    ) -> None:
        self._cfg = cfg
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
        self._require_admin(request)
        eff = self._cache.effective()
        snap = self._cache.snapshot
        return {
            "level": eff.level,
            "source": eff.source,
            "constraints": eff.constraints.to_dict(),
            "snapshot": None
            if snap is None
            else {
                "epoch": snap.epoch,
                "version": snap.version,
                "age_s": round(self._cache.age_s() or 0.0, 3),
                "target_level": snap.target_level,
                "reason": snap.reason,
                "inputs": snap.inputs,
                "models": snap.models,  # each model's level, reason and inputs
            },
            "replicas": self._replicas(snap),
            "router_id": self._router_id,
            "ingress": running_ingress(),
            "fast_path": running_fast_path(),
            **self._pipeline.status(),
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
        return (request.headers.get("x-ballast-operator") or "admin")[:64]

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
        return await self._controller("kill_switches")

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
        return await self._controller("replica_status")

    async def clear_chaos(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        if not self._cfg.chaos.enabled:
            raise ChaosDisabled("chaos hooks are disabled in this deployment's config (chaos.enabled)")
        await self._controller("clear_chaos", self._operator(request))
        return {"chaos": {}}

    # -- admin: LoRA adapters added at run time ----------------------------------------
    async def add_adapter(self, request: Request) -> JSONResponse:
        """Add a LoRA adapter: the body, then the catalog's checks (the model, the name, the
        tenants) against the config's catalog with the snapshot's run-time adapters, then a
        trial load on one replica of the model, and only then the controller's record (every
        replica loads it from the next snapshot). A refusal at any step records nothing."""
        self._require_admin(request)
        body = validate_body(AdapterRequest, await self._read_json(request))
        self._check_adapter(body)
        await self._trial_load(body.model, body.name, body.path)
        try:
            entry = await self._controller(
                "set_adapter", body.model, body.name, body.path, body.tenants, self._operator(request)
            )
        except InvalidRequest as e:  # another router added the name since this one's snapshot
            raise AdapterRefused(body.name, body.path, e.message, e.field) from None
        await self._exchange.exchange_once()  # this router routes to it at once
        return JSONResponse(entry, status_code=201)

    def _check_adapter(self, body: AdapterRequest) -> None:
        """The catalog's checks, in its order (model, name, path, tenants): 400 ADAPTER_REFUSED
        naming the field; and the run-time table's bound."""
        snap = self._cache.snapshot
        running = list(snap.adapters) if snap is not None else []
        try:
            runtime_catalog(self._pipeline.base_catalog, running).with_adapter(
                body.model, body.name, body.path, body.tenants
            )
        except CatalogError as e:
            raise AdapterRefused(body.name, body.path, str(e), field=e.field) from None
        if len(running) >= MAX_RUNTIME_ADAPTERS:
            raise AdapterRefused(
                body.name, body.path, f"name: at most {MAX_RUNTIME_ADAPTERS} adapters may be added at run time", "name"
            )

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
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):
                msg = str(cause.args[0] if cause.args else cause)
                raise InvalidRequest(msg, field=msg.split(":", 1)[0]) from None
            raise ControllerUnavailable(f"controller unreachable: {type(e).__name__}", retry_after_s=2.0) from None
