"""Admin and status routes: ``/v1/status`` and ``/admin/*`` (kill switches, chaos,
recycles, replicas), all behind the admin token (401 without a token, 403 with another).

Each admin action is a call to the controller (never on the generate path), answered
422 when the controller refuses the input and 503 when it cannot be reached.
``Admin`` holds what those routes read: the controller link, the snapshot cache and
the pipeline's own status; the Router deployment (app.py) declares the routes.
"""

import asyncio
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ballast.policies import killswitch

from ballast.errors import (
    ChaosDisabled,
    ControllerUnavailable,
    Forbidden,
    InvalidRequest,
    NotFound,
    Unauthenticated,
)
from ballast.router.api import bearer_token, read_json, validate_body
from ballast.router.ingress import running_fast_path, running_ingress


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
    deployment: Optional[str] = Field(None, pattern="^(BallastModel|BallastFallbackModel)$")
    all: bool = False  # every replica of the deployment (or of both), in turn


class Admin:
    """``/v1/status`` and ``/admin/*``: every handler checks the admin token first."""

    def __init__(
        self, cfg: Any, keys: Any, link: Any, exchange: Any, cache: Any, pipeline: Any, router_id: str
    ) -> None:
        self._cfg = cfg
        self._limits = cfg.limits
        self._keys = keys
        self._link = link  # calls to the controller
        self._exchange = exchange  # the snapshot exchange: a change is fetched at once
        self._cache = cache
        self._pipeline = pipeline
        self._router_id = router_id

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
        }

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
        if body.replica_id is None and not body.all:
            raise InvalidRequest("name a replica_id, or set all: true", field="replica_id")
        marked = await self._controller(
            "request_recycle", body.replica_id, body.deployment, body.all, self._operator(request)
        )
        return JSONResponse({"accepted": marked}, status_code=202)

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
