"""What a call to a model through the resilient caller (``ballast.router.resilience``) is,
what it tells the metrics, and what comes back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ballast.model.protocol import ModelCall, ModelChunk, ModelResult
from ballast.policies import killswitch
from ballast.policies.breaker import BreakerEvent


@dataclass(frozen=True)
class CallHooks:
    """Metrics hooks; the defaults do nothing (STYLE 8)."""

    on_retry: Callable[[str, str], None] = lambda backend, kind: None
    on_fallback: Callable[[str], None] = lambda kind: None
    on_breaker_event: Callable[[BreakerEvent], None] = lambda e: None
    # An attempt lost with its replica: (backend, "migrated" | "not_migrated").
    on_lost_capacity: Callable[[str, str], None] = lambda backend, outcome: None
    # A hedge sent: (backend).
    on_hedge: Callable[[str], None] = lambda backend: None


#: Hooks that do nothing: a caller's default.
NO_HOOKS = CallHooks()


@dataclass
class CallRecord:
    """What one call went through, for its answer: migrations after a lost replica."""

    migrations: int = 0


@dataclass(frozen=True)
class CallSpec:
    """One call as the router hands it to ``unary`` or ``stream``: the model call, its deadline
    (on the caller's clock), the kill switches in force and the wall time to read them at.
    ``fallback_only``: the primary is not to be asked (the level or the gate refused this
    request there); only the fallback model may answer. ``record`` is filled with what the
    call went through (its migrations). ``tenant``: whose call it is; the answer cache
    keeps and gives answers per tenant, and a call without one is neither cached nor
    answered from the cache. ``primary_only``: neither the fallback model nor the cache may
    answer (a batch line names its model and waits for it: its retry comes later, from the
    queue, rather than another model's answer now). ``hedge``: an attempt that shows no
    progress may be hedged on another replica (the router says so while the model's level
    sheds nothing)."""

    call: ModelCall
    deadline_s: float
    kill_switches: list[killswitch.KillSwitchEntry]
    now_wall_s: float
    fallback_only: bool = False
    record: CallRecord = field(default_factory=CallRecord)
    tenant: str | None = None
    primary_only: bool = False
    hedge: bool = False


# The fallback kinds an answer names (``X-Ballast-Fallback``): the fallback model, the cache.
FALLBACK_MODEL, CACHE = "fallback_model", "cache"


@dataclass(frozen=True)
class Reply:
    """A unary answer and who gave it: ``fallback`` (None: the primary; FALLBACK_MODEL;
    CACHE, an earlier answer of the primary's) and the model's name."""

    result: ModelResult
    fallback: str | None
    model: str


@dataclass(frozen=True)
class Opened:
    """An open stream's chunks and who gives them (as ``Reply``)."""

    chunks: AsyncIterator[ModelChunk]
    fallback: str | None
    model: str
