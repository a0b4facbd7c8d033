"""Checks that policies' frozen config dataclasses run in ``__post_init__`` (STYLE 5).

One set for every policy, so that a config error reads the same everywhere: the
field's name, what it must be, and what it got. ``bool`` is refused wherever a
number is expected: it is an ``int`` subclass, and ``True`` as a threshold is a
config bug, not 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard


def is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: object) -> TypeGuard[float]:
    return is_number(value) and math.isfinite(value)


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """An int in [minimum, maximum] (no upper bound when ``maximum`` is None)."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name}: must be an int {bound}, got {value!r}")


def check_finite(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not is_finite(value):
        raise ValueError(f"{name}: must be a finite number{_or_none(optional)}, got {value!r}")


def check_positive(name: str, value: object, *, optional: bool = False) -> None:
    """A finite number > 0."""
    if optional and value is None:
        return
    if not is_finite(value) or value <= 0:
        raise ValueError(f"{name}: must be a finite number > 0{_or_none(optional)}, got {value!r}")


def check_non_negative(name: str, value: object, *, optional: bool = False) -> None:
    """A finite number >= 0."""
    if optional and value is None:
        return
    if not is_finite(value) or value < 0:
        raise ValueError(f"{name}: must be a finite number >= 0{_or_none(optional)}, got {value!r}")


def check_ratio(name: str, value: object, *, optional: bool = False) -> None:
    """A share in (0, 1]."""
    if optional and value is None:
        return
    if not is_number(value) or not 0 < value <= 1:
        raise ValueError(f"{name}: must be in (0, 1]{_or_none(optional)}, got {value!r}")


def check_fraction(name: str, value: object) -> None:
    """A share in [0, 1]: unlike ``check_ratio``, 0 (none of it) is allowed."""
    if not is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"{name}: must be in [0, 1], got {value!r}")


def check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty str, got {value!r}")


def check_fields(config: object, check: Callable[..., None], *names: str, **bounds: Any) -> None:
    """``check(name, config.<name>, **bounds)`` for each of ``names``, in order: a config's
    ``__post_init__`` names each field once, and each message still names its field."""
    for name in names:
        check(name, getattr(config, name), **bounds)


def _or_none(optional: bool) -> str:
    return " or None" if optional else ""
