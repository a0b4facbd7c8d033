"""Admission by degradation level × criticality, and the max_tokens clamp.

This runs on the request hot path for every request, so it is a couple of set
lookups and arithmetic: no I/O, no locks, no clock. The level and its
constraints come from the controller's snapshot (or the fail-static
conservative level); this module only applies them.

Retry-After doubles per level above 1 (``base * 2 ** (level - 1)``, capped): at
level 1 only sheddable work is refused and capacity returns quickly, at level 4
the service is in emergency and clients should back off hard. The value is
deterministic; clients (our SDK's adaptive throttle) add their own jitter so
refused clients do not come back in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass

from ballast.policies.criticality import Criticality
from ballast.policies.degradation import MAX_LEVEL, LevelConstraints
from ballast.policies.validation import check_fields, check_int, check_non_negative, check_positive

OVERLOADED = "OVERLOADED"
#: Upper bound on Retry-After so a client never parks for minutes on one refusal.
RETRY_AFTER_CAP_S = 30.0


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    #: Stable error code when refused ("OVERLOADED"), None when admitted.
    code: str | None
    retry_after_s: float | None
    reason: str

    def __post_init__(self) -> None:
        if self.admitted and (self.code is not None or self.retry_after_s is not None):
            raise ValueError("code: an admitted decision carries no code or retry_after_s")
        if not self.admitted and self.code is None:
            raise ValueError("code: a refusal must carry an error code")
        check_fields(self, check_non_negative, "retry_after_s", optional=True)


def retry_after_s(level: int, base_s: float = 1.0, cap_s: float = RETRY_AFTER_CAP_S) -> float:
    """Retry-After for a refusal at ``level``: base at levels 0–1, doubling per level, capped."""
    check_int("level", level, minimum=0, maximum=MAX_LEVEL)
    check_positive("retry_after_base_s", base_s)
    if not cap_s >= base_s:
        raise ValueError(f"retry_after_cap_s: must be >= retry_after_base_s, got {cap_s!r}")
    # Level 0 refusals only happen with a custom level-0 table; treat them as level 1.
    doubled: float = base_s * 2.0 ** max(level - 1, 0)
    return min(doubled, cap_s)


def admit(
    criticality: Criticality,
    level: int,
    constraints: LevelConstraints,
    retry_after_base_s: float = 1.0,
    retry_after_cap_s: float = RETRY_AFTER_CAP_S,
) -> AdmissionDecision:
    """Admit iff ``criticality`` is in ``constraints.admitted``.

    ``constraints`` must be the constraints of ``level``; ``level`` only shapes
    the Retry-After and the message. A plain string is accepted for
    ``criticality`` and parsed (ValueError on an unknown value).
    """
    crit = criticality if isinstance(criticality, Criticality) else Criticality.parse(criticality)
    if crit in constraints.admitted:
        return AdmissionDecision(admitted=True, code=None, retry_after_s=None, reason=f"level {level}")
    if constraints.admitted:
        allowed = ",".join(c.value for c in constraints.admitted_sorted())
        reason = f"level {level} admits only {allowed}; {crit.value} shed"
    else:
        reason = f"level {level} admits no new requests"
    return AdmissionDecision(
        admitted=False,
        code=OVERLOADED,
        retry_after_s=retry_after_s(level, retry_after_base_s, retry_after_cap_s),
        reason=reason,
    )


def clamp_max_tokens(requested: int, constraints: LevelConstraints, model_max_tokens: int) -> tuple[int, bool]:
    """(granted, clamped): the smallest of the request, the level and the model limit.

    ``clamped`` is True when the client gets fewer tokens than it asked for, so
    the router can tell it (a response field / header) instead of truncating silently.
    ``requested`` 0 asks for no token (the prompt's log-probabilities alone): 0 is granted.
    """
    check_int("requested", requested, minimum=0)
    check_int("model_max_tokens", model_max_tokens, minimum=1)
    granted = min(requested, constraints.max_tokens, model_max_tokens)
    return granted, granted < requested
