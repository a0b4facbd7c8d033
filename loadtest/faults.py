"""A fault schedule for a soak, as data, played against a local stack's admin and chaos APIs.

``FaultSchedule`` is a tuple of ``FaultEvent(at_sim_s, action, args)``: at a simulated
offset from the start of the run (the same clock as the diurnal shape, so
``TimeScale(96)`` plays a day's schedule in 15 minutes), do one action:

* ``kill_replica`` — ``POST /admin/chaos {"target", "stall": true}``, hold it for
  ``stall_s`` *real* seconds (the watchdog's hang rule runs on real time: work in
  flight and its work loop still for ``hang_missed_heartbeats`` intervals), then
  ``DELETE /admin/chaos``. The controller kills the hung replica and Serve starts a
  replacement. ``POST /admin/recycle`` is not a kill (it drains gracefully), and
  there is no ``ray`` here: HTTP only. The stall applies to every replica of the
  target that has work in flight, so on a one-replica stack it kills that one.
* ``start_leak`` — ``POST /admin/chaos {"target", "leak_mb_per_s"}`` (the server
  caps the leak at ``chaos.max_leak_mb``). The rate is given either in real MB/s
  (``leak_mb_per_s``) or per *simulated* hour (``leak_mb_per_sim_h``), which the runner
  turns into MB/s at its time scale: the same schedule then leaks the same share of a
  day at scale 96 as at scale 1 (750 MB/sim-h: 20 MB/s in the 15-minute day, 0.21 MB/s
  in the real one).
* ``fail_primary`` — ``POST /admin/chaos {"target": "primary", "error_ratio"}`` (1.0
  by default): the fallback chain answers.
* ``clear_chaos`` — ``DELETE /admin/chaos``.
* ``kill_switch_on`` — ``POST /admin/kill-switch {"scope", "value", "reason",
  "expires_in_s"}``; the returned id is kept under the event's ``label``.
* ``kill_switch_off`` — ``DELETE /admin/kill-switch/{id}`` for the id that the
  ``kill_switch_on`` with the same ``label`` got.

Each ``POST /admin/chaos`` *replaces* the target's chaos settings (a leak started
after ``fail_primary`` ends the failures), as the API does.

``FaultRunner`` is a small daemon thread: it waits (interruptibly) until each
event's real offset, calls the API, and records every HTTP call with its offsets
and status in a bounded list for the report. Events run one after another: an
event due while ``kill_replica`` holds its stall runs right after it (late, and
its record's ``real_offset_s`` shows by how much). It stops at the end of the schedule
or when ``stop()`` is called; either way it then undoes what it left on (chaos it
set, kill switches it turned on and did not turn off), so a soak never leaves a
stack failing. Only loopback base URLs are accepted (127.0.0.0/8, ``::1``,
``localhost``): this drives fault injection, never against a shared stack. The
admin token is ``$BALLAST_ADMIN_TOKEN``, else the local demo token.

Written by hand rather than with a scheduler library: the schedule runs on a
simulated clock (scaled), the waits must be interruptible by ``stop()``, and the
clock and the wait are injected so that the runner is testable; it is a loop over
a sorted tuple.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import httpx

from ballast.policies.validation import check_fields, check_non_negative, check_positive, is_finite
from loadtest.shapes import TimeScale

DEMO_ADMIN_TOKEN = "dev-admin-token"
OPERATOR = "loadtest-faults"
MAX_EVENTS = 1000
MAX_RECORDS = 512
DAY_IN_15_MIN = TimeScale(96.0)  # the default: a day in 15 minutes
MAX_KILL_SWITCH_EXPIRES_S = 7 * 24 * 3600  # ballast.policies.killswitch's limit
KILL_SWITCH_SCOPES = ("global", "tenant", "model", "criticality")
CHAOS_TARGETS = ("primary", "fallback")

ACTIONS = ("kill_replica", "start_leak", "fail_primary", "clear_chaos", "kill_switch_on", "kill_switch_off")
#: The args each action accepts (anything else is refused: a typo must not pass silently).
_ALLOWED_ARGS: dict[str, frozenset[str]] = {
    "kill_replica": frozenset({"target", "stall_s"}),
    "start_leak": frozenset({"target", "leak_mb_per_s", "leak_mb_per_sim_h"}),
    "fail_primary": frozenset({"error_ratio"}),
    "clear_chaos": frozenset(),
    "kill_switch_on": frozenset({"label", "scope", "value", "reason", "expires_in_s"}),
    "kill_switch_off": frozenset({"label"}),
}


def check_loopback(base_url: str) -> str:
    """``base_url`` without a trailing slash, or ValueError when its host is not loopback."""
    if not isinstance(base_url, str):
        raise ValueError(f"base_url: must be a string, got {base_url!r}")
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"base_url: must be http(s)://, got {base_url!r}")
    host = parts.hostname or ""
    if not is_loopback_host(host):
        raise ValueError(f"base_url: fault injection runs only against a loopback host, got {host!r}")
    return base_url.rstrip("/")


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def leak_mb_per_s(event: FaultEvent, time_scale: TimeScale) -> float:
    """The real rate of a ``start_leak`` (MB/s) at ``time_scale``, within the server's cap of 1024."""
    if "leak_mb_per_s" in event.args:
        return float(event.args["leak_mb_per_s"])
    return min(1024.0, float(event.args["leak_mb_per_sim_h"]) * time_scale.factor / 3600.0)


