"""Docs generated from code are committed; regenerating them must change nothing."""

from pathlib import Path

from serve_app.config_doc import render

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_matches_the_config_model():
    committed = (ROOT / "docs/configuration.md").read_text()
    assert committed == render(), "docs/configuration.md is stale: run `python -m serve_app.config_doc > docs/configuration.md`"


def test_every_config_field_is_documented():
    from serve_app.config import BallastConfig

    text = render()
    for name in BallastConfig.model_fields:
        assert f"| `{name}` |" in text
    for name in ("resilience.breaker.open_duration_s", "tenants.<name>.rate_tokens_per_s", "degradation.levels[].admitted"):
        assert f"| `{name}` |" in text
