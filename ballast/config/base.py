"""What every section of the config shares: strict, frozen models, an ordering check, and the
one way a policy's frozen config is built from a section's settings."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class Strict(BaseModel):
    """A config section: unknown keys are refused, and a built section does not change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def ordered(settings: BaseModel, *names: str) -> None:
    """Raise ValueError ("a must be <= b") unless the named settings do not decrease."""
    for low, high in zip(names, names[1:]):
        if getattr(settings, low) > getattr(settings, high):
            raise ValueError(f"{low} must be <= {high}")


FrozenConfig = TypeVar("FrozenConfig", bound="DataclassInstance")


def frozen_config(config_cls: type[FrozenConfig], settings: BaseModel, **given: Any) -> FrozenConfig:
    """A frozen config dataclass (a policy's, an engine's) from ``settings``: each of its
    fields that ``given`` does not name (renamed or derived values) is the setting of the
    same name, a list made a tuple; a field with no such setting keeps its default."""
    taken = {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(config_cls)
        if f.name not in given and f.name in type(settings).model_fields
    }
    taken = {name: tuple(v) if isinstance(v, list) else v for name, v in taken.items()}
    return config_cls(**taken, **given)
