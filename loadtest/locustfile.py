"""Locust load for Ballast: tenants, a criticality mix, plain and streaming requests, validated.

Run (a local stack from ``make serve``)::

    .venv/bin/locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 20 -r 5 -t 5m
    BALLAST_SHAPE=diurnal BALLAST_TIME_SCALE=96 BALLAST_PEAK_USERS=40 BALLAST_FAULTS=soak \\
        .venv/bin/locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000

Users: one class per tenant (``TENANTS``: gold, free; keys from ``$BALLAST_KEY_GOLD``
/ ``$BALLAST_KEY_FREE``, defaulting to the local demo keys), each request drawing
its criticality from the tenant's mix and streaming with the tenant's
``stream_ratio``. All of it is data at the top of this file.

Outcomes (``classify_unary`` / ``classify_stream``, pure functions of status,
headers and body, so they are unit-tested without Locust):

* ok — a 200 whose body is a JSON object with a string ``text`` and an integer
  ``tokens_generated``; for a stream, ``event: token`` events with ``text`` and
  ``tokens``, then one ``event: done`` whose ``tokens_generated`` is the sum of the
  tokens, and nothing after it.
* shed — an expected refusal: 429 ``QUOTA_EXCEEDED`` / ``CONCURRENCY_LIMIT``, 503
  ``OVERLOADED`` / ``KILL_SWITCH`` / ``MODEL_UNAVAILABLE`` (the code in the body and
  the status must agree), or, inside a stream, an ``error`` event with one of those
  codes before any token. Locust counts it as a success under its own name,
  ``"<tenant> <plain|stream> shed:<CODE>"``, so the stats CSV counts sheds by tenant,
  kind and reason; ``SHEDS`` also counts them by criticality (logged at the end,
  and written to ``$BALLAST_REPORT_JSON`` when set).
* failure — everything else: a 200 that is empty, not JSON, or missing fields, a
  stream without a ``done`` event, 4xx (401 included), 500, 504, a 503 without a
  documented code (e.g. Serve's own backpressure), a timeout, no answer. Counted
  under ``"<tenant> <plain|stream>"`` with the reason as the error.

Shape (``BallastShape``, from ``loadtest/shapes.py``): ``$BALLAST_SHAPE`` =
``diurnal`` (one simulated day, ``$BALLAST_TIME_SCALE`` simulated seconds per real
second, default 96 = 15 minutes, peak ``$BALLAST_PEAK_USERS``; it stops by itself at
the end of the day) or ``step`` (``shapes.step_burst``, real durations). Unset: no
shape, Locust's ``-u/-r/-t`` decide (a constant-user run).

Faults (``$BALLAST_FAULTS=soak``): ``faults.DEFAULT_SOAK`` played through the admin
and chaos APIs on the same time scale, from test start to test stop (local or
master runner only), loopback hosts only, whatever ``$BALLAST_ALLOW_REMOTE`` says.

Safety: a host that is not loopback is refused at start unless
``$BALLAST_ALLOW_REMOTE=1``.

Other settings: ``$BALLAST_HOST`` (the default host when ``--host`` is not given,
``http://127.0.0.1:8000``), ``$BALLAST_NETWORK_TIMEOUT_S`` (per-read timeout, 90 s:
above the server's 30 s default deadline, so a request it gave up on reads as its 504).

Counters (``SHEDS``) are per process: in distributed mode each worker counts its
own; the Locust stats (names above) are aggregated by the master as usual.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ballast.client import CRITICALITIES, GENERATE_PATH, SSEDecoder
from loadtest.faults import DEFAULT_SOAK, FaultRunner, FaultSchedule, is_loopback_host
from loadtest.shapes import DiurnalShape, StepShape, TimeScale, step_burst

log = logging.getLogger("ballast.loadtest")

DEFAULT_HOST = "http://127.0.0.1:8000"
#: The documented refusals (README "HTTP API") and the status each must come with.
EXPECTED_REFUSALS: Mapping[str, int] = {
    "QUOTA_EXCEEDED": 429,
    "CONCURRENCY_LIMIT": 429,
    "OVERLOADED": 503,
    "KILL_SWITCH": 503,
    "MODEL_UNAVAILABLE": 503,
}
#: A stream body is read whole (a generation is a few KB); beyond this it is read and dropped.
MAX_STREAM_BYTES = 1 << 20
WAIT_RANGE_S = (0.2, 1.0)
PROMPTS = (
    "Hello",
    "Summarise the incident report in one line.",
    "Write a haiku about back-pressure.",
    "List three reasons a queue grows without bound.",
    "Translate 'load shedding' into plain words.",
)


# =========================================================================== tenants (data)


@dataclass(frozen=True)
class TenantProfile:
    """One tenant's users: its key, its share of users, what its requests look like."""

    name: str
    key_env: str
    default_key: str
    user_weight: int
    #: (criticality, weight) pairs; a claim above the tenant's max_criticality is lowered by the server.
    criticality_weights: tuple[tuple[str, float], ...]
    stream_ratio: float
    max_tokens_range: tuple[int, int]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must be non-empty")
        if not isinstance(self.user_weight, int) or self.user_weight < 1:
            raise ValueError(f"user_weight: must be an integer >= 1, got {self.user_weight!r}")
        if not self.criticality_weights:
            raise ValueError("criticality_weights: need at least one (criticality, weight)")
        for crit, weight in self.criticality_weights:
            if crit not in CRITICALITIES:
                raise ValueError(f"criticality_weights: unknown criticality {crit!r} (one of {CRITICALITIES})")
            if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
                raise ValueError(f"criticality_weights: weight of {crit!r} must be >= 0, got {weight!r}")
        if sum(w for _, w in self.criticality_weights) <= 0:
            raise ValueError("criticality_weights: weights must sum to > 0")
        if not isinstance(self.stream_ratio, (int, float)) or not 0 <= self.stream_ratio <= 1:
            raise ValueError(f"stream_ratio: must be within [0, 1], got {self.stream_ratio!r}")
        lo, hi = self.max_tokens_range
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"max_tokens_range: must be 1 <= lo <= hi integers, got {self.max_tokens_range!r}")

    def api_key(self, env: Mapping[str, str]) -> str:
        return env.get(self.key_env) or self.default_key

    def pick_criticality(self, rng: random.Random) -> str:
        crits = [c for c, _ in self.criticality_weights]
        weights = [w for _, w in self.criticality_weights]
        return rng.choices(crits, weights=weights, k=1)[0]


