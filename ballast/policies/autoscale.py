"""Replica autoscaling with Knative-style stable and panic windows.

Each control tick feeds one sample (total ongoing requests across the
deployment — running plus queued — and, when there is a GPU, the average GPU
utilization). Two windows are averaged over the retained samples:

* the **stable window** (default 60 s) drives normal scaling; its desired count
  is the larger of the concurrency answer ``ceil(avg / target_ongoing_requests)``
  and, when utilization is present, the utilization answer
  ``ceil(current * avg_util / target_gpu_util_pct)``;
* the **panic window** (default 6 s) catches bursts. When its concurrency answer
  reaches ``panic_threshold_ratio × current`` the policy enters panic mode,
  which lasts until a full stable window has passed without a new trigger. In
  panic the policy scales up at once to the larger of the panic and stable
  answers (Knative's ``max(stable, panic)``) and never scales down. Panic sees
  concurrency only, so without the stable answer in that max a saturated GPU
  whose utilization asks for 12 replicas would be held at the panic window's 9
  for up to a whole stable window.

GPU utilization does not take part in the panic window: it is a lagging,
saturating duty-cycle signal (at most 100 %, i.e. 1.25× current at an 80 %
target), so it cannot measure a burst, and with one replica the rounding alone
would trigger panic on any busy batch.

Scale-up is immediate (bounded by ``max_replicas``). Scale-down waits until the
desired count has stayed below the current count for ``scale_down_delay_s``
uninterrupted, then removes at most ``max_scale_down_step`` replicas; the next
step needs another full delay. Removing GPU replicas is expensive to undo
(model load, warm-up), so going down is deliberately slow.

``current_replicas`` should be the deployment's current *target* (Ray's
``ctx.target_num_replicas``), not the count of running replicas, so that a
replica still starting is not mistaken for a missing one. As a guard, during
panic the policy also never goes below its own previous decision.

Written by hand: Ray Serve's built-in policy has no panic window, and Knative's
autoscaler is Go inside Kubernetes; neither takes an injected clock or a second
(GPU) signal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ballast.policies.validation import check_fields, check_finite, check_int, check_non_negative, check_positive

# Averages of float samples divided by the target can land a hair above an
# integer (24.000000000000004 / 8); without this tolerance ceil() adds a replica.
_CEIL_EPSILON = 1e-9


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _CEIL_EPSILON))


@dataclass(frozen=True)
class AutoscaleConfig:
    min_replicas: int = 1
    max_replicas: int = 4
    #: Per replica: running + queued requests one replica should carry.
    target_ongoing_requests: float = 8.0
    #: Second signal; None disables it. Absent utilization samples are ignored.
    target_gpu_util_pct: float | None = 80.0
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    #: Enter panic when the panic-window desired count >= ratio × current replicas.
    panic_threshold_ratio: float = 2.0
    #: How long desired must stay below current, uninterrupted, before a step down.
    scale_down_delay_s: float = 30.0
    #: Replicas removed per step down.
    max_scale_down_step: int = 1
    #: Hard bound on retained samples, whatever the tick rate.
    max_samples: int = 4096

    def __post_init__(self) -> None:
        check_fields(self, check_int, "min_replicas", minimum=0)
        check_fields(self, check_int, "max_replicas", minimum=1)
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: must be <= max_replicas ({self.max_replicas}), got {self.min_replicas}")
        check_fields(self, check_positive, "target_ongoing_requests")
        if self.target_gpu_util_pct is not None:
            check_fields(self, check_finite, "target_gpu_util_pct")
            if not 0 < self.target_gpu_util_pct <= 100:
                raise ValueError(f"target_gpu_util_pct: must be in (0, 100], got {self.target_gpu_util_pct!r}")
        check_fields(self, check_positive, "stable_window_s", "panic_window_s")
        if self.panic_window_s > self.stable_window_s:
            raise ValueError(
                f"panic_window_s: must be <= stable_window_s ({self.stable_window_s}), got {self.panic_window_s}"
            )
        check_fields(self, check_finite, "panic_threshold_ratio")
        # Below 1.0 the policy would be in panic at steady state.
        if self.panic_threshold_ratio < 1.0:
            raise ValueError(f"panic_threshold_ratio: must be >= 1.0, got {self.panic_threshold_ratio!r}")
        check_fields(self, check_non_negative, "scale_down_delay_s")
        check_fields(self, check_int, "max_scale_down_step", "max_samples", minimum=1)

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class AutoscaleSample:
    t_s: float
    #: Total running + queued requests across the deployment.
    ongoing_requests: float
    #: Mean GPU utilization across replicas; None when there is no GPU or no report.
    gpu_util_pct: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, check_finite, "t_s")
        check_fields(self, check_non_negative, "ongoing_requests")
        check_fields(self, check_non_negative, "gpu_util_pct", optional=True)


@dataclass(frozen=True)
class AutoscaleState:
    """Carried between ticks. ``samples`` never exceeds the stable window or max_samples."""

    samples: tuple[AutoscaleSample, ...] = ()
    #: Panic lasts until this time (last trigger + stable window); None when not in panic.
    panic_until_s: float | None = None
    #: Start of the current uninterrupted "desired < current" streak.
    below_since_s: float | None = None
    last_desired: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        for s in self.samples:
            if not isinstance(s, AutoscaleSample):
                raise ValueError(f"samples: entries must be AutoscaleSample, got {s!r}")
        check_fields(self, check_finite, "panic_until_s", "below_since_s", optional=True)
        if self.last_desired is not None:
            check_fields(self, check_int, "last_desired", minimum=0)


@dataclass(frozen=True)
class AutoscaleDecision:
    desired_replicas: int
    #: "stable" | "panic"
    mode: str
    reason: str
    #: Raw (unclamped) demand from the stable window: max(concurrency, utilization).
    stable_desired: int
    #: Raw (unclamped) demand from the panic window: concurrency only.
    panic_desired: int


def _trim(samples: tuple[AutoscaleSample, ...], now_s: float, cfg: AutoscaleConfig) -> tuple[AutoscaleSample, ...]:
    # Window is (now - W, now]. Samples stamped after ``now`` (a clock that went
    # backwards) are dropped rather than allowed to dominate future windows.
    horizon = now_s - cfg.stable_window_s
    kept = tuple(s for s in samples if horizon < s.t_s <= now_s)
    return kept[-cfg.max_samples :]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def decide(
    sample: AutoscaleSample,
    current_replicas: int,
    state: AutoscaleState,
    cfg: AutoscaleConfig,
) -> tuple[AutoscaleDecision, AutoscaleState]:
    """One tick at ``now = sample.t_s``; see the module docstring for the rules."""
    check_int("current_replicas", current_replicas, minimum=0)
    now_s = sample.t_s
    samples = _trim((*state.samples, sample), now_s, cfg)
    stable = _stable_window(samples, current_replicas, cfg)
    panic = _panic_window(samples, now_s, current_replicas, state, cfg)
    if panic.until_s is not None:
        desired, reason = _in_panic(panic, stable, current_replicas, state, cfg)
        mode, below_since_s, panic_until_s = "panic", None, panic.until_s
    else:
        desired, below_since_s, reason = _in_stable(stable, now_s, current_replicas, state, cfg)
        mode, panic_until_s = "stable", None
    stable_desired, panic_desired = stable.desired, panic.desired

    decision = AutoscaleDecision(
        desired_replicas=desired,
        mode=mode,
        reason=reason,
        stable_desired=stable_desired,
        panic_desired=panic_desired,
    )
    new_state = AutoscaleState(
        samples=samples,
        panic_until_s=panic_until_s,
        below_since_s=below_since_s,
        last_desired=desired,
    )
    return decision, new_state


class _Stable(NamedTuple):
    desired: int
    basis: str  # how it was reached, for the reason


class _Panic(NamedTuple):
    desired: int
    avg: float
    trigger_at: float
    triggered: bool
    was_in_panic: bool
    until_s: float | None  # None: not in panic


def _stable_window(samples: tuple[AutoscaleSample, ...], current_replicas: int, cfg: AutoscaleConfig) -> _Stable:
    """Concurrency over the stable window, and utilization as a second signal."""
    stable_avg = _mean([s.ongoing_requests for s in samples]) or 0.0
    desired = _ceil(stable_avg / cfg.target_ongoing_requests)
    util_note = ""
    if cfg.target_gpu_util_pct is not None:
        avg_util = _mean([s.gpu_util_pct for s in samples if s.gpu_util_pct is not None])
        if avg_util is not None:
            util_desired = _ceil(current_replicas * avg_util / cfg.target_gpu_util_pct)
            util_note = f", util {avg_util:.1f}%->{util_desired}"
            desired = max(desired, util_desired)
    basis = f"avg {stable_avg:.1f} over {cfg.stable_window_s:g}s / {cfg.target_ongoing_requests:g}{util_note}"
    return _Stable(desired, basis)


def _panic_window(
    samples: tuple[AutoscaleSample, ...],
    now_s: float,
    current_replicas: int,
    state: AutoscaleState,
    cfg: AutoscaleConfig,
) -> _Panic:
    """Concurrency over the panic window (see the module docstring), and whether panic holds."""
    panic_avg = _mean([s.ongoing_requests for s in samples if s.t_s > now_s - cfg.panic_window_s]) or 0.0
    desired = _ceil(panic_avg / cfg.target_ongoing_requests)
    trigger_at = cfg.panic_threshold_ratio * max(current_replicas, 1)
    triggered = desired >= trigger_at
    prior_until_s = state.panic_until_s
    # A deadline more than one stable window ahead can only come from a clock
    # that went backwards; honouring it would pin the panic floor for that long.
    if prior_until_s is not None and prior_until_s > now_s + cfg.stable_window_s:
        prior_until_s = None
    was_in_panic = prior_until_s is not None and now_s < prior_until_s
    until_s = now_s + cfg.stable_window_s if triggered else prior_until_s
    if until_s is not None and now_s >= until_s:
        until_s = None
    return _Panic(desired, panic_avg, trigger_at, triggered, was_in_panic, until_s)


def _in_panic(
    panic: _Panic, stable: _Stable, current_replicas: int, state: AutoscaleState, cfg: AutoscaleConfig
) -> tuple[int, str]:
    """Never down in panic, not even below the last answer while the replicas it asked
    for are still starting; and never fewer than stable mode would ask (Knative's
    max(stable, panic)): panic only adds urgency, it never hides a signal."""
    floor = current_replicas
    if panic.was_in_panic and state.last_desired is not None:
        floor = max(floor, state.last_desired)
    desired = cfg.clamp(max(panic.desired, stable.desired, floor))
    why = (
        f"panic_desired={panic.desired}>={panic.trigger_at:g}"
        if panic.triggered
        else f"panic held until t={panic.until_s:g}s, panic_desired={panic.desired}"
    )
    why += f", stable_desired={stable.desired}"
    return desired, f"panic: {why} (avg {panic.avg:.1f} over {cfg.panic_window_s:g}s) -> {desired}"


def _in_stable(
    stable: _Stable, now_s: float, current_replicas: int, state: AutoscaleState, cfg: AutoscaleConfig
) -> tuple[int, float | None, str]:
    """(desired, below_since_s, reason): up at once, down one step after a full delay."""
    want = cfg.clamp(stable.desired)
    if want >= current_replicas:  # up at once (or hold); any down-streak is interrupted
        desired = cfg.clamp(want)
        verb = "up" if desired > current_replicas else "hold"
        return desired, None, f"stable: {verb} {current_replicas}->{desired} ({stable.basis})"
    start = state.below_since_s
    if start is None or now_s < start:
        start = now_s
    held_s = now_s - start
    if held_s >= cfg.scale_down_delay_s:
        desired = cfg.clamp(max(want, current_replicas - cfg.max_scale_down_step))
        # Still wanting fewer: the next step needs a fresh full delay.
        return (
            desired,
            (now_s if want < desired else None),
            (
                f"stable: down {current_replicas}->{desired} "
                f"after {held_s:g}s>={cfg.scale_down_delay_s:g}s ({stable.basis})"
            ),
        )
    # Still clamp: a current count above max_replicas is cut at once.
    desired = cfg.clamp(current_replicas)
    return (
        desired,
        start,
        (f"stable: hold {desired}, want {want} for {held_s:g}s of {cfg.scale_down_delay_s:g}s ({stable.basis})"),
    )


def queue_length_fallback(total_requests: float, current_replicas: int, cfg: AutoscaleConfig) -> int:
    """Replica count when the controller is unreachable: ceil(total / target), clamped.

    Stateless, so it cannot apply the scale-down delay; rather than flap, it
    never goes below ``current_replicas`` (still clamped to [min, max]).
    Scale-down waits for the controller, which Ray restarts within seconds.
    """
    check_non_negative("total_requests", total_requests)
    check_int("current_replicas", current_replicas, minimum=0)
    return cfg.clamp(max(_ceil(total_requests / cfg.target_ongoing_requests), current_replicas))
