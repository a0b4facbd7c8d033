"""The OpenAI protocol module: what a body may hold, the answers' exact shapes, stop
strings, the error body. Pure functions and models; no app, no Ray."""

import json
import pickle
import re

import pytest

from ballast.config import LimitsConfig
from ballast.errors import (
    BallastError,
    ChaosDisabled,
    ConcurrencyLimited,
    ControllerUnavailable,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    KillSwitchActive,
    ModelNotFound,
    ModelUnavailable,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    Unauthenticated,
)
from ballast.model.protocol import RowSampling
from ballast.policies.criticality import Criticality
from ballast.router import openai_answers as answers
from ballast.router import openai_api as oa
from ballast.stops import StopScanner, cut_at_stop

CHAT = {"model": "toy", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "toy", "prompt": "once upon"}


def chat_error(**fields) -> oa.BadRequest:
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_chat({**CHAT, **fields})
    return e.value


def completion_error(**fields) -> oa.BadRequest:
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_completion({**COMPLETION, **fields})
    return e.value


# ------------------------------------------------------------------------------ requests

# A value that asks for the field's effect, for every field Ballast does not serve.
ASKING = {
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "best_of": 2,
    "suffix": "end",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "store": True,
    "web_search_options": {},
}


def test_every_unsupported_field_is_listed_and_tested():
    assert set(ASKING) == set(oa._UNSUPPORTED)


@pytest.mark.parametrize("name", sorted(ASKING))
def test_an_unsupported_field_is_refused_with_its_name(name):
    for err in (chat_error(**{name: ASKING[name]}), completion_error(**{name: ASKING[name]})):
        assert (err.status, err.code, err.field) == (400, "INVALID_REQUEST", name)
        assert err.message.startswith(f"{name}: not supported by Ballast; leave it out")


def test_an_unsupported_field_at_its_neutral_value_or_null_asks_for_nothing():
    neutral = {"logprobs": False, "store": False, "functions": None}
    req = oa.parse_chat({**CHAT, **neutral})
    assert req.messages[0].content == "hi"
    assert oa.parse_completion({**COMPLETION, "best_of": 1, "echo": False, "suffix": None}).prompt == "once upon"


def test_penalties_and_logit_bias_are_the_vllm_engines_and_bounded():
    req = oa.parse_chat({**CHAT, "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"7": -100}})
    sampling = oa.sampling_of(req)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias) == (0.5, -1.0, ((7, -100.0),))
    assert sampling.asks == {"presence_penalty", "frequency_penalty", "logit_bias"}
    assert oa.sampling_of(oa.parse_chat({**CHAT, "presence_penalty": 0, "frequency_penalty": 0.0})) is None  # neutral
    for engine in ("builtin", "transformers"):
        with pytest.raises(oa.BadRequest) as e:
            oa.refuse_unhonoured(req, engine)
        assert e.value.field == "presence_penalty"
    oa.refuse_unhonoured(req, "vllm")
    assert chat_error(presence_penalty=2.5).field == "presence_penalty"
    assert chat_error(logit_bias={"1": 101}).field.startswith("logit_bias")
    assert chat_error(logit_bias={str(i): 1 for i in range(301)}).field == "logit_bias"


def test_the_refusal_says_which_value_is_allowed():
    assert chat_error(store=True).message == "store: not supported by Ballast; leave it out or send false"
    assert chat_error(best_of=3).message == "best_of: not supported by Ballast; leave it out or send 1"


def test_a_count_is_not_false_nor_true_one():
    # /v1/completions' logprobs is a count (0: the sampled tokens' own): true is not one.
    assert completion_error(logprobs=True).field == "logprobs"
    assert oa.parse_completion({**COMPLETION, "logprobs": 0}).logprobs == 0
    assert completion_error(best_of=True).field == "best_of"


def test_a_typo_is_refused_with_its_name():
    err = chat_error(temprature=0.5)
    assert (err.field, err.message) == ("temprature", "temprature: unknown field")
    err = chat_error(messages=[{"role": "user", "content": "hi", "nmae": "bob"}])
    assert err.field == "messages.0.nmae"


def test_a_body_that_is_not_an_object_is_refused_as_body():
    for body in ([CHAT], "hi", None, 3):
        with pytest.raises(oa.BadRequest) as e:
            oa.parse_chat(body)
        assert e.value.field == "body"
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_completion([COMPLETION])
    assert e.value.field == "body"


def test_bad_request_is_an_invalid_request_answered_400_and_survives_pickling():
    err = chat_error(n=9)
    assert isinstance(err, InvalidRequest)
    assert (err.status, err.code) == (400, "INVALID_REQUEST")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.message, back.field) == (oa.BadRequest, err.message, "n")