TENANTS: tuple[TenantProfile, ...] = (
    TenantProfile(
        name="gold",
        key_env="BALLAST_KEY_GOLD",
        default_key="dev-key-gold",
        user_weight=3,
        criticality_weights=(
            ("critical_plus", 0.10),
            ("critical", 0.60),
            ("sheddable_plus", 0.20),
            ("sheddable", 0.10),
        ),
        stream_ratio=0.3,
        max_tokens_range=(8, 32),
    ),
    TenantProfile(
        name="free",
        key_env="BALLAST_KEY_FREE",
        default_key="dev-key-free",
        user_weight=1,
        # "critical" is above free's max_criticality: the server lowers it (and says so).
        criticality_weights=(("critical", 0.10), ("sheddable_plus", 0.50), ("sheddable", 0.40)),
        stream_ratio=0.3,
        max_tokens_range=(8, 32),
    ),
)


# =========================================================================== validation (pure)


@dataclass(frozen=True)
class Outcome:
    """``kind``: "ok", "shed" (an expected refusal; ``code`` says which) or "fail" (``detail`` says why)."""

    kind: str
    code: str | None = None
    detail: str = ""


OK = Outcome("ok")


def _fail(detail: str, code: str | None = None) -> Outcome:
    return Outcome("fail", code, detail[:300])


def _lower_keys(headers: Mapping[str, Any] | None) -> dict[str, str]:
    if not headers:
        return {}
    return {str(k).lower(): str(v) for k, v in headers.items()}