# =========================================================================== schedule


@dataclass(frozen=True)
class FaultEvent:
    """At ``at_sim_s`` simulated seconds into the run, do ``action`` with ``args``."""

    at_sim_s: float
    action: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, check_non_negative, "at_sim_s")
        if self.action not in ACTIONS:
            raise ValueError(f"action: must be one of {ACTIONS}, got {self.action!r}")
        if not isinstance(self.args, Mapping):
            raise ValueError(f"args: must be a mapping, got {self.args!r}")
        unknown = set(self.args) - _ALLOWED_ARGS[self.action]
        if unknown:
            raise ValueError(f"args: {self.action} does not take {sorted(unknown)}")
        object.__setattr__(self, "args", MappingProxyType(dict(self.args)))
        getattr(self, f"_check_{self.action}")()

    # -- per-action checks (the server checks too; these catch a bad schedule before the run)
    def _target(self) -> str:
        target = self.args.get("target", "primary")
        if target not in CHAOS_TARGETS:
            raise ValueError(f"target: must be one of {CHAOS_TARGETS}, got {target!r}")
        return target

    def _check_kill_replica(self) -> None:
        self._target()
        stall_s = self.args.get("stall_s", 5.0)
        if not is_finite(stall_s) or not 0 < stall_s <= 600:
            raise ValueError(f"stall_s: must be within (0, 600], got {stall_s!r}")

    def _check_start_leak(self) -> None:
        self._target()
        given = [k for k in ("leak_mb_per_s", "leak_mb_per_sim_h") if k in self.args]
        if not given:
            raise ValueError("leak_mb_per_s: required (or leak_mb_per_sim_h)")
        if len(given) > 1:
            raise ValueError("leak_mb_per_sim_h: give it or leak_mb_per_s, not both")
        rate = self.args[given[0]]
        top = 1024 if given[0] == "leak_mb_per_s" else 1024 * 3600
        if not is_finite(rate) or not 0 < rate <= top:
            raise ValueError(f"{given[0]}: must be within (0, {top}], got {rate!r}")

    def _check_fail_primary(self) -> None:
        ratio = self.args.get("error_ratio", 1.0)
        if not is_finite(ratio) or not 0 < ratio <= 1:
            raise ValueError(f"error_ratio: must be within (0, 1], got {ratio!r}")

    def _check_clear_chaos(self) -> None:
        pass

    def _check_kill_switch_on(self) -> None:
        self._check_label()
        scope = self.args.get("scope")
        if scope not in KILL_SWITCH_SCOPES:
            raise ValueError(f"scope: must be one of {KILL_SWITCH_SCOPES}, got {scope!r}")
        value = self.args.get("value")
        if scope == "global" and value is not None:
            raise ValueError(f"value: a global kill switch takes none, got {value!r}")
        if scope != "global" and (not isinstance(value, str) or not value):
            raise ValueError(f"value: a {scope} kill switch needs a non-empty string, got {value!r}")
        reason = self.args.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"reason: must be a non-empty string, got {reason!r}")
        expires = self.args.get("expires_in_s")
        if not isinstance(expires, int) or isinstance(expires, bool) or not 0 < expires <= MAX_KILL_SWITCH_EXPIRES_S:
            raise ValueError(
                f"expires_in_s: must be an integer within (0, {MAX_KILL_SWITCH_EXPIRES_S}], got {expires!r}"
            )

    def _check_kill_switch_off(self) -> None:
        self._check_label()

    def _check_label(self) -> None:
        label = self.args.get("label")
        if not isinstance(label, str) or not label:
            raise ValueError(f"label: must be a non-empty string, got {label!r}")


