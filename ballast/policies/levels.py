"""The degradation levels and what each allows (ballast/policies/degradation.py moves
between them): five levels, 0 (normal) to 4 (emergency), each with the largest
``max_tokens``, the largest batch, whether streaming is allowed and the criticalities
admitted, stricter (or equal) as the level rises."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ballast.policies.criticality import Criticality
from ballast.policies.validation import check_fields, check_int

#: Levels are 0 … MAX_LEVEL inclusive.
MAX_LEVEL = 4
NUM_LEVELS = MAX_LEVEL + 1


def check_level(name: str, value: object) -> None:
    """A level: an int in 0 … MAX_LEVEL (a ValueError naming ``name`` else)."""
    check_int(name, value, minimum=0, maximum=MAX_LEVEL)


# --------------------------------------------------------------------------- constraints


@dataclass(frozen=True)
class LevelConstraints:
    """What is allowed at one degradation level.

    ``admitted`` accepts any iterable of criticalities or their string values
    (so a pydantic model or a JSON list can be passed straight in) and is
    normalised to a ``frozenset[Criticality]``. An empty set means the level
    admits no new requests at all (in-flight work still completes).
    """

    max_tokens: int
    max_batch_size: int
    streaming: bool
    admitted: frozenset[Criticality]

    def __post_init__(self) -> None:
        check_fields(self, check_int, "max_tokens", "max_batch_size", minimum=1)
        if not isinstance(self.streaming, bool):
            raise ValueError(f"streaming: must be a bool, got {self.streaming!r}")
        if isinstance(self.admitted, (str, bytes)) or not isinstance(self.admitted, Iterable):
            raise ValueError(f"admitted: must be a collection of criticalities, got {self.admitted!r}")
        try:
            admitted = frozenset(Criticality(c) for c in self.admitted)
        except ValueError:
            raise ValueError(f"admitted: unknown criticality in {self.admitted!r}") from None
        object.__setattr__(self, "admitted", admitted)

    def admitted_sorted(self) -> list[Criticality]:
        """Admitted classes, most important first (stable for JSON and logs)."""
        return sorted(self.admitted, key=lambda c: c.rank)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "max_batch_size": self.max_batch_size,
            "streaming": self.streaming,
            "admitted": [c.value for c in self.admitted_sorted()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LevelConstraints:
        missing = [k for k in ("max_tokens", "max_batch_size", "streaming", "admitted") if k not in data]
        if missing:
            raise ValueError(f"{missing[0]}: missing from level constraints {dict(data)!r}")
        return cls(
            max_tokens=data["max_tokens"],
            max_batch_size=data["max_batch_size"],
            streaming=data["streaming"],
            admitted=data["admitted"],
        )


_ALL = frozenset(Criticality)

#: Default constraints, level 0 … 4. Level 4 admits nothing new; in-flight work finishes.
DEFAULT_CONSTRAINTS: tuple[LevelConstraints, ...] = (
    LevelConstraints(max_tokens=8192, max_batch_size=32, streaming=True, admitted=_ALL),
    LevelConstraints(
        max_tokens=4096,
        max_batch_size=24,
        streaming=True,
        admitted=_ALL - {Criticality.SHEDDABLE},
    ),
    LevelConstraints(
        max_tokens=2048,
        max_batch_size=16,
        streaming=False,
        admitted=frozenset({Criticality.CRITICAL_PLUS, Criticality.CRITICAL}),
    ),
    LevelConstraints(
        max_tokens=1024,
        max_batch_size=8,
        streaming=False,
        admitted=frozenset({Criticality.CRITICAL_PLUS}),
    ),
    LevelConstraints(max_tokens=512, max_batch_size=4, streaming=False, admitted=frozenset()),
)