def _error_of(payload: object) -> tuple[str | None, str]:
    """``(code, message)`` of ``{"error": {"code", "message"}}``; ``(None, "")`` when not that shape."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        err = payload["error"]
        code = err.get("code") if isinstance(err.get("code"), str) else None
        message = err.get("message") if isinstance(err.get("message"), str) else ""
        return code, message
    return None, ""


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def classify_error_answer(status: int, body: bytes) -> Outcome:
    """A non-200 answer: an expected refusal (shed) or a failure."""
    if not status:
        return _fail("no answer (connection error or timeout)")
    try:
        payload = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        payload = None
    code, message = _error_of(payload)
    if code is not None and EXPECTED_REFUSALS.get(code) == status:
        return Outcome("shed", code)
    what = code or "without a documented error code"
    return _fail(f"{status} {what}: {message or body[:120]!r}", code)


def classify_unary(status: int, headers: Mapping[str, Any] | None, body: bytes | None) -> Outcome:
    """A ``POST /v1/generate`` answer (``stream: false``)."""
    body = body or b""
    if status != 200:
        return classify_error_answer(status, body)
    if not body.strip():
        return _fail("200 with an empty body")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _fail("200 with a body that is not JSON")
    if not isinstance(payload, dict):
        return _fail("200 with a JSON body that is not an object")
    if not isinstance(payload.get("text"), str):
        return _fail("200 without a string 'text'")
    if not _is_count(payload.get("tokens_generated")):
        return _fail("200 without an integer 'tokens_generated'")
    return OK


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def classify_stream(status: int, headers: Mapping[str, Any] | None, body: bytes | None) -> Outcome:
    """A ``POST /v1/generate`` answer with ``stream: true``: server-sent events when 200.

    Events are parsed with the SDK's ``SSEDecoder``; an event is complete only at its
    blank line, so a stream cut after ``data:`` of ``done`` has no done event.
    """
    body = body or b""
    if status != 200:
        return classify_error_answer(status, body)
    content_type = _lower_keys(headers).get("content-type", "")
    if not content_type.startswith("text/event-stream"):
        return _fail(f"200 stream with content-type {content_type!r}, not text/event-stream")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return _fail("stream is not UTF-8")
    decoder = SSEDecoder()
    tokens = 0
    token_events = 0
    done: dict[str, Any] | None = None
    # The piece after the last line break is not a line (a cut stream ends mid-line): dropped.
    for line in _LINE_BREAK.split(text)[:-1]:
        event = decoder.feed(line)
        if event is None:
            continue
        name, data = event
        if done is not None:
            return _fail(f"event {name!r} after done")
        try:
            payload = json.loads(data) if data else None
        except ValueError:
            return _fail(f"malformed {name!r} event: {data[:120]!r}")
        if name == "token":
            if (
                not isinstance(payload, dict)
                or not isinstance(payload.get("text"), str)
                or not _is_count(payload.get("tokens"))
            ):
                return _fail(f"token event without text/tokens: {data[:120]!r}")
            tokens += payload["tokens"]
            token_events += 1
        elif name == "done":
            if not isinstance(payload, dict) or not _is_count(payload.get("tokens_generated")):
                return _fail(f"done event without an integer tokens_generated: {data[:120]!r}")
            done = payload
        elif name == "error":
            code, message = _error_of(payload)
            if code in EXPECTED_REFUSALS and token_events == 0:
                return Outcome("shed", code)
            return _fail(f"error event {code or 'without a code'} after {token_events} token events: {message}", code)
        # other event names are ignored, as the SSE spec and the SDK do
    if done is None:
        return _fail(f"stream ended without a done event ({token_events} token events, {len(body)} bytes)")
    if done["tokens_generated"] != tokens:
        return _fail(f"done says {done['tokens_generated']} tokens, the token events carried {tokens}")
    return OK


def request_name(tenant: str, kind: str, outcome: Outcome) -> str:
    """The Locust stats name: sheds get their own row per reason."""
    base = f"{tenant} {kind}"
    return f"{base} shed:{outcome.code}" if outcome.kind == "shed" else base


# =========================================================================== environment (pure)


def _env_number(env: Mapping[str, str], name: str, default: float, *, integer: bool = False) -> int | float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise ValueError(f"{name}: must be {'an integer' if integer else 'a number'}, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be > 0, got {raw!r}")
    return value


def time_scale_from_env(env: Mapping[str, str]) -> TimeScale:
    factor = _env_number(env, "BALLAST_TIME_SCALE", 96.0)
    try:
        return TimeScale(float(factor))
    except ValueError as e:
        raise ValueError(f"BALLAST_TIME_SCALE: {e}") from None


def shape_from_env(env: Mapping[str, str]) -> DiurnalShape | StepShape | None:
    """``$BALLAST_SHAPE`` → the shape; None (unset or empty) for a constant-user run."""
    name = env.get("BALLAST_SHAPE", "").strip().lower()
    if not name:
        return None
    peak = int(_env_number(env, "BALLAST_PEAK_USERS", 20, integer=True))
    if name == "diurnal":
        return DiurnalShape(peak_users=peak, time_scale=time_scale_from_env(env))
    if name == "step":
        return step_burst(peak)
    raise ValueError(f"BALLAST_SHAPE: must be 'diurnal', 'step' or unset, got {name!r}")


def faults_from_env(env: Mapping[str, str]) -> FaultSchedule | None:
    name = env.get("BALLAST_FAULTS", "").strip().lower()
    if name in ("", "0", "off", "none"):
        return None
    if name == "soak":
        return DEFAULT_SOAK
    raise ValueError(f"BALLAST_FAULTS: must be 'soak' or unset, got {name!r}")


def check_host(host: str | None, env: Mapping[str, str]) -> str:
    """The target host, or ValueError when it is not loopback and remote runs were not allowed."""
    from urllib.parse import urlsplit

    if not host:
        raise ValueError("host: none given (--host or the user class's host)")
    parts = urlsplit(host)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"host: must be http(s)://<host>[:port], got {host!r}")
    if not is_loopback_host(parts.hostname) and env.get("BALLAST_ALLOW_REMOTE") != "1":
        raise ValueError(f"host: {parts.hostname!r} is not loopback; set BALLAST_ALLOW_REMOTE=1 to load a remote stack")
    return host


# =========================================================================== Locust

# Everything below needs Locust (importing it monkey-patches the process with gevent
# unless LOCUST_SKIP_MONKEY_PATCH is set; the unit tests set it).
from locust import FastHttpUser, LoadTestShape, between, events, task  # noqa: E402
from locust.runners import WorkerRunner  # noqa: E402

_ENV = os.environ
SHAPE = shape_from_env(_ENV)
FAULTS = faults_from_env(_ENV)
TIME_SCALE = time_scale_from_env(_ENV)
#: Expected refusals by (tenant, criticality claimed, code); per process, bounded by the product of those.
SHEDS: Counter[tuple[str, str, str]] = Counter()
_fault_runner: FaultRunner | None = None
# The fault runner's calls are logged once each in its records; httpx's per-request INFO lines are noise.
logging.getLogger("httpx").setLevel(logging.WARNING)


class BallastUser(FastHttpUser):
    abstract = True
    tenant: ClassVar[TenantProfile]
    host = _ENV.get("BALLAST_HOST", DEFAULT_HOST)
    wait_time = between(*WAIT_RANGE_S)
    # Well above the server's deadline for these requests (resilience.deadline_s, 30 s by
    # default; no X-Request-Timeout-Ms is sent): a request the server gave up on answers
    # 504 DEADLINE_EXCEEDED, which names itself, rather than ending in a client timeout.
    network_timeout = float(_env_number(_ENV, "BALLAST_NETWORK_TIMEOUT_S", 90.0))
    connection_timeout = 10.0

    def on_start(self) -> None:
        self._rng = random.Random()
        self._auth = {"Authorization": f"Bearer {self.tenant.api_key(_ENV)}"}

    def _body(self, stream: bool) -> tuple[dict[str, Any], str]:
        crit = self.tenant.pick_criticality(self._rng)
        lo, hi = self.tenant.max_tokens_range
        body = {
            "prompt": self._rng.choice(PROMPTS),
            "max_tokens": self._rng.randint(lo, hi),
            "criticality": crit,
            "stream": stream,
        }
        return body, crit

    @task
    def generate(self) -> None:
        if self._rng.random() < self.tenant.stream_ratio:
            self._stream()
        else:
            self._plain()

    def _plain(self) -> None:
        body, crit = self._body(stream=False)
        with self.client.post(
            GENERATE_PATH, json=body, headers=self._auth, name=f"{self.tenant.name} plain", catch_response=True
        ) as resp:
            outcome = classify_unary(resp.status_code, resp.headers, resp.content)
            self._settle(resp, "plain", crit, _with_cause(outcome, resp))

    def _stream(self) -> None:
        body, crit = self._body(stream=True)
        # identity: the SSE bytes are read as they come, never a compressed stream.
        headers = {**self._auth, "Accept": "text/event-stream", "Accept-Encoding": "identity"}
        started = time.perf_counter()
        with self.client.post(
            GENERATE_PATH,
            json=body,
            headers=headers,
            name=f"{self.tenant.name} stream",
            catch_response=True,
            stream=True,
        ) as resp:
            status = resp.status_code
            read_error = None
            if status == 200:
                data, read_error = _read_stream(resp)
            else:
                data = resp.content or b""
            # Locust timed the head only (stream=True); the whole generation is the latency.
            resp.request_meta["response_time"] = (time.perf_counter() - started) * 1000.0
            resp.request_meta["response_length"] = len(data)
            outcome = _fail(read_error) if read_error else classify_stream(status, resp.headers, data)
            self._settle(resp, "stream", crit, _with_cause(outcome, resp))

    def _settle(self, resp: Any, kind: str, crit: str, outcome: Outcome) -> None:
        if outcome.kind == "fail":
            resp.failure(outcome.detail)
            return
        if outcome.kind == "shed":
            resp.request_meta["name"] = request_name(self.tenant.name, kind, outcome)
            SHEDS[(self.tenant.name, crit, outcome.code or "")] += 1
        resp.success()


def _with_cause(outcome: Outcome, resp: Any) -> Outcome:
    """A failure without an answer names the transport error Locust caught."""
    err = getattr(resp, "error", None)
    if outcome.kind == "fail" and not resp.status_code and err is not None:
        return _fail(f"{outcome.detail}: {type(err).__name__}: {err}")
    return outcome


def _read_stream(resp: Any) -> tuple[bytes, str | None]:
    """The whole SSE body (at most ``MAX_STREAM_BYTES`` kept; the rest read and dropped
    so that the pooled connection stays clean), and an error when reading failed."""
    buf = bytearray()
    try:
        for chunk in resp.iter_content(chunk_size=4096, decode_content=False):
            if isinstance(chunk, str):
                chunk = chunk.encode("utf-8")
            room = MAX_STREAM_BYTES - len(buf)
            if room > 0:
                buf += chunk[:room]
    except Exception as e:  # a read timeout or a reset mid-stream: a failure, not a crash of the user
        return bytes(buf), f"stream broken after {len(buf)} bytes: {type(e).__name__}: {e}"
    return bytes(buf), None


_BY_NAME = {t.name: t for t in TENANTS}


class GoldTenantUser(BallastUser):
    tenant = _BY_NAME["gold"]
    weight = tenant.user_weight


class FreeTenantUser(BallastUser):
    tenant = _BY_NAME["free"]
    weight = tenant.user_weight


class BallastShape(LoadTestShape):
    """``$BALLAST_SHAPE``'s shape; abstract (ignored by Locust) when it is unset."""

    abstract = SHAPE is None

    def tick(self) -> tuple[int, float] | None:
        assert SHAPE is not None
        return SHAPE.tick(self.get_run_time())


