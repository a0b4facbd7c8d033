"""``batch``: OpenAI's Batch API and the flex tier, on a durable queue (Redis or Valkey Streams).

The per-tenant limits (``max_files``, ``max_stored_bytes``, ``max_batches_in_flight``,
``max_batches_kept``) hold for each tenant alike. The store's password never sits in the
config: it comes from the environment variable ``store_password_env`` names, else from
``store_password_file`` (what ``make serve`` writes for its embedded store).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from pydantic import Field, PositiveFloat, field_validator, model_validator

from ballast.config.base import Strict, ordered

# OpenAI's bounds on a batch input file: 200 MB and 50,000 lines.
MAX_FILE_BYTES = 200_000_000
MAX_FILE_LINES = 50_000
MIB = 1024 * 1024
DAY_S = 86400.0
WINDOW = re.compile(r"^[1-9][0-9]{0,3}h$")


class BatchConfig(Strict):
    enabled: bool = True
    # The durable store: redis://host:port/db or rediss:// (TLS), no password in the URL.
    # null: `make serve` starts an embedded redis-server (data under .run/redis/, append-only
    # file on) and points the routers at it; elsewhere (serve deploy, a cluster) write one.
    store_url: str | None = Field(default=None, min_length=1, max_length=512)
    store_password_env: str = "BALLAST_STORE_PASSWORD"
    store_password_file: str | None = Field(default=None, min_length=1, max_length=4096)
    # Every store call (connect, command) gives up after this long: 503 STORE_UNAVAILABLE.
    store_timeout_s: float = Field(default=5.0, gt=0, le=60)
    # Keys are "<key_prefix>:<app_name>:...", so stacks can share one server.
    key_prefix: str = Field(default="ballast", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    # One input file (OpenAI: at most 200 MB and 50,000 lines).
    max_file_bytes: int = Field(default=64 * MIB, ge=1, le=MAX_FILE_BYTES)
    max_file_lines: int = Field(default=MAX_FILE_LINES, ge=1, le=MAX_FILE_LINES)
    # A line that fails retryably (engine lost, 5xx, timeout) is tried this many times in all,
    # with full-jitter backoff between (base x 2^attempt, at most the cap), then dead-lettered.
    max_attempts: int = Field(default=3, ge=1, le=20)
    backoff_base_s: PositiveFloat = 1.0
    backoff_cap_s: float = Field(default=60.0, gt=0, le=3600)
    # A line handed to a router and not acknowledged for this long is taken by another
    # router (its first router is taken for dead): the queue's visibility timeout. Keep it
    # above the longest a router holds a line (its deadline, or a retry's wait up to
    # backoff_cap_s): a line held longer is run twice (its answer is still written once).
    claim_idle_s: float = Field(default=60.0, ge=0, le=DAY_S)
    # The completion windows a batch may ask (OpenAI's is "24h"): whole hours.
    completion_windows: list[str] = Field(default_factory=lambda: ["24h"], min_length=1, max_length=8)
    # Per tenant: files held (uploads and batch results), their bytes, batches not finished,
    # and batch records kept (the oldest finished ones go first).
    max_files: int = Field(default=100, ge=3, le=10_000)
    max_stored_bytes: int = Field(default=256 * MIB, ge=1, le=1024 * 1024 * MIB)
    max_batches_in_flight: int = Field(default=10, ge=1, le=1000)
    max_batches_kept: int = Field(default=1000, ge=1, le=100_000)
    # A file uploaded without expires_after, and a batch's output and error files, expire
    # (and are deleted with their data) this long after they are made.
    file_expiry_s: float = Field(default=30 * DAY_S, gt=0, le=365 * DAY_S)
    # Batch tokens count in the tenant's quota at this multiple of their cost.
    cost: float = Field(default=0.5, gt=0, le=10)
    # Batch rows beside interactive ones make each engine step slower: they are kept to the
    # rows at which an interactive step is at most step_slack slower than the step of the
    # interactive rows alone, counted at their recent high (a high quantile over reference_s)
    # where that is more: the day's peak sets how slow batch may make the valley
    # (ballast/policies/spare.py).
    step_slack: float = Field(default=0.1, ge=0, le=10)
    reference_s: float = Field(default=DAY_S, gt=0, le=30 * DAY_S)
    # A flex request (service_tier "flex") waits for spare capacity at most this long
    # unless its timeout header says less.
    flex_max_wait_s: float = Field(default=600.0, gt=0, le=DAY_S)

    @field_validator("store_url")
    @classmethod
    def _a_store_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as e:
            raise ValueError(f"not a URL: {e}") from None
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ValueError("write redis://host:port/db or rediss://host:port/db")
        if parts.password is not None:
            raise ValueError("no password in the URL: put it in $store_password_env or store_password_file")
        return v

    @field_validator("completion_windows")
    @classmethod
    def _windows(cls, v: list[str]) -> list[str]:
        odd = [w for w in v if not WINDOW.match(w)]
        if odd:
            raise ValueError(f"{odd}: a window is whole hours, like '24h'")
        if len(set(v)) != len(v):
            raise ValueError("a window is written once")
        return v

    @model_validator(mode="after")
    def _limits_fit(self) -> BatchConfig:
        ordered(self, "backoff_base_s", "backoff_cap_s")
        ordered(self, "max_batches_in_flight", "max_batches_kept")
        if self.max_files < 2 * self.max_batches_in_flight + 1:
            raise ValueError(
                "max_files must be >= 2 x max_batches_in_flight + 1 (each batch in flight holds room for "
                "its output and error files, and its input file is one)"
            )
        return self

    def window_s(self, window: str) -> float:
        """The seconds of a completion window this config allows (ValueError for another)."""
        if window not in self.completion_windows:
            raise ValueError(f"completion_window {window!r}: one of {self.completion_windows}")
        return float(window[:-1]) * 3600.0

    def max_queued_lines(self) -> int:
        """A tenant's lines on the queues and dead-letter queues together, at most."""
        return self.max_batches_in_flight * self.max_file_lines