def test_choices_up_to_the_configured_bound():
    assert (chat_error(n=9).field, chat_error(n=9).message) == (
        "n",
        "n: at most 8 choices a request (limits.max_choices)",
    )
    assert completion_error(n=0).field == "n"
    assert oa.parse_chat({**CHAT, "n": 8}).n == 8
    assert oa.parse_chat({**CHAT, "n": 3}, LimitsConfig(max_choices=3)).n == 3
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_completion({**COMPLETION, "n": 4}, LimitsConfig(max_choices=3))
    assert (e.value.field, e.value.message) == ("n", "n: at most 3 choices a request (limits.max_choices)")


def test_logprobs_echo_and_token_prompts_as_openai_bounds_them():
    chat = oa.parse_chat({**CHAT, "logprobs": True, "top_logprobs": 20})
    assert oa.logprobs_of(chat) == (20, None)
    assert oa.logprobs_of(oa.parse_chat({**CHAT, "logprobs": True})) == (0, None)
    assert oa.logprobs_of(oa.parse_chat({**CHAT, "logprobs": False})) == (None, None)
    assert chat_error(top_logprobs=21).field == "top_logprobs"
    assert chat_error(top_logprobs=2).message == "top_logprobs: needs logprobs true"
    assert chat_error(echo=True).field == "echo"  # a completions field only
    assert chat_error(max_tokens=0).field == "max_tokens"
    done = oa.parse_completion({**COMPLETION, "logprobs": 5, "echo": True, "max_tokens": 0})
    assert (oa.logprobs_of(done), oa.max_tokens_of(done)) == ((5, 5), 0)
    assert oa.logprobs_of(oa.parse_completion({**COMPLETION, "echo": True})) == (None, None)
    assert completion_error(logprobs=21).field == "logprobs"
    assert completion_error(max_tokens=0).message.startswith("max_tokens: must be >= 1 (0 only with echo")
    assert oa.parse_completion({**COMPLETION, "prompt": [5, 6, 7]}).prompt_ids == [5, 6, 7]
    assert oa.parse_completion({**COMPLETION, "prompt": [[5, 6]]}).prompt_ids == [5, 6]
    assert oa.parse_completion({**COMPLETION, "prompt": ["one"]}).prompt_text == "one"
    for bad in ([], [[1], [2]], ["a", "b"], [1, "a"], [True], [-1], [[]], [2**31]):
        assert completion_error(prompt=bad).field == "prompt", bad


def test_stop_is_a_string_or_up_to_four_non_empty_strings():
    err = chat_error(stop=["a", "b", "c", "d", "e"])
    assert err.field == "stop" and "at most 4" in err.message
    assert chat_error(stop="").field == "stop"
    assert chat_error(stop=["a", ""]).field == "stop.1"
    assert chat_error(stop=5).message == "stop: must be a string or a list of at most 4 non-empty strings"
    assert oa.stops_of(oa.parse_chat({**CHAT, "stop": ["a", "b", "c", "d"]})) == ("a", "b", "c", "d")
    assert oa.stops_of(oa.parse_completion({**COMPLETION, "stop": "\n"})) == ("\n",)
    assert oa.stops_of(oa.parse_chat(CHAT)) == ()


def test_stream_options_only_with_stream():
    err = chat_error(stream_options={"include_usage": True})
    assert (err.field, err.message) == ("stream_options", "stream_options: only allowed when stream is true")
    assert completion_error(stream=False, stream_options={"include_usage": True}).field == "stream_options"
    req = oa.parse_chat({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.stream_options.include_usage
    assert chat_error(stream=True, stream_options={"include_usage": True, "extra": 1}).field == "stream_options.extra"


def test_both_token_fields_must_agree():
    err = chat_error(max_tokens=5, max_completion_tokens=6)
    assert err.field == "max_completion_tokens"
    assert err.message == "max_completion_tokens: 6 disagrees with max_tokens 5; send one of them"
    assert oa.max_tokens_of(oa.parse_chat({**CHAT, "max_tokens": 7, "max_completion_tokens": 7})) == 7
    assert oa.max_tokens_of(oa.parse_chat({**CHAT, "max_completion_tokens": 9})) == 9
    assert oa.max_tokens_of(oa.parse_chat({**CHAT, "max_tokens": 8})) == 8
    assert oa.max_tokens_of(oa.parse_chat(CHAT)) is None
    assert oa.max_tokens_of(oa.parse_completion({**COMPLETION, "max_tokens": 4})) == 4
    assert chat_error(max_completion_tokens=0).field == "max_completion_tokens"
    assert completion_error(max_tokens=0).field == "max_tokens"


def test_completions_have_no_max_completion_tokens():
    assert completion_error(max_completion_tokens=5).message == "max_completion_tokens: unknown field"


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"user": "u" * 257}, "user"),
        ({"seed": "abc"}, "seed"),
        ({"model": ""}, "model"),
        ({"criticality": "vip"}, "criticality"),
        ({"stream": "sometimes"}, "stream"),
    ],
)
def test_sampling_fields_are_bounded(fields, field):
    assert chat_error(**fields).field == field
    assert completion_error(**fields).field == field