@events.init.add_listener
def _refuse_remote(environment: Any, **_kw: Any) -> None:
    # An exception in an init listener makes Locust exit 1 before any user starts.
    check_host(environment.host or BallastUser.host, _ENV)


@events.test_start.add_listener
def _start_faults(environment: Any, **_kw: Any) -> None:
    global _fault_runner
    if FAULTS is None or isinstance(environment.runner, WorkerRunner):
        return
    _fault_runner = FaultRunner(FAULTS, environment.host or BallastUser.host, TIME_SCALE)
    _fault_runner.start()
    log.warning("fault schedule started: %d events over %.0f simulated s", len(FAULTS.events), FAULTS.end_sim_s)


@events.test_stop.add_listener
def _stop_faults(environment: Any, **_kw: Any) -> None:
    if _fault_runner is not None:
        _fault_runner.stop()
        for r in _fault_runner.records:
            log.warning(
                "fault %s/%s at sim %.0fs (real +%.1fs): %s %s",
                r.action,
                r.step,
                r.at_sim_s,
                r.real_offset_s,
                r.status,
                r.error or "",
            )
    for (tenant, crit, code), n in sorted(SHEDS.items()):
        log.warning("shed %s %s %s: %d", tenant, crit, code, n)


@events.quitting.add_listener
def _write_report(environment: Any, **_kw: Any) -> None:
    path = _ENV.get("BALLAST_REPORT_JSON")
    if not path:
        return
    report = {
        "sheds": [
            {"tenant": t, "criticality": c, "code": code, "count": n} for (t, c, code), n in sorted(SHEDS.items())
        ],
        "faults": [r.to_dict() for r in _fault_runner.records] if _fault_runner is not None else [],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
