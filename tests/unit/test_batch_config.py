"""``batch``: defaults, bounds (each error naming its key), unknown keys refused."""

from __future__ import annotations

from typing import Any

import pytest

from ballast.config import BatchConfig, load_config
from ballast.errors import ConfigError


def refusal(batch: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config({"batch": batch})
    return str(e.value)


def test_defaults() -> None:
    b = load_config(None).batch
    assert b == BatchConfig()
    assert b.enabled is True
    assert b.store_url is None  # make serve starts the embedded store
    assert b.key_prefix == "ballast"
    assert b.max_file_bytes == 64 * 1024 * 1024
    assert b.max_file_lines == 50_000
    assert (b.max_attempts, b.backoff_base_s, b.backoff_cap_s) == (3, 1.0, 60.0)
    assert b.claim_idle_s == 60.0
    assert b.completion_windows == ["24h"]
    assert (b.max_files, b.max_stored_bytes, b.max_batches_in_flight) == (100, 256 * 1024 * 1024, 10)
    assert b.file_expiry_s == 30 * 86400
    assert (b.cost, b.flex_max_wait_s) == (0.5, 600.0)
    assert b.window_s("24h") == 86400.0
    assert b.max_queued_lines() == 10 * 50_000


def test_a_store_url_and_its_password_file_load() -> None:
    b = load_config({"batch": {"store_url": "rediss://store.internal:6380/2", "store_password_file": "/s/pw"}}).batch
    assert b.store_url == "rediss://store.internal:6380/2"
    assert b.store_password_file == "/s/pw"


@pytest.mark.parametrize(
    ("batch", "key"),
    [
        ({"max_file_bytes": 200_000_001}, "batch.max_file_bytes"),  # OpenAI's 200 MB
        ({"max_file_bytes": 0}, "batch.max_file_bytes"),
        ({"max_file_lines": 50_001}, "batch.max_file_lines"),  # OpenAI's 50,000
        ({"max_attempts": 0}, "batch.max_attempts"),
        ({"claim_idle_s": -1}, "batch.claim_idle_s"),
        ({"cost": 0}, "batch.cost"),  # batch tokens always count in the quota
        ({"key_prefix": "a:b"}, "batch.key_prefix"),
        ({"completion_windows": []}, "batch.completion_windows"),
        ({"completion_windows": ["1d"]}, "batch.completion_windows"),
        ({"store_url": "http://store:6379"}, "batch.store_url"),
        ({"store_url": "redis://:secret@store:6379/0"}, "batch.store_url"),
        ({"store_url": "redis://store:99999"}, "batch.store_url"),
    ],
)
def test_a_bound_passed_names_its_key(batch: dict[str, Any], key: str) -> None:
    assert key in refusal(batch)


def test_a_password_in_the_url_is_refused_saying_where_it_goes() -> None:
    message = refusal({"store_url": "redis://:pw@store:6379/0"})
    assert "no password in the URL" in message and "store_password_file" in message


@pytest.mark.parametrize(
    ("batch", "says"),
    [
        ({"backoff_base_s": 10.0, "backoff_cap_s": 5.0}, "backoff_base_s must be <= backoff_cap_s"),
        ({"max_batches_in_flight": 20, "max_batches_kept": 10}, "max_batches_in_flight must be <= max_batches_kept"),
        ({"max_files": 20, "max_batches_in_flight": 10}, "max_files must be >= 2 x max_batches_in_flight + 1"),
    ],
)
def test_limits_that_do_not_fit_together(batch: dict[str, Any], says: str) -> None:
    message = refusal(batch)
    assert "batch" in message and says in message


def test_unknown_keys_are_refused() -> None:
    message = refusal({"max_file_megabytes": 10})
    assert "batch.max_file_megabytes" in message and "Extra inputs are not permitted" in message


def test_a_window_not_configured_is_refused() -> None:
    with pytest.raises(ValueError, match="'48h'"):
        BatchConfig().window_s("48h")
    assert BatchConfig(completion_windows=["24h", "48h"]).window_s("48h") == 2 * 86400.0
