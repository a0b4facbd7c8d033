"""``watchdog`` and ``chaos``: what watches each model replica from beside it, and the faults
a test stack may inject into it."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from ballast.config.base import Strict, frozen_config, ordered
from ballast.policies.leak import LadderConfig, LeakConfig


class ChaosConfig(Strict):
    """Fault injection in the model deployments: compiled in, off unless enabled here."""

    enabled: bool = False
    max_leak_mb: PositiveInt = 1024  # the injected leak stops growing here


class WatchdogSettings(Strict):
    """One watchdog actor per model replica: memory, threads, fds, heartbeats."""

    enabled: bool = True
    interval_s: PositiveFloat = 1.0  # sampling and heartbeat interval
    # A replica with child processes (vLLM) is measured by their PSS, read from smaps at most
    # this often per process (a read walks the process's page tables: 16-22 ms per vLLM
    # process on a 2-core host); between reads, the last PSS plus what RSS grew since.
    pss_interval_s: PositiveFloat = 10.0
    # Growth while a replica loads and serves its first batches is not a leak: trends
    # start after this many seconds of the replica's life.
    warmup_s: float = Field(default=120.0, ge=0)
    # Hung: the replica's work loop has not moved for this many intervals with work in
    # flight (measured by the replica on its own clock) ...
    hang_missed_heartbeats: PositiveInt = 3
    # ... or no heartbeat arrived for this many intervals, work last seen in flight (an
    # event loop blocked solid). More: a heartbeat crosses processes, and on a busy node
    # it can arrive late while the replica is still working.
    silent_missed_heartbeats: PositiveInt = 10
    leak_window_s: PositiveFloat = 3600.0  # trend window for leak slopes
    leak_min_span_ratio: float = Field(
        default=0.5, gt=0, le=1
    )  # no leak verdict before samples span this much of the window
    leak_r2_threshold: float = Field(default=0.7, gt=0, le=1)  # fit quality below which a slope is noise
    # Fast burn (SRE's short window): a leak that would reach its limit within
    # leak_short_horizon_s is named once leak_short_min_span_s of samples after warm-up
    # show it rising, instead of waiting for half the long window. Clamped to the long
    # window where that is shorter (test and compressed configs).
    leak_short_window_s: PositiveFloat = 300.0
    leak_short_min_span_s: PositiveFloat = 90.0  # evidence needed; longer than a GC tooth
    leak_short_horizon_s: PositiveFloat = 3600.0
    # Slopes (per hour) at or above which a credible trend is a leak. RSS/VRAM in MB.
    rss_leak_mb_per_h: PositiveFloat = 30.0
    vram_leak_mb_per_h: PositiveFloat = 30.0
    threads_leak_per_h: PositiveFloat = 60.0
    fds_leak_per_h: PositiveFloat = 120.0
    rss_limit_mb: PositiveFloat | None = None  # default: the node's total memory
    threads_limit: PositiveInt = 4096
    # The fd limit is the replica process's own RLIMIT_NOFILE soft limit; VRAM's is the GPU's total.
    step_interval_s: PositiveFloat = 60.0  # time one rung of the action ladder gets before the next
    warn_tto_s: PositiveFloat = 6 * 3600.0  # a leak reaching its limit sooner starts the ladder
    critical_tto_s: PositiveFloat = 3600.0  # sooner than this: stop intake and ask for a recycle at once
    warning_ratio: float = Field(default=0.90, gt=0, le=1)  # usage / limit (seed: VRAM warning 90 %)
    critical_ratio: float = Field(default=0.97, gt=0, le=1)  # usage / limit (seed: VRAM critical 97 %)

    @model_validator(mode="after")
    def _order(self) -> WatchdogSettings:
        ordered(self, "warning_ratio", "critical_ratio")
        ordered(self, "critical_tto_s", "warn_tto_s")
        return self

    def leak_config(self) -> LeakConfig:
        short_window_s = min(self.leak_short_window_s, self.leak_window_s)
        return LeakConfig(
            window_s=self.leak_window_s,
            min_span_ratio=self.leak_min_span_ratio,
            r2_threshold=self.leak_r2_threshold,
            short_window_s=short_window_s,
            short_min_span_s=min(self.leak_short_min_span_s, short_window_s),
            short_horizon_s=self.leak_short_horizon_s,
        )

    def ladder_config(self) -> LadderConfig:
        return frozen_config(LadderConfig, self)
