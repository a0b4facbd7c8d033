"""Client-side adaptive throttling (SRE book, "Handling Overload").

A refusal is cheap for the server but not free: when a backend is refusing
most of what it gets, clients that keep sending make it spend its capacity on
saying no. Each client therefore tracks, over the last ``window_s`` (2 minutes
in the book):

* ``requests`` — attempts the application made, *including the ones this
  client rejected locally* without sending them;
* ``accepts`` — attempts the backend accepted (any answer that is not an
  overload refusal: a model error is still the backend doing work),

and rejects each new attempt locally with probability

    p = max(0, (requests − K · accepts) / (requests + 1))

Counting local rejections as requests is deliberate, if counter-intuitive: as
the application's attempt rate rises above what the backend accepts, ``p``
rises with it, and the rate actually sent settles near ``K × accepts``. With
``K = 2`` the client keeps sending up to twice what is accepted, so the
backend still sees enough traffic to show when it has recovered; a smaller K
(down to 1) throttles harder, a larger one more loosely.

Caveats kept from the book: the estimate needs traffic — a client that sends
rarely learns slowly. A request still in flight counts as a request but not
(yet) an accept; with latencies of seconds against a 2-minute window that is
noise, and ``p`` stays 0 until requests exceed ``K × accepts`` anyway.

The math is the pure ``reject_probability``; ``AdaptiveThrottle`` only counts,
in a ``ballast.policies.window.TimeWindow`` of ``ceil(window_s / bucket_s)`` buckets at
most.

Written by hand: no maintained Python library implements this (gRPC's
Go/Java versions are internal to its RLS balancer), and this one needs an
injected clock and rng so tests and the fleet simulator are reproducible.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ballast.policies.validation import check_fields, check_non_negative, check_positive
from ballast.policies.window import TimeWindow

# window_s / bucket_s can land a hair above the integer it means (a window of
# 3 × 0.1 s over 0.1 s buckets is 3.0000000000000004); without this tolerance
# ceil() would keep one bucket more than the window holds.
_EPSILON = 1e-9


@dataclass(frozen=True)
class ThrottleConfig:
    #: Send while requests < k × accepts; the book's default is 2.
    k: float = 2.0
    #: How far back requests and accepts are counted.
    window_s: float = 120.0
    #: Resolution of the window: counts are kept per bucket of this length.
    bucket_s: float = 1.0

    def __post_init__(self) -> None:
        check_fields(self, check_positive, "k")
        # Below 1 the client would reject its own traffic while the backend
        # accepts all of it (requests = accepts > k × accepts).
        if self.k < 1:
            raise ValueError(f"k: must be >= 1, got {self.k!r}")
        check_fields(self, check_positive, "window_s", "bucket_s")
        if self.bucket_s > self.window_s:
            raise ValueError(f"bucket_s: must be <= window_s ({self.window_s}), got {self.bucket_s!r}")

    @property
    def num_buckets(self) -> int:
        """The most buckets the window ever holds: ceil(window_s / bucket_s)."""
        return max(1, math.ceil(self.window_s / self.bucket_s - _EPSILON))


def reject_probability(requests: int, accepts: int, k: float) -> float:
    """max(0, (requests − k · accepts) / (requests + 1)); always in [0, 1)."""
    check_non_negative("requests", requests)
    check_non_negative("accepts", accepts)
    check_positive("k", k)
    return max(0.0, (requests - k * accepts) / (requests + 1))


class AdaptiveThrottle:
    """The client side's counters and the local reject decision. See the module docstring.

    Per call: ``should_send()``; if True, send; if the answer is anything but
    an overload refusal, ``record_accept()``. Nothing is recorded for a
    refusal: the attempt was already counted as a request.

    Counts live in a ``TimeWindow`` of ``num_buckets`` buckets of ``bucket_s``:
    a bucket is forgotten once it is ``num_buckets`` or more behind the current
    one, and created only when something is counted; a clock that steps back
    counts into the newest bucket.

    Not thread-safe: one event-loop thread, no awaits inside (as the breaker).
    """

    def __init__(
        self,
        cfg: ThrottleConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] | None = None,
    ) -> None:
        cfg = ThrottleConfig() if cfg is None else cfg
        if not isinstance(cfg, ThrottleConfig):
            raise ValueError(f"cfg: must be a ThrottleConfig, got {cfg!r}")
        self._cfg = cfg
        self._clock = clock
        # A private generator: each client draws its own rejections (clients
        # that rejected in lockstep would make the backend's load oscillate)
        # without touching the global ``random`` state.
        self._rng = rng if rng is not None else random.Random().random
        # Each sample: (requests, accepts).
        self._window = TimeWindow(cfg.bucket_s, cfg.num_buckets, fields=2)
        self._local_rejects_total = 0

    @property
    def config(self) -> ThrottleConfig:
        return self._cfg

    # ---- counters

    @property
    def requests(self) -> int:
        """Attempts in the window, locally rejected ones included."""
        requests: int = self._window.totals(self._clock())[0]
        return requests

    @property
    def accepts(self) -> int:
        """Attempts the backend accepted, in the window."""
        accepts: int = self._window.totals(self._clock())[1]
        return accepts

    @property
    def local_rejects_total(self) -> int:
        """Attempts rejected locally since creation (a lifetime counter, for metrics)."""
        return self._local_rejects_total

    @property
    def bucket_count(self) -> int:
        """Buckets held now; never more than ``config.num_buckets``."""
        self._window.advance(self._clock())
        return len(self._window)

    def probability(self) -> float:
        """The probability the next ``should_send()`` rejects locally."""
        requests, accepts = self._window.totals(self._clock())
        return reject_probability(requests, accepts, self._cfg.k)

    # ---- decisions

    def should_send(self) -> bool:
        """Count one attempt; return False to reject it locally (drawn with probability p).

        ``p`` is computed from the window *before* this attempt is counted.
        The rng is drawn only when ``p > 0``, so a healthy client costs no draw.
        """
        now_s = self._clock()
        requests, accepts = self._window.totals(now_s)
        p = reject_probability(requests, accepts, self._cfg.k)
        self._window.add((1, 0), now_s)
        if p > 0 and self._rng() < p:
            self._local_rejects_total += 1
            return False
        return True

    def record_accept(self) -> None:
        """The backend accepted a sent attempt (any answer but an overload refusal)."""
        self._window.add((0, 1), self._clock())

    def __repr__(self) -> str:
        requests, accepts = self._window.totals(self._clock())
        return (
            f"AdaptiveThrottle(requests={requests}, accepts={accepts}, local_rejects_total={self._local_rejects_total})"
        )
