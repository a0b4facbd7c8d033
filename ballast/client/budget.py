"""The retry budget: retries at most a fraction of the calls over a count-based window."""

from __future__ import annotations

import math
from collections import deque

from ballast.policies.validation import check_int, is_number

# floor(ratio × requests) landing a hair below an integer (0.1 × 30 = 3.0000000000000004
# is fine, 0.29 × 100 = 28.999999999999996 is not) would lose a whole retry.
EPSILON = 1e-9


class RetryBudgetWindow:
    """Retries at most ``ratio`` × requests over the last ``window`` requests, at least ``min_retries``.

    Requests are counted by sequence number; each granted retry is stamped with
    the sequence number current when it was granted and ages out once ``window``
    newer requests were seen. (With calls in flight concurrently the stamp is the
    newest call's number, not necessarily the retried call's; the error is at
    most the number of calls in flight.) Bounded: the deque never holds more
    stamps than the limit, which is at most ``max(min_retries, ratio × window)``.
    Not locked itself: ``ClientCore`` holds the lock around it.
    """

    def __init__(self, ratio: float, window: int, min_retries: int) -> None:
        if not is_number(ratio) or not 0 <= ratio <= 1:
            raise ValueError(f"ratio: must be in [0, 1], got {ratio!r}")
        check_int("window", window, minimum=1)
        check_int("min_retries", min_retries, minimum=0)
        self._ratio = ratio
        self._window = window
        self._min_retries = min_retries
        self._requests_total = 0
        self._retry_stamps: deque[int] = deque()
        #: Monotonic counters for metrics.
        self.retries_granted = 0
        self.retries_denied = 0

    def _expire(self) -> None:
        oldest_kept = self._requests_total - self._window  # stamps <= this are out of the window
        while self._retry_stamps and self._retry_stamps[0] <= oldest_kept:
            self._retry_stamps.popleft()

    def on_request(self) -> None:
        self._requests_total += 1
        self._expire()

    def requests_in_window(self) -> int:
        return min(self._requests_total, self._window)

    def retries_in_window(self) -> int:
        self._expire()
        return len(self._retry_stamps)

    def limit(self) -> int:
        return max(self._min_retries, math.floor(self._ratio * self.requests_in_window() + EPSILON))

    def try_acquire_retry(self) -> bool:
        if self.retries_in_window() < self.limit():
            self._retry_stamps.append(self._requests_total)
            self.retries_granted += 1
            return True
        self.retries_denied += 1
        return False

    def snapshot(self) -> dict[str, int]:
        return {
            "requests_in_window": self.requests_in_window(),
            "retries_in_window": self.retries_in_window(),
            "retry_limit": self.limit(),
            "retries_granted": self.retries_granted,
            "retries_denied": self.retries_denied,
        }