@dataclass(frozen=True)
class FaultSchedule:
    """Events in time order (a stable sort by ``at_sim_s``: equal times keep their given order).

    A ``kill_switch_off`` must follow a ``kill_switch_on`` with the same label, and a
    label is turned on at most once (the off must know which id to delete).
    """

    events: tuple[FaultEvent, ...]

    def __post_init__(self) -> None:
        events = tuple(self.events)
        if len(events) > MAX_EVENTS:
            raise ValueError(f"events: at most {MAX_EVENTS}, got {len(events)}")
        for e in events:
            if not isinstance(e, FaultEvent):
                raise ValueError(f"events: must be FaultEvent items, got {e!r}")
        events = tuple(sorted(events, key=lambda e: e.at_sim_s))
        object.__setattr__(self, "events", events)
        on: set[str] = set()
        off: set[str] = set()
        for e in events:
            label = e.args.get("label")
            if e.action == "kill_switch_on":
                if label in on:
                    raise ValueError(f"label: {label!r} is turned on twice")
                on.add(label)
            elif e.action == "kill_switch_off":
                if label not in on:
                    raise ValueError(f"label: kill_switch_off {label!r} has no earlier kill_switch_on")
                if label in off:
                    raise ValueError(f"label: {label!r} is turned off twice")
                off.add(label)

    @property
    def end_sim_s(self) -> float:
        return self.events[-1].at_sim_s if self.events else 0.0


def _h(hours: float) -> float:
    return hours * 3600.0


#: The soak's default day: a leak in the quiet night (the watchdog should catch and
#: recycle it), a hung replica killed in the morning ramp, the primary failing around
#: the noon peak (the fallback answers), the free tenant switched off before the
#: evening spike. ``expires_in_s`` is real seconds on the server: a safety net well
#: past the scheduled off (1 h simulated is 37.5 s at scale 96).
DEFAULT_SOAK = FaultSchedule(
    (
        FaultEvent(_h(4.0), "start_leak", {"target": "primary", "leak_mb_per_sim_h": 750.0}),
        FaultEvent(_h(6.0), "clear_chaos"),
        FaultEvent(_h(10.0), "kill_replica", {"target": "primary", "stall_s": 5.0}),
        FaultEvent(_h(12.5), "fail_primary", {"error_ratio": 1.0}),
        FaultEvent(_h(13.5), "clear_chaos"),
        FaultEvent(
            _h(17.0),
            "kill_switch_on",
            {
                "label": "free-off",
                "scope": "tenant",
                "value": "free",
                "reason": "soak: free tenant paused",
                "expires_in_s": 900,
            },
        ),
        FaultEvent(_h(18.0), "kill_switch_off", {"label": "free-off"}),
        FaultEvent(_h(23.0), "clear_chaos"),
    )
)


# =========================================================================== runner


@dataclass(frozen=True)
class FaultRecord:
    """One HTTP call the runner made. ``status`` None: no answer (``error`` says why)."""

    action: str
    step: str
    at_sim_s: float
    real_offset_s: float
    status: int | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "step": self.step,
            "at_sim_s": self.at_sim_s,
            "real_offset_s": round(self.real_offset_s, 3),
            "status": self.status,
            "error": self.error,
        }


