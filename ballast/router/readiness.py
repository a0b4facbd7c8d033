"""The router's cached readiness: one probe of the model per interval, however many ask.

``/health`` and ``/healthz/ready`` need no key, so their rate is whatever a client
sends; what they cost the model must not follow it. :class:`CachedProbe` holds the
last probe's answer and its start time:

* an answer younger than ``interval_s`` (measured from the start of the probe that
  gave it) is returned as it is, a failure as much as a success;
* an older one (or none) starts one probe, unless one is in flight; every caller in
  the meantime awaits that same probe (``asyncio.shield``: a caller that goes away does
  not cancel it for the others);
* so at most one probe runs at a time and probes start at least ``interval_s`` apart.

A probe is ``probe()`` bounded by ``timeout_s``; any exception it raises (the timeout
included) is the answer "unreachable: <type>". Time comes from an injected clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ballast.policies.validation import check_positive


class CachedProbe:
    """The last probe's problem (None: healthy), refreshed at most once per ``interval_s``."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[object]],
        interval_s: float,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_positive("interval_s", interval_s)
        check_positive("timeout_s", timeout_s)
        self._probe = probe
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._started_s: float | None = None  # when the probe that gave the cached answer started
        self._answer: str | None = None
        self._in_flight: asyncio.Future[str | None] | None = None
        self.probes = 0  # probes started since creation

    async def problem(self) -> str | None:
        """None when the model answered the latest probe, else why not."""
        if self._in_flight is None:
            if self._started_s is not None and self._clock() - self._started_s < self.interval_s:
                return self._answer
            self._in_flight = asyncio.ensure_future(self._run(self._clock()))
        return await asyncio.shield(self._in_flight)

    async def _run(self, started_s: float) -> str | None:
        self.probes += 1
        try:
            try:
                await asyncio.wait_for(self._probe(), timeout=self.timeout_s)
                answer: str | None = None
            except Exception as e:  # any failure is an answer, cached like a success
                answer = f"model deployment unreachable: {type(e).__name__}"
            self._started_s, self._answer = started_s, answer
            return answer
        finally:  # cancelled too: the next caller starts a probe of its own
            self._in_flight = None
