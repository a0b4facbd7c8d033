"""Request criticality: how much a request matters when capacity runs short.

The four classes follow the convention used by large RPC stacks (critical_plus,
critical, sheddable_plus, sheddable). Degradation levels admit a subset of them;
``rank`` orders them so that lists can be rendered most-important-first.
"""

from __future__ import annotations

import enum

#: The header a request names its class in (HAProxy reads it too: ballast/router/edge.py).
CRITICALITY_HEADER = "x-ballast-criticality"


class Criticality(str, enum.Enum):
    """Criticality of one request; ``str`` so it round-trips through JSON as-is."""

    CRITICAL_PLUS = "critical_plus"
    CRITICAL = "critical"
    SHEDDABLE_PLUS = "sheddable_plus"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        """0 for the most important class (critical_plus) … 3 for sheddable."""
        return _RANK[self]

    @classmethod
    def parse(cls, value: str | Criticality | None) -> Criticality:
        """Parse a client-supplied value; ``None`` means the default class.

        Raises ValueError (naming the field) for an unknown string so the HTTP
        layer can answer 400 instead of silently treating it as the default.
        """
        if value is None:
            return DEFAULT_CRITICALITY
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(c.value for c in cls)
            raise ValueError(f"criticality: {value!r} is not one of {allowed}") from None

    def __str__(self) -> str:  # the value, not "Criticality.CRITICAL", in messages
        return self.value


# Declaration order is importance order; kept as a dict so ``rank`` is O(1).
_RANK: dict[Criticality, int] = {c: i for i, c in enumerate(Criticality)}

DEFAULT_CRITICALITY: Criticality = Criticality.CRITICAL


class ClaimError(ValueError):
    """A class claim that cannot stand, with the request field to name."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def claimed(header: str | None, from_body: Criticality | None) -> Criticality:
    """The class a request claims: the ``X-Ballast-Criticality`` header or the body's
    field (both must agree when both are given), else the default."""
    if header is None:
        return from_body or DEFAULT_CRITICALITY
    try:
        from_header = Criticality(header.strip())
    except ValueError:
        allowed = ", ".join(c.value for c in Criticality)
        raise ClaimError(f"X-Ballast-Criticality: must be one of {allowed}", "X-Ballast-Criticality") from None
    if from_body is not None and from_body is not from_header:
        raise ClaimError("criticality: the body and the X-Ballast-Criticality header disagree", "criticality")
    return from_header


def lower_criticality(claimed: Criticality, cap: Criticality) -> tuple[Criticality, bool]:
    """(granted, lowered): a claim above what the tenant may claim is lowered to its cap
    (rank 0 is the most critical), and the router says so in the answer."""
    if claimed.rank < cap.rank:
        return cap, True
    return claimed, False