class FaultRunner:
    """Plays a ``FaultSchedule`` on a daemon thread against ``base_url``.

    ``clock`` (monotonic seconds) is injected; the waits go through the stop event,
    so ``stop()`` interrupts any of them at once. ``transport`` replaces httpx's
    (not used by the tests, which run a real local server). Threading: only the
    runner thread calls the API and appends records; ``records`` hands out a copy
    taken under ``_lock`` (the deque is bounded, ``MAX_RECORDS``, oldest dropped).
    """

    def __init__(
        self,
        schedule: FaultSchedule,
        base_url: str,
        time_scale: TimeScale = DAY_IN_15_MIN,
        *,
        admin_token: str | None = None,
        timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.BaseTransport | None = None,
        max_records: int = MAX_RECORDS,
    ) -> None:
        if not isinstance(schedule, FaultSchedule):
            raise ValueError(f"schedule: must be a FaultSchedule, got {schedule!r}")
        if not isinstance(time_scale, TimeScale):
            raise ValueError(f"time_scale: must be a TimeScale, got {time_scale!r}")
        check_positive("timeout_s", timeout_s)
        self.base_url = check_loopback(base_url)
        token = admin_token if admin_token is not None else os.environ.get("BALLAST_ADMIN_TOKEN", DEMO_ADMIN_TOKEN)
        if not token:
            raise ValueError("admin_token: must be non-empty")
        self.schedule = schedule
        self.time_scale = time_scale
        self._clock = clock
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}", "X-Ballast-Operator": OPERATOR},
            timeout=timeout_s,
            transport=transport,
        )
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _records (appended by the runner thread, read by others)
        self._records: deque[FaultRecord] = deque(maxlen=max_records)
        self._kill_switch_ids: dict[str, str] = {}  # label → id, only touched by the runner thread
        self._chaos_set = False  # only touched by the runner thread
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self.done = threading.Event()

    # -- control --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread; idempotent (a runner plays its schedule once)."""
        if self._thread is not None:
            return
        self._started_at = self._clock()
        self._thread = threading.Thread(target=self._run, name="ballast-faults", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop at once (an action in progress finishes its cleanup), then wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the end of the schedule; True when the runner has finished."""
        return self.done.wait(timeout_s)

    @property
    def records(self) -> list[FaultRecord]:
        with self._lock:
            return list(self._records)

    # -- the thread -----------------------------------------------------------------------
    def _offset_s(self) -> float:
        return self._clock() - self._started_at

    def _wait_until(self, real_offset_s: float) -> bool:
        """Sleep until ``real_offset_s`` into the run; False when told to stop first."""
        while not self._stop.is_set():
            left_s = real_offset_s - self._offset_s()
            if left_s <= 0:
                return True
            self._stop.wait(min(left_s, 1.0))  # re-reads the clock: a wait may end early
        return False

    def _run(self) -> None:
        try:
            for event in self.schedule.events:
                if not self._wait_until(self.time_scale.real_s(event.at_sim_s)):
                    break
                getattr(self, f"_do_{event.action}")(event)
        finally:
            self._cleanup()
            self._http.close()
            self.done.set()

    def _call(
        self, event: FaultEvent | None, step: str, method: str, path: str, body: Any = None
    ) -> httpx.Response | None:
        action = event.action if event is not None else "cleanup"
        at_sim_s = event.at_sim_s if event is not None else self.time_scale.sim_s(max(0.0, self._offset_s()))
        offset_s = self._offset_s()
        try:
            resp = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            self._record(FaultRecord(action, step, at_sim_s, offset_s, None, f"{type(e).__name__}: {e}"[:300]))
            return None
        error = None if resp.is_success else resp.text[:300]
        self._record(FaultRecord(action, step, at_sim_s, offset_s, resp.status_code, error))
        return resp

    def _record(self, record: FaultRecord) -> None:
        with self._lock:
            self._records.append(record)

    def _set_chaos(self, event: FaultEvent, step: str, settings: dict[str, Any]) -> None:
        self._chaos_set = True  # even if the call failed: cleanup clears regardless
        self._call(event, step, "POST", "/admin/chaos", settings)

    def _clear_chaos(self, event: FaultEvent | None, step: str) -> None:
        resp = self._call(event, step, "DELETE", "/admin/chaos")
        if resp is not None and resp.is_success:
            self._chaos_set = False

    # -- actions --------------------------------------------------------------------------
    def _do_kill_replica(self, event: FaultEvent) -> None:
        target = event.args.get("target", "primary")
        self._set_chaos(event, "stall", {"target": target, "stall": True})
        try:
            # Real seconds, not scaled: the watchdog's hang rule runs on real time.
            # An interrupted hold still clears the stall (finally).
            self._stop.wait(float(event.args.get("stall_s", 5.0)))
        finally:
            self._clear_chaos(event, "clear")

    def _do_start_leak(self, event: FaultEvent) -> None:
        target = event.args.get("target", "primary")
        self._set_chaos(event, "leak", {"target": target, "leak_mb_per_s": leak_mb_per_s(event, self.time_scale)})

    def _do_fail_primary(self, event: FaultEvent) -> None:
        self._set_chaos(event, "fail", {"target": "primary", "error_ratio": float(event.args.get("error_ratio", 1.0))})

    def _do_clear_chaos(self, event: FaultEvent) -> None:
        self._clear_chaos(event, "clear")

    def _do_kill_switch_on(self, event: FaultEvent) -> None:
        body = {k: event.args.get(k) for k in ("scope", "value", "reason", "expires_in_s")}
        resp = self._call(event, "on", "POST", "/admin/kill-switch", body)
        if resp is None or not resp.is_success:
            return
        try:
            entry_id = resp.json()["id"]
        except (ValueError, KeyError, TypeError):
            self._record(
                FaultRecord(
                    event.action, "on", event.at_sim_s, self._offset_s(), resp.status_code, "answer without an id"
                )
            )
            return
        self._kill_switch_ids[event.args["label"]] = str(entry_id)

    def _do_kill_switch_off(self, event: FaultEvent) -> None:
        entry_id = self._kill_switch_ids.pop(event.args["label"], None)
        if entry_id is None:  # its kill_switch_on failed: nothing to delete
            self._record(
                FaultRecord(
                    event.action, "off", event.at_sim_s, self._offset_s(), None, "no id: the kill_switch_on failed"
                )
            )
            return
        self._call(event, "off", "DELETE", f"/admin/kill-switch/{entry_id}")

    def _cleanup(self) -> None:
        """Undo what is still on: chaos this runner set, kill switches it turned on and not off."""
        if self._chaos_set:
            self._clear_chaos(None, "clear_chaos")
        for label, entry_id in list(self._kill_switch_ids.items()):
            self._call(None, f"kill_switch_off:{label}", "DELETE", f"/admin/kill-switch/{entry_id}")
            del self._kill_switch_ids[label]
