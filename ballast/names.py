"""The deployments' names, which every part of the server refers to.

The first model keeps the one-model names (``BallastModel``, ``BallastFallbackModel``), so
a one-model config's deployments, dashboards and alerts stay as they were; every other
model's deployment is named after it (``BallastModel-<name>``)."""

from __future__ import annotations

import hashlib
import re

MODEL_DEPLOYMENT = "BallastModel"
FALLBACK_DEPLOYMENT = "BallastFallbackModel"
ROUTER_DEPLOYMENT = "BallastRouter"
CHAOS_TARGETS = {"primary": MODEL_DEPLOYMENT, "fallback": FALLBACK_DEPLOYMENT}

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _suffix(model: str) -> str:
    """``model`` as a deployment name's suffix: itself when it is safe there, else its
    safe characters and a short hash (two names that differ only in unsafe characters
    stay apart)."""
    safe = _UNSAFE.sub("_", model)
    if safe == model:
        return model
    return f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:6]}"


def model_deployment_name(model: str, primary: str) -> str:
    """The Serve deployment serving ``model`` (``primary``: the config's first model)."""
    return MODEL_DEPLOYMENT if model == primary else f"{MODEL_DEPLOYMENT}-{_suffix(model)}"


def fallback_deployment_name(model: str, primary: str) -> str:
    """The Serve deployment serving ``model``'s fallback."""
    return FALLBACK_DEPLOYMENT if model == primary else f"{FALLBACK_DEPLOYMENT}-{_suffix(model)}"