def test_sampling_fields_within_bounds():
    fields = {"temperature": 0, "top_p": 1, "seed": -3, "user": "u" * 256, "criticality": "sheddable_plus"}
    for req in (oa.parse_chat({**CHAT, **fields}), oa.parse_completion({**COMPLETION, **fields})):
        assert (req.temperature, req.top_p, req.seed, req.criticality) == (0, 1, -3, Criticality.SHEDDABLE_PLUS)
    assert oa.parse_chat(CHAT).criticality is None  # not sent: the header or the default decides


def test_model_is_required():
    assert chat_error(model=None).field == "model"
    with pytest.raises(oa.BadRequest) as e:
        oa.parse_completion({"prompt": "x"})
    assert (e.value.field, e.value.message) == ("model", "model: Field required")


def test_messages_must_not_be_empty():
    assert chat_error(messages=[]).field == "messages"


def test_message_parts_are_joined():
    content = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    req = oa.parse_chat({**CHAT, "messages": [{"role": "user", "content": content}]})
    assert req.messages[0].content == "Hello, world"


def test_the_function_role_is_refused_at_the_role():
    err = chat_error(messages=[{"role": "function", "content": "42"}])
    assert err.field == "messages.0.role"
    assert err.message == "messages.0.role: role 'function' is not served (deprecated); use 'tool'"
    err = chat_error(messages=[{"role": "robot", "content": "x"}])
    assert err.message == "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"


