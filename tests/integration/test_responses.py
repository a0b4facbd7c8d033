"""OpenAI's Responses API on the default stack (the built-in engine, the session's batch
store), driven by the official ``openai`` client: a conversation of three turns by
``previous_response_id``, its stored responses read back and deleted, another tenant's id a
404 as an unknown one, streamed events in their order, and the bounds."""

from __future__ import annotations

import openai
import pytest
from conftest import BASE

pytestmark = pytest.mark.integration

MODEL = "tiny-decoder"


def sdk(key: str = "dev-key-gold") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=key, max_retries=0, timeout=60)


def test_a_conversation_of_three_turns_is_kept_read_back_and_deleted(ballast):
    client = sdk()
    first = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=6)
    assert first.object == "response" and first.id.startswith("resp_") and first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens"
    (message,) = first.output
    assert message.type == "message" and message.content[0].text == first.output_text
    # The built-in model's tokens are the prompt's bytes: its chat template, the instructions first.
    assert first.usage.input_tokens == len(b"<|system|>\nBe brief.\n<|user|>\nHello\n<|assistant|>\n")
    assert first.usage.output_tokens == 6 and first.usage.total_tokens == first.usage.input_tokens + 6

    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=4)
    third = client.responses.create(model=MODEL, input="Last.", previous_response_id=second.id, max_output_tokens=4)
    # Each turn prefills the turns before it (the instructions are not carried over a chain).
    turn2 = len(b"<|user|>\nHello\n<|assistant|>\n") + len(first.output_text.encode()) + len(b"\n")
    assert second.usage.input_tokens == turn2 + len(b"<|user|>\nAnd then?\n<|assistant|>\n")
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    got = client.responses.retrieve(second.id)
    assert (got.id, got.output_text, got.previous_response_id) == (second.id, second.output_text, first.id)
    with pytest.raises(openai.NotFoundError):
        sdk("dev-key-free").responses.retrieve(second.id)  # another tenant's: as unknown
    with pytest.raises(openai.NotFoundError):
        sdk("dev-key-free").responses.create(model=MODEL, input="x", previous_response_id=second.id)
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=second.id)
    assert client.responses.retrieve(third.id).id == third.id  # its own record stays

    unkept = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_streamed_response_sends_its_events_in_order_and_is_kept(ballast):
    client = sdk()
    events = list(
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": "Hi"}], max_output_tokens=5, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert last.output_text == text and last.usage.output_tokens == 5
    assert client.responses.retrieve(last.id).output_text == text


def test_the_responses_fields_are_bounded_and_named(ballast):
    client = sdk()
    cases = [
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "previous_response_id": "not-an-id"}, "previous_response_id"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include.0"),
    ]
    for extra, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **extra)
        assert e.value.param == field, (extra, e.value.message)
