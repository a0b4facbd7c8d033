"""Docs generated from code are committed; regenerating them must change nothing."""

from pathlib import Path

from ballast.ops.config_doc import render

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_matches_the_config_model():
    committed = (ROOT / "docs/configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: run `python -m ballast.ops.config_doc > docs/configuration.md`"
    )


def test_every_config_field_is_documented():
    from ballast.config import BallastConfig

    text = render()
    for name in BallastConfig.model_fields:
        assert f"| `{name}` |" in text
    for name in (
        "resilience.breaker.open_duration_s",
        "tenants.<name>.rate_tokens_per_s",
        "degradation.levels[].admitted",
    ):
        assert f"| `{name}` |" in text


def test_committed_dashboards_match_the_code():
    from ballast.ops.dashboards import OUT, render_all

    rendered = render_all()
    assert rendered
    for name, text in rendered.items():
        assert (OUT / name).read_text() == text, f"{name} is stale: run `python -m ballast.ops.dashboards`"
    assert sorted(p.name for p in OUT.glob("*.json")) == sorted(rendered)