def test_a_part_that_is_not_text_is_refused_at_its_type():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    err = chat_error(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": [image]}])
    assert err.field == "messages.1.content.0.type"
    assert err.message == "messages.1.content.0.type: only 'text' parts are served; got 'image_url'"
    assert chat_error(messages=[{"role": "user", "content": [{"type": "text"}]}]).field == "messages.0.content.0.text"
    err = chat_error(messages=[{"role": "assistant", "content": None}])
    assert (err.field, err.message) == (
        "messages.0.content",
        "messages.0.content: must be a string or a list of text parts "
        "(null only in an assistant message with tool_calls)",
    )


def test_prompt_is_a_string_or_a_list_of_exactly_one():
    assert oa.parse_completion({**COMPLETION, "prompt": ["only"]}).prompt == "only"
    assert oa.parse_completion({**COMPLETION, "prompt": ["only"]}).prompt_text == "only"
    assert oa.parse_completion({**COMPLETION, "prompt": "plain"}).prompt_text == "plain"
    for prompt in (["a", "b"], [], [[1, 2], [3]], None, 7):
        err = completion_error(prompt=prompt)
        message = "prompt: must be a string, token ids, or a list holding exactly one of either (one prompt)"
        assert (err.field, err.message) == ("prompt", message)


def test_every_request_field_is_described_for_the_openapi_document():
    for model in (oa.ChatCompletionRequest, oa.CompletionRequest, oa.ChatMessage, oa.TextPart, oa.StreamOptions):
        schema = model.model_json_schema()
        assert schema["additionalProperties"] is False
        undescribed = [name for name, prop in schema["properties"].items() if not prop.get("description")]
        assert undescribed == [], model.__name__
    content = oa.ChatMessage.model_json_schema()["properties"]["content"]
    assert [branch.get("type") for branch in content["anyOf"]] == ["string", "array", "null"]


# ---------------------------------------------------------------------------- template


def test_render_chat_is_one_block_per_message_and_an_open_assistant_block():
    req = oa.parse_chat(
        {
            "model": "toy",
            "messages": [
                {"role": "developer", "content": "Be terse."},
                {"role": "system", "content": "No emoji."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Two\nlines"},
            ],
        }
    )
    assert oa.render_chat(req.messages) == (
        "<|system|>\nBe terse.\n"
        "<|system|>\nNo emoji.\n"
        "<|user|>\nHi!\n"
        "<|assistant|>\nHello.\n"
        "<|user|>\nTwo\nlines\n"
        "<|assistant|>\n"
    )


# -------------------------------------------------------------------------- stop strings


def stream(chunks, stops):
    """What a client sees: each feed's output, then finish's; and whether it stopped."""
    scanner = StopScanner(stops)
    sent = [scanner.feed(c) for c in chunks]
    sent.append(scanner.finish())
    return sent, scanner.stopped


def test_no_stops_passes_everything_at_once():
    assert stream(["ab", "cd"], []) == (["ab", "cd", ""], False)


def test_a_stop_split_across_chunks_is_held_then_dropped():
    assert stream(["Hello EN", "D more"], ["END"]) == (["Hello ", "", ""], True)


def test_a_partial_stop_that_does_not_complete_is_released():
    # "EN" could begin "END": held; "X" says it does not; the end gives up nothing more.
    assert stream(["Hello EN", "X", "E"], ["END"]) == (["Hello ", "ENX", "", "E"], False)


def test_a_stop_at_the_very_start_emits_nothing():
    assert stream(["END of it", "more"], ["END"]) == (["", "", ""], True)
    assert cut_at_stop("END of it", ["END"]) == ("", True)


def test_nothing_is_emitted_after_the_stop():
    scanner = StopScanner(["."])
    assert scanner.feed("One. Two.") == "One"
    assert scanner.stopped
    assert (scanner.feed("Three"), scanner.finish()) == ("", "")


def test_of_overlapping_stops_the_one_that_completes_first_cuts():
    # "bc" completes at the "c", before "abcd" could: the cut is before "bc".
    assert cut_at_stop("xabcd", ["abcd", "bc"]) == ("xa", True)
    assert stream(["xab", "cd"], ["abcd", "bc"]) == (["x", "a", ""], True)
    # Completing together, the longer one cuts (it started first).
    assert cut_at_stop("xabc", ["bc", "abc"]) == ("x", True)
    # The earlier of two stops cuts, whatever their order in the request.
    assert cut_at_stop("one;two,three", [",", ";"]) == ("one", True)


def test_the_hold_is_only_what_could_begin_a_stop():
    scanner = StopScanner(["<|end|>", "\n\n"])
    assert scanner.feed("a <|en") == "a "
    assert scanner.feed("try\n") == "<|entry"
    assert scanner.feed("\n") == ""
    assert scanner.stopped


@pytest.mark.parametrize(
    "text, stops",
    [
        ("Hello END world", ["END"]),
        ("xabcd", ["abcd", "bc"]),
        ("aaab", ["aab"]),
        ("no stop here", ["zz", "q"]),
        ("ab", ["abc"]),
        ("end", ["end"]),
        ("née ☃ stop", ["☃ s"]),
    ],
)
def test_a_stream_cuts_where_a_unary_answer_does_whatever_the_chunking(text, stops):
    expected = cut_at_stop(text, stops)
    for size in range(1, len(text) + 1):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        sent, stopped = stream(chunks, stops)
        assert ("".join(sent), stopped) == expected, size


def test_an_empty_stop_string_is_a_programming_error():
    with pytest.raises(ValueError):
        StopScanner(["a", ""])


def test_cut_at_stop_without_a_stop():
    assert cut_at_stop("plain", ["x"]) == ("plain", False)
    assert cut_at_stop("plain", []) == ("plain", False)


# ----------------------------------------------------------------------------- responses

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}


def wire(event) -> dict:
    """A streamed event as the client reads it."""
    return json.loads(answers.sse_data(event)[len(b"data: ") :])


def round_trips(model, answer):
    """``answer`` is exactly what ``model`` documents: no key missing, none extra."""
    return model.model_validate(answer).model_dump(exclude_unset=True) == answer


def test_chat_completion_shape():
    answer = answers.chat_completion(
        answers.Ident("chatcmpl-1", 1700000000, "toy"), "Hi!", "stop", answers.Counts(3, 4)
    )
    assert answer == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "toy",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi!", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": USAGE,
    }
    assert round_trips(answers.ChatCompletion, answer)


def test_completion_shape():
    answer = answers.completion(answers.Ident("cmpl-1", 1700000000, "toy"), " there", "length", answers.Counts(3, 4))
    assert answer == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "toy",
        "choices": [{"index": 0, "text": " there", "finish_reason": "length", "logprobs": None}],
        "usage": USAGE,
    }
    assert round_trips(answers.Completion, answer)


def test_chat_chunk_shapes():
    first = wire(answers.stream_chunk(answers.Ident("chatcmpl-1", 5, "toy"), True, "", role=True))
    assert first == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "toy",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        ],
    }
    last = wire(answers.stream_chunk(answers.Ident("chatcmpl-1", 5, "toy"), True, None, "length"))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    usage = wire(answers.usage_chunk(answers.Ident("chatcmpl-1", 5, "toy"), True, answers.Counts(3, 4)))
    assert usage == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "toy",
        "choices": [],
        "usage": USAGE,
    }
    for chunk in (first, wire(answers.stream_chunk(answers.Ident("chatcmpl-1", 5, "toy"), True, "x")), last, usage):
        assert round_trips(answers.ChatCompletionChunk, chunk)


