"""Loading the config: from a YAML file, a dict or defaults, every error a ConfigError naming
the file and the field; and the files (config, secrets) read as text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ballast.config.root import BallastConfig
from ballast.errors import ConfigError


def load_config(
    source: str | Path | dict[str, Any] | BallastConfig | None = None,
    *,
    model_dir: str | Path | None = None,
    engine: str = "transformers",
) -> BallastConfig:
    """Build the config from a YAML path, a dict, or defaults; errors name the field.

    ``model_dir`` (``ballast serve --model DIR``, ``make serve MODEL=DIR``) serves that
    Hugging Face directory as the primary model, named after the directory, by ``engine``
    (``--engine``, ``ENGINE=``), with the rest of the config as it is (the fallback
    keeps its own model)."""
    if isinstance(source, BallastConfig) and model_dir is None:
        return source
    if isinstance(source, BallastConfig):
        source = source.model_dump(mode="json")
    data: dict[str, Any]
    where = "config"
    if source is None:
        data = {}
    elif isinstance(source, dict):
        data = source
    else:
        where = str(source)
        try:
            data = yaml.safe_load(read_text(source)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(where, f"not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(where, "top level must be a mapping")
    if model_dir is not None:
        data = with_model_dir(data, model_dir, engine)
    try:
        cfg = BallastConfig.model_validate(data)
        cfg.degradation_config()
        cfg.autoscale_config()
        cfg.recycle.recycle_config()
        cfg.watchdog.leak_config()
        cfg.watchdog.ladder_config()
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        raise ConfigError(where, str(e)) from None
    return cfg


def with_model_dir(data: dict[str, Any], model_dir: str | Path, engine: str = "transformers") -> dict[str, Any]:
    """``data`` with its primary model replaced by the Hugging Face directory ``model_dir``,
    served by ``engine`` ("transformers" or "vllm")."""
    path = Path(model_dir).expanduser().resolve()
    models = data.get("models")
    first = models[0] if isinstance(models, list) and models else data.get("model")
    model = {k: v for k, v in (first or {}).items() if k not in ("checkpoint_path", "checkpoint_format", "seed")}
    if engine != "vllm":
        model.pop("engine_kwargs", None)
        model.pop("adapters", None)
    model.update(backend=engine, path=str(path), name=path.name[:64] or "model")
    if isinstance(models, list) and models:
        return {**{k: v for k, v in data.items() if k != "model"}, "models": [model, *models[1:]]}
    return {**data, "model": model}


def read_text(path: str | Path, what: str = "") -> str:
    """A config or secret file as UTF-8 text; any failure is a ConfigError naming the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(path), f"cannot read {what or 'file'}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(str(path), f"{what or 'file'} is not UTF-8 text") from None
