"""Steady load through every node's endpoint of a local cluster, for fault tests.

Closed-loop callers send ``/v1/generate`` requests, each to the next endpoint that is
up, the way a load balancer in front of the nodes would. A third of the callers send
an ``Idempotency-Key`` with every unary request, a third send unary requests without
one, a third stream.

What a balancer and the client SDK do is done here, and nothing more:

* The balancer checks every endpoint's ``/healthz/ready`` each second and marks one
  down after ``FALL`` checks in a row got no answer within ``CHECK_TIMEOUT_S`` (or at
  once when a connection is refused or not taken within ``CONNECT_TIMEOUT_S``); then
  it shuts the sessions it holds there (HAProxy: ``check inter 1s fall 2`` with
  ``on-marked-down shutdown-sessions``), and marks it up at its first good check.
* A request that got no answer at all (the connection refused or not taken, dropped
  before any response, or shut by the balancer) is sent again through another
  endpoint, as HAProxy's ``retry-on conn-failure empty-response`` with ``option
  redispatch`` does (a generation has no side effects).
* A stream cut after tokens reached the client is resumed through another endpoint
  with the ids its token events carried (``resume``), as the SDK does; it counts as
  migrated, not lost.
* A keyed request is also sent again, with its key, after a 502/503/504 answer or a
  timeout, as the SDK does.

Anything else is a request lost and is kept with its cause and the endpoint it went
to. Streams that the server carried on elsewhere say so in their last event
(``migrations``).

Bounded: a fixed number of callers, stopped by ``duration_s`` or ``stop()``, at most
``MAX_RECORDS`` outcomes kept. Targets: loopback or the local cluster's own
namespaces (``loadtest.netcluster.SUBNET``) only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from ballast.ops.status_text import model_view, sole_model

MAX_RECORDS = 200_000
CONNECT_TIMEOUT_S = 2.0  # a balancer's: a node that does not take the connection is tried no longer
CHECK_TIMEOUT_S = 2.0  # a health check's answer; FALL missed in a row mark the endpoint down
FALL = 2
MAX_SENDS = 5  # a request's sends in all (the first, re-sends and resumes)
RETRYABLE = {502, 503, 504}
OWN_NETWORKS = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("10.77.0.0/24"))


def check_own(url: str) -> str:
    host = urlsplit(url).hostname or ""
    if not any(ipaddress.ip_address(host) in net for net in OWN_NETWORKS):
        raise ValueError(f"{url}: load goes only to loopback or this machine's own cluster namespaces")
    return url


@dataclass
class Outcome:
    t: float  # monotonic, when the request was sent
    endpoint: str
    keyed: bool
    cause: str  # "ok", "connect", "timeout", "dropped", "cut", "stream_<code>", "http_<status>_<code>"
    attempts: int = 1  # attempts until this outcome (sent again through another endpoint)
    level: int | None = None  # the degradation level the answer carried
    replayed: bool = False
    why: str = ""  # a refusal's message without its numbers: which policy refused
    stream: bool = False
    migrations: int = 0  # times the server carried it on after its replica went away
    resumed: int = 0  # times the client resumed it after it was cut at its router


def message_kind(message: str) -> str:
    """A refusal's message with its numbers and quoted names taken out, so refusals of
    one kind count together: "degradation level 2 does not admit criticality 'critical'"
    -> "degradation level # does not admit criticality '…'"."""
    return re.sub(r"'[^']*'", "'…'", re.sub(r"\d+(\.\d+)?", "#", message))[:120]


@dataclass
class LevelSample:
    """The degradation level as a router's ``/v1/status`` gave it, and the controller's reason."""

    t: float  # monotonic
    level: int
    reason: str = ""


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    down_marks: list[tuple[float, str]] = field(default_factory=list)
    levels: list[LevelSample] = field(default_factory=list)  # sampled once a second, with an admin token

    def failures(self, keyed: bool | None = None, since: float = 0.0) -> Counter:
        """Failed requests by cause: keyed ones, unkeyed ones (streams included), or all (None)."""
        return Counter(
            o.cause for o in self.outcomes if (keyed is None or o.keyed == keyed) and o.cause != "ok" and o.t >= since
        )

    def migrated(self, since: float = 0.0) -> tuple[int, int]:
        """(requests carried on after losing their replica or router, moves in all): the
        server's migrations (the streams' last events, the unary answers'
        X-Ballast-Migrations) and the client's resumes of streams cut at their router."""
        moved = [o.migrations + o.resumed for o in self.outcomes if (o.migrations or o.resumed) and o.t >= since]
        return len(moved), sum(moved)

    def resent(self, since: float = 0.0) -> int:
        """Requests that got no answer from one endpoint and were answered through another."""
        return sum(1 for o in self.outcomes if o.cause == "ok" and o.attempts > 1 and o.t >= since)

    def count(self, keyed: bool | None = None, since: float = 0.0, until: float = float("inf")) -> int:
        return sum(1 for o in self.outcomes if (keyed is None or o.keyed == keyed) and since <= o.t < until)

    def refusals(self, since: float = 0.0) -> Counter:
        """Refused requests (an HTTP error answer) by cause and message kind."""
        return Counter(f"{o.cause}: {o.why}" for o in self.outcomes if o.why and o.t >= since)

    def max_level(self, since: float = 0.0) -> int:
        """The highest level seen: in answers, and in the sampled status (which also sees
        the levels at which nothing was answered)."""
        seen = [o.level for o in self.outcomes if o.level is not None and o.t >= since]
        seen += [s.level for s in self.levels if s.t >= since]
        return max(seen, default=0)

    def level_reasons(self, at_least: int, since: float = 0.0) -> Counter:
        """Why the level stood at ``at_least`` or above: the controller's reasons, numbers out."""
        return Counter(message_kind(s.reason) for s in self.levels if s.level >= at_least and s.t >= since)

    def last_failure(self, since: float = 0.0) -> float | None:
        times = [o.t for o in self.outcomes if o.cause != "ok" and o.t >= since]
        return max(times) if times else None