def test_the_answer_says_the_tier_that_served_it_as_openais_types_read_it():
    """Every answer and every event of a stream carries ``service_tier`` when the front
    says it (the routes always do: tests/unit/test_flex.py); OpenAI's own types read it."""
    types = pytest.importorskip("openai.types")
    flex = answers.Ident("chatcmpl-1", 5, "toy", "flex")
    chat = answers.chat_completion(flex, "Hi", "stop", answers.Counts(3, 4))
    assert chat["service_tier"] == "flex" and round_trips(answers.ChatCompletion, chat)
    assert types.chat.ChatCompletion.model_validate(chat).service_tier == "flex"
    chunks = [
        wire(answers.stream_chunk(flex, True, "", role=True)),
        wire(answers.stream_chunk(flex, True, None, "stop")),
        wire(answers.usage_chunk(flex, True, answers.Counts(3, 4))),
    ]
    assert [types.chat.ChatCompletionChunk.model_validate(c).service_tier for c in chunks] == ["flex"] * 3
    events = answers.one_event_stream(flex, True, "Hi", "stop", answers.Counts(3, 4), oa.Streaming(final_usage=True))
    data = [json.loads(line[len(b"data: ") :]) for line in events.split(b"\n\n") if line.startswith(b"data: {")]
    assert [e["service_tier"] for e in data] == ["flex"] * 3
    priority = answers.completion(answers.Ident("cmpl-1", 5, "toy", "priority"), "x", "stop", answers.Counts(3, 1))
    assert priority["service_tier"] == "priority" and round_trips(answers.Completion, priority)
    with pytest.raises(ValueError):  # only the tiers an answer can say
        answers.chat_completion(answers.Ident("chatcmpl-1", 5, "toy", "auto"), "Hi", "stop", answers.Counts(3, 4))


def test_service_tier_is_served_with_openais_values():
    for tier in ("auto", "default", "flex", "priority", "fast"):
        assert oa.parse_chat({**CHAT, "service_tier": tier}).service_tier == tier
        assert oa.parse_completion({**COMPLETION, "service_tier": tier}).service_tier == tier
    assert oa.parse_chat(CHAT).service_tier is None
    err = chat_error(service_tier="scale")
    assert (err.status, err.field) == (400, "service_tier")


def test_completion_chunk_shapes():
    chunk = wire(answers.stream_chunk(answers.Ident("cmpl-1", 5, "toy"), False, "tok"))
    assert chunk == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "toy",
        "choices": [{"index": 0, "text": "tok", "finish_reason": None, "logprobs": None}],
    }
    usage = wire(answers.usage_chunk(answers.Ident("cmpl-1", 5, "toy"), False, answers.Counts(3, 4)))
    assert usage == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "toy",
        "choices": [],
        "usage": USAGE,
    }
    for c in (chunk, wire(answers.stream_chunk(answers.Ident("cmpl-1", 5, "toy"), False, None, "stop")), usage):
        assert round_trips(answers.Completion, c)


def test_a_completion_never_finishes_by_calling_tools():
    """A completion's choice has no "tool_calls" finish (OpenAI's schema); asking for one is a
    programming error, refused before any event is built."""
    ident = answers.Ident("cmpl-1", 5, "toy")
    with pytest.raises(ValueError, match="a completion calls no tools"):
        answers.stream_chunk(ident, False, None, "tool_calls")
    chat = wire(answers.stream_chunk(ident, True, None, "tool_calls"))
    assert chat["choices"][0]["finish_reason"] == "tool_calls"


def test_sse_framing():
    assert answers.sse_data({"a": 1, "b": [1, "é"]}) == b'data: {"a":1,"b":[1,"\\u00e9"]}\n\n'
    assert answers.SSE_DONE == b"data: [DONE]\n\n"
    chunk = answers.stream_chunk(answers.Ident("chatcmpl-1", 5, "toy"), True, "x")
    assert answers.sse_data(chunk) == (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,"model":"toy",'
        b'"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null,"logprobs":null}]}\n\n'
    )


def test_finish_reason():
    assert answers.finish_reason(completion_tokens=16, max_tokens=16, stopped=False) == "length"
    assert answers.finish_reason(completion_tokens=9, max_tokens=16, stopped=False) == "stop"
    assert answers.finish_reason(completion_tokens=16, max_tokens=16, stopped=True) == "stop"


