"""Stop strings: cut a text, or a stream of text pieces, at the first stop string.

Shared by the OpenAI front (which cuts what it sends) and the model replica (which
ends the row there, so no step is spent past a stop).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopScanner", "cut_at_stop"]


def _stop_start(text: str, stops: Sequence[str]) -> int | None:
    """Where the stop string that completes first in ``text`` starts (None: none does);
    of two completing at once, the longer (it started first)."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(hits)[1] if hits else None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(the text before the first stop string, whether one was found), for unary answers."""
    start = _stop_start(text, stops)
    return (text, False) if start is None else (text[:start], True)


class StopScanner:
    """Cuts a streamed answer at its first stop string.

    Invariant: everything ``feed`` has returned is free of stop strings and of the
    start of one; what might still become a stop is held back until the next chunk
    says, or ``finish`` gives it up at the end. Once ``stopped``, nothing more is emitted.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (with what was held) that is safe to send now."""
        if self.stopped:
            return ""
        pending = self._held + text
        start = _stop_start(pending, self._stops)
        if start is not None:
            self.stopped, self._held = True, ""
            return pending[:start]
        keep = self._partial_stop_len(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def finish(self) -> str:
        """What was held back; the stream ended without completing a stop."""
        rest, self._held = self._held, ""
        return rest

    def _partial_stop_len(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for n in range(min(longest, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self._stops):
                return n
        return 0