@dataclass
class _Progress:
    """What reached the client of one request so far: a stream's token ids and text."""

    tokens: int = 0
    ids: list[int] = field(default_factory=list)
    chars: int = 0
    resumable: bool = True  # every token event carried its ids

    def resume(self) -> dict | None:
        return {"ids": list(self.ids), "text_chars": self.chars} if self.tokens else None


class ClusterLoad:
    """``callers`` closed-loop callers over ``endpoints`` in a thread of its own."""

    def __init__(
        self,
        endpoints: list[str],
        api_key: str,
        callers: int = 6,
        max_tokens: int = 8,
        timeout_s: float = 10.0,
        duration_s: float = 120.0,
        admin_token: str | None = None,
    ) -> None:
        self.endpoints = [check_own(e) for e in endpoints]
        self.api_key = api_key
        self.admin_token = admin_token  # when given, the level is sampled from /v1/status each second
        self.callers = callers
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.duration_s = duration_s
        self.report = LoadReport()
        self._down: dict[str, bool] = {e: False for e in self.endpoints}
        self._missed: dict[str, int] = {e: 0 for e in self.endpoints}  # health checks missed in a row
        self._sessions: dict[str, set[asyncio.Task]] = {e: set() for e in self.endpoints}
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="cluster-load", daemon=True)

    def start(self) -> ClusterLoad:
        self._thread.start()
        return self

    def stop(self) -> LoadReport:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 10)
        return self.report

    # -- the endpoints (the balancer) ---------------------------------------------
    def _pick(self, avoid: str | None = None) -> str:
        up = [e for e in self.endpoints if not self._down[e] and e != avoid] or [
            e for e in self.endpoints if e != avoid
        ]
        self._next += 1
        return up[self._next % len(up)] if up else self.endpoints[0]

    def _mark_down(self, endpoint: str) -> None:
        """Out of rotation, and the sessions held there shut (their requests are sent again)."""
        if not self._down[endpoint]:
            self._down[endpoint] = True
            self.report.down_marks.append((time.monotonic(), endpoint))
            for task in list(self._sessions[endpoint]):
                if task is not asyncio.current_task():  # the one that found it down answers for itself
                    task.cancel()

    async def _check(self, client: httpx.AsyncClient, endpoint: str) -> None:
        try:
            ok = (await client.get(f"{endpoint}/healthz/ready", timeout=CHECK_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            self._missed[endpoint] = 0
            self._down[endpoint] = False
            return
        self._missed[endpoint] += 1
        if self._missed[endpoint] >= FALL:
            self._mark_down(endpoint)

    async def _probe(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            await asyncio.gather(*(self._check(client, e) for e in self.endpoints), asyncio.sleep(1.0))

    async def _sample_level(self, client: httpx.AsyncClient) -> None:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        while not self._stop.is_set():
            try:
                r = await client.get(f"{self._pick()}/v1/status", headers=headers, timeout=2.0)
                st = r.json()
                model = model_view(st, sole_model(st))  # the cluster serves one model
                if len(self.report.levels) < MAX_RECORDS:
                    reason = str(model["controller"].get("reason") or "")
                    self.report.levels.append(LevelSample(time.monotonic(), int(model["level"]), reason))
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass  # a node down: the next sample goes to another one
            await asyncio.sleep(1.0)

    # -- the callers --------------------------------------------------------------
    def _record(self, outcome: Outcome) -> None:
        if len(self.report.outcomes) < MAX_RECORDS:
            self.report.outcomes.append(outcome)

    async def _send(
        self, client: httpx.AsyncClient, endpoint: str, key: str | None, stream: bool, got: _Progress
    ) -> tuple[str, dict | None]:
        """One send, a session the balancer may shut (the endpoint marked down): then
        "dropped", or "cut" when tokens had reached the client (``got``)."""
        task = asyncio.ensure_future(self._exchange(client, endpoint, key, stream, got))
        self._sessions[endpoint].add(task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the harness stopping, not the balancer
            return ("cut" if got.tokens else "dropped"), None
        finally:
            self._sessions[endpoint].discard(task)

    async def _exchange(
        self, client: httpx.AsyncClient, endpoint: str, key: str | None, stream: bool, got: _Progress
    ) -> tuple[str, dict | None]:
        """(cause, body): the body of a 200 (a stream's last event), or of an error answer;
        None where none came. "cut": a stream that ended early after tokens had arrived."""
        headers = {"Authorization": f"Bearer {self.api_key}", "X-Request-Timeout-Ms": str(int(self.timeout_s * 800))}
        if key:
            headers["Idempotency-Key"] = key
        body: dict = {"prompt": "cluster", "max_tokens": self.max_tokens, "stream": stream}
        resume = got.resume()
        if resume is not None:
            body["resume"] = resume
        try:
            timeout = httpx.Timeout(self.timeout_s, connect=CONNECT_TIMEOUT_S)
            async with client.stream(
                "POST", f"{endpoint}/v1/generate", headers=headers, json=body, timeout=timeout
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    try:
                        err = r.json()
                        code = err["error"]["code"]
                    except (ValueError, KeyError, TypeError):  # not a router's answer: say what it was
                        err = {"error": {"message": f"not a router's answer: {' '.join(r.text[:200].split())}"}}
                        code = "?"
                    return f"http_{r.status_code}_{code}", err
                if not stream:
                    await r.aread()
                    answer = r.json()
                    answer["migrations"] = int(r.headers.get("x-ballast-migrations", 0))
                    return "ok", answer
                event = None
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if event == "token":
                            got.tokens += 1
                            got.chars += len(data["text"])
                            got.ids.extend(data.get("ids") or ())
                            got.resumable = got.resumable and "ids" in data
                        elif event == "done":
                            return "ok", data
                        elif event == "error":
                            return f"stream_{data['error']['code']}", data
                return ("cut" if got.tokens else "dropped"), None
        except (httpx.ConnectTimeout, httpx.ConnectError):  # nothing listens there: the node is gone
            self._mark_down(endpoint)
            return "connect", None
        except httpx.TimeoutException:  # no answer within the request's time: the node may be cut off
            self._mark_down(endpoint)
            return ("cut" if got.tokens else "timeout"), None
        except httpx.HTTPError:  # the node's HAProxy dropped it (its router died mid-request)
            return ("cut" if got.tokens else "dropped"), None

    async def _caller(self, client: httpx.AsyncClient, keyed: bool, stream: bool, stop_at: float) -> None:
        while not self._stop.is_set() and time.monotonic() < stop_at:
            sent = time.monotonic()
            endpoint = self._pick()
            key = uuid.uuid4().hex if keyed else None
            got = _Progress()
            cause, body = await self._send(client, endpoint, key, stream, got)
            attempts, resumed = 1, 0
            while cause != "ok" and attempts < MAX_SENDS and self._resend(cause, keyed, got):
                if self._stop.is_set():
                    return  # abandoned by the harness mid-resend: neither answered nor lost
                resumed += cause == "cut"
                await asyncio.sleep(0.2 * attempts)
                endpoint = self._pick(avoid=endpoint)
                cause, body = await self._send(client, endpoint, key, stream, got)
                attempts += 1
            level = body.get("degradation_level") if body and cause == "ok" else None
            why = message_kind(str(body["error"].get("message", ""))) if body and cause != "ok" else ""
            migrations = int(body.get("migrations") or 0) if body and cause == "ok" else 0
            self._record(
                Outcome(
                    sent,
                    endpoint,
                    keyed,
                    cause,
                    attempts,
                    level,
                    why=why,
                    stream=stream,
                    migrations=migrations,
                    resumed=resumed,
                )
            )
            if cause != "ok":
                await asyncio.sleep(0.1)

    @staticmethod
    def _resend(cause: str, keyed: bool, got: _Progress) -> bool:
        """Sent again through another endpoint: no answer at all (any request), a stream
        cut after its tokens (resumed from them), or a keyed request's timeout or
        502/503/504 (the SDK's rule)."""
        if cause in ("connect", "dropped"):
            return True
        if cause == "cut":
            return got.resumable
        if not keyed:
            return False  # a timeout comes at the request's own deadline: too late (the SDK resends a keyed one)
        return cause == "timeout" or (cause.startswith("http_") and int(cause.split("_")[1]) in RETRYABLE)

    async def _main(self) -> None:
        stop_at = time.monotonic() + self.duration_s
        limits = httpx.Limits(max_connections=self.callers * 2 + 4)
        async with httpx.AsyncClient(limits=limits) as client:
            probe = asyncio.create_task(self._probe(client))
            sampler = asyncio.create_task(self._sample_level(client)) if self.admin_token else None
            # A third keyed (unary), a third unary without a key, a third streaming.
            await asyncio.gather(*(self._caller(client, i % 3 == 0, i % 3 == 2, stop_at) for i in range(self.callers)))
            self._stop.set()
            probe.cancel()
            if sampler is not None:
                sampler.cancel()