def test_new_id():
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", answers.new_id("chatcmpl"))
    assert re.fullmatch(r"cmpl-[0-9a-f]{24}", answers.new_id("cmpl"))
    assert answers.new_id("cmpl") != answers.new_id("cmpl")


def test_models_list():
    answer = answers.models_list([("llama", None), ("sql", "llama")], 1700000000)
    card = {"object": "model", "created": 1700000000, "owned_by": "ballast"}
    assert answer == {
        "object": "list",
        "data": [
            {"id": "llama", **card, "root": "llama", "parent": None},
            {"id": "sql", **card, "root": "sql", "parent": "llama"},  # an adapter, as vLLM lists it
        ],
    }
    assert round_trips(answers.ModelList, answer)
    assert answers.models_list([], 1) == {"object": "list", "data": []}


def fake_front(request) -> tuple[int, bytes]:
    """A stand-in for the routes, built from this module alone: the SDK's own request
    bodies go through the parsers, the answers through the builders."""
    body = json.loads(request.content or b"null")
    path = request.url.path
    if path == "/v1/models":
        return 200, json.dumps(answers.models_list([("toy", None)], 5)).encode()
    if path == "/v1/completions":
        req = oa.parse_completion(body)
        return 200, json.dumps(
            answers.completion(answers.Ident("cmpl-1", 5, req.model), req.prompt[::-1], "stop", answers.Counts(3, 4))
        ).encode()
    req = oa.parse_chat(body)
    if req.model != "toy":
        raise ModelNotFound.named(req.model, ["toy"])
    if req.criticality is Criticality.SHEDDABLE:
        raise QuotaExceeded("tenant over its token quota", retry_after_s=2)
    text, stopped = cut_at_stop("Hi there. Bye.", oa.stops_of(req))
    reason = answers.finish_reason(len(text), oa.max_tokens_of(req) or 64, stopped)
    if not req.stream:
        return 200, json.dumps(
            answers.chat_completion(
                answers.Ident("chatcmpl-1", 5, req.model), text, reason, answers.Counts(3, len(text))
            )
        ).encode()
    events = [
        wire(answers.stream_chunk(answers.Ident("chatcmpl-1", 5, req.model), True, "", role=True)),
        *(
            wire(answers.stream_chunk(answers.Ident("chatcmpl-1", 5, req.model), True, word))
            for word in text.split(" ")
        ),
        wire(answers.stream_chunk(answers.Ident("chatcmpl-1", 5, req.model), True, None, reason)),
        wire(answers.usage_chunk(answers.Ident("chatcmpl-1", 5, req.model), True, answers.Counts(3, len(text)))),
    ]
    return 200, b"".join(map(answers.sse_data, events)) + answers.SSE_DONE


