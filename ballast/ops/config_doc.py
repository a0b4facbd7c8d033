"""Render docs/configuration.md from the config model itself, so the reference cannot drift.

``python -m ballast.ops.config_doc > docs/configuration.md``; a unit test regenerates it
and fails on any difference. Units come from the names (STYLE 3: ``_s``, ``_ms``,
``_pct``, ``_ratio``, ``_bytes``, ``_per_s``...).
"""

import enum
import types
import typing
from typing import Any, get_args, get_origin

from pydantic import BaseModel

from ballast.config import BallastConfig

UNITS = [
    ("_tokens_per_s", "tokens/s"),
    ("_per_s", "per second"),
    ("_ms", "milliseconds"),
    ("_s", "seconds"),
    ("_pct", "percent"),
    ("_ratio", "ratio (0-1 unless stated)"),
    ("_bytes", "bytes"),
    ("_mb", "MiB"),
    ("_tokens", "tokens"),
]


def _unit(name: str) -> str:
    for suffix, unit in UNITS:
        if name.endswith(suffix) or f"{suffix}_" in name:
            return unit
    return ""


def _type(ann: Any) -> str:
    origin = get_origin(ann)
    if origin is typing.Annotated:  # PositiveFloat and friends
        return _type(get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):  # Optional[X] and X | None
        args = [a for a in get_args(ann) if a is not type(None)]
        return " or ".join(_type(a) for a in args) + " or null"
    if origin is typing.Literal:
        return " / ".join(repr(a) for a in get_args(ann))
    if origin in (list, tuple):
        args = [a for a in get_args(ann) if a is not Ellipsis]
        return f"{origin.__name__} of {_type(args[0])}" if args else origin.__name__
    if origin is dict:
        k, v = get_args(ann)
        return f"map {_type(k)} → {_type(v)}"
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " / ".join(repr(m.value) for m in ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _default(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], BaseModel):
        return f"({len(value)} entries, see cluster/local.yaml)"
    if isinstance(value, dict) and not value:
        return "{}"
    return repr(value)


def _model_of(ann: Any) -> Any:
    for a in get_args(ann) or (ann,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _rows(model: type[BaseModel], prefix: str, out: list[str], instance: Any = None) -> None:
    if instance is None:
        try:
            instance = model()
        except Exception:  # a section with required fields: no defaults to show
            instance = None
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if field.is_required():
            default = "required"
        else:
            value = getattr(instance, name) if instance is not None else field.get_default(call_default_factory=True)
            default = f"`{_default(value)}`"
        out.append(f"| `{path}` | {_type(ann)} | {_unit(name)} | {default} |")
        origin = get_origin(ann)
        if origin is dict and _model_of(get_args(ann)[1]):
            _rows(_model_of(get_args(ann)[1]), f"{path}.<name>.", out)
        elif origin is list and get_args(ann) and _model_of(get_args(ann)[0]):
            _rows(_model_of(get_args(ann)[0]), f"{path}[].", out)
        elif _model_of(ann):
            value = getattr(instance, name, None) if instance is not None else None
            if value is None and field.default_factory is None and not field.is_required():
                value = field.default  # an optional section: show what enabling it gives
            if value is None:
                try:
                    value = _model_of(ann)()
                except Exception:
                    value = None
            _rows(_model_of(ann), f"{path}.", out, value if isinstance(value, BaseModel) else None)


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from `ballast/config/` by `python -m ballast.ops.config_doc`; a test fails",
        "when this file and the code disagree. One YAML file (`cluster/local.yaml`, or the",
        "`args.config` of `cluster/serve_config.yaml`) holds these keys; unknown keys are refused,",
        "and every error names its field. The comments in `ballast/config/` and",
        "`cluster/local.yaml` say what each option is for.",
        "",
        "| key | type | unit | default |",
        "|---|---|---|---|",
    ]
    _rows(BallastConfig, "", out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
