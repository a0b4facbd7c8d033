"""The soak's settings: what a compressed day compresses, and its intervals."""

from __future__ import annotations

import pytest
import yaml

from ballast.config import load_config
from loadtest.soak import COMPRESSED, compressed_config, history_interval_s, sample_interval_s


def local() -> dict:
    with open("cluster/local.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_a_compressed_day_compresses_the_replicas_clocks_and_stays_a_valid_config():
    raw = local()
    cfg = load_config(compressed_config(raw, 96))
    w, r = cfg.watchdog, cfg.recycle
    assert w.leak_window_s == pytest.approx(3600 / 96)  # 37.5 s: a verdict after ~19 s of samples
    assert w.warn_tto_s == pytest.approx(6 * 3600 / 96) and w.critical_tto_s == pytest.approx(3600 / 96)
    assert w.step_interval_s == 1.0  # 60 / 96 is under its floor
    assert r.max_age_s == pytest.approx(21600 / 96) and r.forced_max_age_s == pytest.approx(86400 / 96)
    assert r.window_start_hour is None and r.window_end_hour is None  # wall-clock hours: dropped
    # What the soak measures stays in real time, and the input is not changed.
    assert cfg.degradation.stable_window_s == load_config(raw).degradation.stable_window_s
    assert raw == local()


def test_the_leak_of_the_soak_schedule_is_caught_within_the_compressed_day():
    # 750 MB per simulated hour is 20 MB/s at scale 96; against the local 4 GiB budget it
    # reaches the limit in under the compressed warning horizon, so the ladder acts.
    cfg = load_config(compressed_config(local(), 96))
    w = cfg.watchdog
    rss_mb, leak_mb_per_s = 450 + 20 * w.leak_window_s * w.leak_min_span_ratio, 20.0
    tto_s = (w.rss_limit_mb - rss_mb) / leak_mb_per_s
    assert w.critical_tto_s < tto_s < w.warn_tto_s
    # In real time (no compression) the same leak would be 20 MB/s for 75 s: far from a verdict.
    assert load_config(local()).watchdog.leak_window_s * 0.5 > 75


def test_floors_nulls_and_scale_one():
    raw = {"recycle": {"max_age_s": None}, "watchdog": {"leak_window_s": 600}}
    out = compressed_config(raw, 1000)
    assert out["recycle"]["max_age_s"] is None  # off stays off
    assert out["watchdog"]["leak_window_s"] == COMPRESSED[("watchdog", "leak_window_s")]
    assert out["watchdog"]["critical_tto_s"] <= out["watchdog"]["warn_tto_s"]
    load_config(out)
    assert compressed_config(local(), 1) == local()


def test_sample_and_history_intervals_grow_with_the_day():
    assert sample_interval_s(900) == 3.0 and sample_interval_s(86400) == 30.0 and sample_interval_s(60) == 2.0
    assert history_interval_s(900) == 1.0 and history_interval_s(86400) == 10.0