def test_the_openai_sdk_is_the_contract():
    """The official client talks to ``fake_front`` through a mock transport (no network):
    its request bodies parse, and it reads every answer and error as OpenAI's."""
    openai = pytest.importorskip("openai")
    import httpx2  # the transport of this openai release

    def handle(request):
        try:
            status, content = fake_front(request)
        except BallastError as err:
            status, content = err.status, json.dumps(answers.openai_error_body(err)).encode()
        return httpx2.Response(status, content=content)

    client = openai.OpenAI(
        api_key="k",
        base_url="http://ballast.test/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handle)),
    )
    user = [{"role": "user", "content": "hello"}]

    answer = client.chat.completions.create(model="toy", messages=user, stop=["."], max_completion_tokens=32)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("Hi there", "stop")
    assert answer.usage.total_tokens == 3 + len("Hi there")

    chunks = list(
        client.chat.completions.create(
            model="toy", messages=user, stream=True, stream_options={"include_usage": True}, max_tokens=14, user="u1"
        )
    )
    assert [c.choices[0].delta.content for c in chunks[:-1]] == ["", "Hi", "there.", "Bye.", None]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len("Hi there. Bye.")

    done = client.completions.create(model="toy", prompt="abc", max_tokens=3, temperature=0.2, seed=1)
    assert (done.choices[0].text, done.object) == ("cba", "text_completion")
    assert [m.id for m in client.models.list()] == ["toy"]

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="toy", messages=user, n=9)
    assert (e.value.param, e.value.code, e.value.type) == ("n", "INVALID_REQUEST", "invalid_request_error")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=user)
    assert e.value.body["message"] == "model 'gpt-4o' does not exist or this key may not use it; yours: toy"
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="toy", messages=user, extra_body={"criticality": "sheddable"})
    assert e.value.code == "QUOTA_EXCEEDED"

    # The typed models, validated (the stream above is only constructed by the SDK);
    # its Completion type has a non-null finish_reason, which OpenAI's own chunks break.
    openai.types.chat.ChatCompletionChunk.model_validate(
        wire(answers.stream_chunk(answers.Ident("c", 5, "toy"), True, "x"))
    )
    openai.types.Completion.model_validate(
        wire(answers.usage_chunk(answers.Ident("c", 5, "toy"), False, answers.Counts(3, 4)))
    )
    openai.types.Completion.model_validate(
        wire(answers.stream_chunk(answers.Ident("c", 5, "toy"), False, "x", "length"))
    )


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "err, kind, param",
    [
        (oa.BadRequest("n: Input should be 1", field="n"), "invalid_request_error", "n"),
        (InvalidRequest("prompt: Field required", field="prompt"), "invalid_request_error", "prompt"),
        (InvalidRequest("bad"), "invalid_request_error", None),
        (PayloadTooLarge("body exceeds 1 bytes"), "invalid_request_error", None),
        (Unauthenticated("missing bearer token"), "authentication_error", None),
        (Forbidden("admin only"), "permission_error", None),
        (NotFound("no such route"), "not_found_error", None),
        (ChaosDisabled("chaos is off"), "api_error", None),
        (QuotaExceeded("over quota", retry_after_s=1.5), "rate_limit_error", None),
        (ConcurrencyLimited("too many"), "rate_limit_error", None),
        (Overloaded("level 3", retry_after_s=2), "overloaded_error", None),
        (KillSwitchActive("maintenance"), "service_unavailable_error", None),
        (ModelUnavailable("queue full"), "service_unavailable_error", None),
        (ControllerUnavailable("no controller"), "service_unavailable_error", None),
        (DeadlineExceeded("deadline"), "timeout_error", None),
        (BallastError("boom"), "api_error", None),
    ],
)
def test_openai_error_body(err, kind, param):
    body = answers.openai_error_body(err)
    assert body == {"error": {"message": err.message, "type": kind, "param": param, "code": err.code}}
    assert round_trips(answers.ErrorResponse, body)


def test_unknown_model_names_it_and_the_ones_the_key_may_use():
    err = ModelNotFound.named("gpt-4o", ["toy", "sql"])
    assert isinstance(err, NotFound) and err.status == 404
    assert err.message == "model 'gpt-4o' does not exist or this key may not use it; yours: toy, sql"
    body = answers.openai_error_body(err)["error"]
    assert (body["type"], body["code"]) == ("not_found_error", "model_not_found")  # OpenAI's own code
    assert ModelNotFound.named("x", []).message.endswith("yours: none")


# -------------------------------------------------------------------- vLLM's dialect


def test_the_body_guidellm_sends_is_served():
    # What guidellm 0.8.1 sends (vLLM's extensions beside OpenAI's fields).
    req = oa.parse_chat(
        {
            **CHAT,
            "stream": True,
            "stop": None,
            "ignore_eos": True,
            "max_completion_tokens": 32,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    )
    assert req.ignore_eos and req.stop is None and oa.max_tokens_of(req) == 32
    assert oa.Streaming.of(req) == oa.Streaming(final_usage=True, running_usage=True)
    assert oa.sampling_of(req) == RowSampling(ignore_eos=True)


def test_vllms_sampling_extensions_go_to_the_model_when_they_ask_for_something():
    req = oa.parse_completion(
        {
            **COMPLETION,
            "top_k": 5,
            "min_tokens": 3,
            "max_tokens": 8,
            "repetition_penalty": 1.2,
            "temperature": 0.7,
            "seed": 1,
        }
    )
    assert oa.sampling_of(req) == RowSampling(temperature=0.7, seed=1, repetition_penalty=1.2, top_k=5, min_tokens=3)
    neutral = oa.parse_completion({**COMPLETION, "top_k": -1, "min_tokens": 0, "ignore_eos": False})
    assert oa.sampling_of(neutral) is None  # -1 and 0 mean every token, as in vLLM


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
    ],
)
def test_vllms_extensions_are_bounded(fields, field):
    assert completion_error(**fields).field == field
    if "max_tokens" in fields:  # the chat endpoint's newer name counts the same
        assert chat_error(min_tokens=9, max_completion_tokens=8).field == "min_tokens"


