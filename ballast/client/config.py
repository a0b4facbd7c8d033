"""``ClientConfig``: one frozen dataclass that checks itself where it is built (STYLE 5)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ballast.policies.retry import RetryConfig
from ballast.policies.throttle import ThrottleConfig
from ballast.policies.validation import check_fields, check_int, check_non_negative, check_positive, is_number


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    #: Sent as ``Authorization: Bearer <api_key>``; kept out of repr.
    api_key: str = field(repr=False)
    connect_timeout_s: float = 2.0
    #: Per read (for a stream: between two chunks), not per call.
    read_timeout_s: float = 60.0
    #: Attempts per call, the first included.
    max_attempts: int = 3
    #: Full-jitter backoff cap before the first retry; doubles per retry up to max_backoff_s.
    base_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    #: Retries at most this fraction of the requests seen in the window …
    retry_budget_ratio: float = 0.1
    #: … over the last this many requests (calls) …
    retry_budget_window: int = 1000
    #: … but at least this many retries per window (a fresh client can retry once).
    retry_budget_min_retries: int = 1
    #: A Retry-After (or backoff) longer than this ends the call instead of blocking it.
    max_retry_wait_s: float = 30.0
    #: Adaptive client-side throttling; None disables it.
    throttle: ThrottleConfig | None = field(default_factory=ThrottleConfig)
    #: One throttle per criticality: refusals of sheddable calls (the first the server
    #: sheds) then throttle sheddable calls only, never the critical ones beside them.
    throttle_per_criticality: bool = True
    #: The call's deadline; each attempt sends the time left as X-Request-Timeout-Ms.
    request_timeout_ms: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: must be an http(s) URL, got {self.base_url!r}")
        if not isinstance(self.api_key, str) or not self.api_key.strip() or any(c in self.api_key for c in "\r\n "):
            raise ValueError("api_key: must be a non-empty string without spaces or newlines")
        check_fields(self, check_positive, "connect_timeout_s", "read_timeout_s")
        check_fields(self, check_int, "max_attempts", minimum=1)
        check_fields(self, check_non_negative, "base_backoff_s", "max_backoff_s")
        if self.max_backoff_s < self.base_backoff_s:
            raise ValueError(
                f"max_backoff_s: must be >= base_backoff_s ({self.base_backoff_s}), got {self.max_backoff_s!r}"
            )
        if not is_number(self.retry_budget_ratio) or not 0 <= self.retry_budget_ratio <= 1:
            raise ValueError(f"retry_budget_ratio: must be in [0, 1], got {self.retry_budget_ratio!r}")
        check_fields(self, check_int, "retry_budget_window", minimum=1)
        check_fields(self, check_int, "retry_budget_min_retries", minimum=0)
        check_fields(self, check_positive, "max_retry_wait_s")
        if self.throttle is not None and not isinstance(self.throttle, ThrottleConfig):
            raise ValueError(f"throttle: must be a ThrottleConfig or None, got {self.throttle!r}")
        if self.request_timeout_ms is not None:
            check_fields(self, check_int, "request_timeout_ms", minimum=1)

    def retry_config(self) -> RetryConfig:
        """The backoff math's config (``ballast.policies.retry``); its budget fields are unused here."""
        return RetryConfig(
            max_attempts=self.max_attempts, base_backoff_s=self.base_backoff_s, max_backoff_s=self.max_backoff_s
        )
