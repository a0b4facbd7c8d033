"""``service_tier: "flex"`` on the real local stack, driven by the official ``openai`` client:
held (not refused) while its model's level sheds ``sheddable``, answered when the level
falls, and answered 504 when its own deadline passes first. The hold itself is walked
tick by tick in tests/unit/test_flex.py; this shows the whole stack does it."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import BASE, flood, level_raised, model_status, wait_quiet, wait_until

pytestmark = pytest.mark.integration

MODEL = "tiny-decoder"
MESSAGES = [{"role": "user", "content": "Hello"}]


def held_at_raised_level(client: httpx.Client) -> bool:
    """A flex request held (not refused) at a level that sheds its class."""
    model = model_status(client)
    return model["level"] >= 1 and model["flex"]["held"] >= 1


def test_a_flex_request_is_held_while_its_class_is_shed_and_answered_when_the_level_falls(client, ballast):
    # Critical load raises the level (queue thresholds 6/12 in the test config); level 1
    # and up do not admit sheddable, which flex is.
    async def main() -> tuple[openai.APIStatusError, object]:
        sdk = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="dev-key-gold", max_retries=0, timeout=120)
        stop = asyncio.Event()
        load = asyncio.ensure_future(flood(stop))
        try:
            await level_raised(client)
            # 90 s: past resilience.max_deadline_s (60 s here), which does not bound flex.
            kept = asyncio.ensure_future(
                sdk.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=4,
                    service_tier="flex",
                    extra_headers={"X-Request-Timeout-Ms": "90000"},
                )
            )
            await asyncio.to_thread(wait_until, lambda: held_at_raised_level(client), 30, 0.2, "a flex request held")
            # A deadline 5 s past the model's expected service time: held until only that
            # time is left, then answered 504 saying so (the level stays up while the load runs).
            service_ms = (await asyncio.to_thread(model_status, client))["gate"]["expected_service_ms"]
            short = asyncio.ensure_future(
                sdk.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=4,
                    service_tier="flex",
                    extra_headers={"X-Request-Timeout-Ms": str(int(service_ms) + 5000)},
                )
            )
            with pytest.raises(openai.InternalServerError) as late:
                await short
            assert not kept.done()  # the level still sheds sheddable: still held
        finally:
            stop.set()
            await load
        raw = await kept  # the level falls once the load is gone, and the held request runs
        await sdk.close()
        return late.value, raw

    late, raw = asyncio.run(main())
    assert late.status_code == 504 and late.code == "DEADLINE_EXCEEDED" and "held" in late.message
    out = raw.parse()
    assert out.service_tier == "flex" and out.usage.completion_tokens == 4
    assert raw.headers["x-ballast-service-tier"] == "flex" and raw.headers["x-ballast-criticality"] == "sheddable"
    assert raw.headers["x-ballast-level"] == "0"  # run only where sheddable is admitted
    assert model_status(client)["flex"]["held"] == 0
    wait_quiet(client)