def test_an_engine_that_cannot_honour_a_field_refuses_it_by_name():
    asks = oa.parse_chat({**CHAT, "repetition_penalty": 1.3})
    for engine in ("builtin", "transformers"):
        with pytest.raises(oa.BadRequest) as e:
            oa.refuse_unhonoured(asks, engine)
        assert e.value.field == "repetition_penalty" and engine in e.value.message
    oa.refuse_unhonoured(asks, "vllm")  # vLLM honours it
    oa.refuse_unhonoured(
        oa.parse_chat({**CHAT, "repetition_penalty": 1.0}), "transformers"
    )  # neutral: asks for nothing


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_response_format_goes_to_the_model_as_a_json_schema():
    asks = oa.parse_chat(
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
            },
        }
    )
    assert json.loads(oa.sampling_of(asks).json_schema) == SCHEMA
    any_object = oa.parse_completion({**COMPLETION, "response_format": {"type": "json_object"}})
    assert json.loads(oa.sampling_of(any_object).json_schema) == {"type": "object"}
    text = oa.parse_chat({**CHAT, "response_format": {"type": "text"}})
    assert text.response_format is None and oa.sampling_of(text) is None  # text asks for nothing


@pytest.mark.parametrize(
    "fmt,field",
    [
        ({"type": "json_schema"}, "response_format"),  # the schema is missing
        ({"type": "json_object", "json_schema": {"name": "v", "schema": SCHEMA}}, "response_format"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "v"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "v w", "schema": SCHEMA}}, "response_format.json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "v", "schema": ["not", "an", "object"]}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_malformed_response_format_is_refused_by_its_field(fmt, field):
    assert chat_error(response_format=fmt).field == field


def test_only_the_vllm_engine_honours_a_response_format():
    asks = oa.parse_chat({**CHAT, "response_format": {"type": "json_object"}})
    for engine in ("builtin", "transformers"):
        with pytest.raises(oa.BadRequest) as e:
            oa.refuse_unhonoured(asks, engine)
        assert e.value.field == "response_format"
        assert e.value.message == f"response_format: not honoured by the {engine!r} engine; leave it out"
    oa.refuse_unhonoured(asks, "vllm")
    oa.refuse_unhonoured(oa.parse_chat({**CHAT, "response_format": {"type": "text"}}), "builtin")


def test_a_client_cannot_pick_its_cache_salt():
    for parse, body in ((oa.parse_chat, CHAT), (oa.parse_completion, {"model": "toy", "prompt": "hi"})):
        with pytest.raises(oa.BadRequest) as e:
            parse({**body, "cache_salt": "another tenant's"})
        assert e.value.field == "cache_salt" and "cache group" in str(e.value)


def test_usage_says_the_cached_prompt_tokens_as_openai_does():
    """``prompt_tokens_details.cached_tokens``: the engine's count, never more than the prompt."""
    from openai.types.chat import ChatCompletion

    answer = answers.chat_completion(answers.Ident("chatcmpl-1", 5, "toy"), "hi", "stop", answers.Counts(40, 2, 32))
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert ChatCompletion.model_validate(answer).usage.prompt_tokens_details.cached_tokens == 32
    assert answers.Counts(8, 2, 16).usage().prompt_tokens_details.cached_tokens == 8


def test_every_chunk_carries_the_usage_so_far_when_asked():
    ident = answers.Ident("c", 5, "toy")
    chunk = wire(answers.stream_chunk(ident, True, "hi", usage=answers.Counts(3, 2)))
    assert chunk["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert "usage" not in wire(answers.stream_chunk(ident, True, "hi"))
    events = answers.one_event_stream(
        ident, False, "hi", "stop", answers.Counts(3, 2), oa.Streaming(running_usage=True)
    )
    datas = [json.loads(line[len(b"data: ") :]) for line in events.split(b"\n\n") if line and line != b"data: [DONE]"]
    assert [d["usage"]["completion_tokens"] for d in datas] == [2, 2]


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it_and_metadata_is_bounded():
    req = oa.parse_chat({**CHAT, "reasoning_effort": "none"})
    assert req.template_kwargs == {"enable_thinking": False, "reasoning_effort": "none"}
    own = oa.parse_chat({**CHAT, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}})
    assert own.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}  # the request's own wins
    assert oa.parse_chat(CHAT).template_kwargs is None
    assert chat_error(reasoning_effort="extreme").field == "reasoning_effort"
    with pytest.raises(oa.BadRequest) as e:
        oa.refuse_unhonoured(req, "builtin")
    assert e.value.field == "reasoning_effort"
    oa.refuse_unhonoured(req, "transformers")
    assert oa.parse_chat({**CHAT, "metadata": {"team": "search"}}).metadata == {"team": "search"}
    assert chat_error(metadata={f"k{i}": "v" for i in range(17)}).field == "metadata"
    assert chat_error(metadata={"k": "v" * 513}).field == "metadata"
    assert chat_error(metadata={"k": 1}).field == "metadata.k"
