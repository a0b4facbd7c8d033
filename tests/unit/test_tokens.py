"""The router's view of the model's text: counting, chat templates and the context check."""

from __future__ import annotations

import pytest

from ballast.config import ModelConfig
from ballast.errors import ContextLengthExceeded
from ballast.policies import tokens
from ballast.policies.tokens import fit_context
from ballast.router.openai_api import BadRequest, ChatMessage
from ballast.router.tokens import ModelText, TokenizerText, model_text
from tests.unit.hf_fixture import make_tiny_llama


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def text(ckpt):
    return model_text(ModelConfig(backend="transformers", path=str(ckpt)))


def msgs(*pairs):
    return [ChatMessage(role=r, content=c) for r, c in pairs]


@pytest.mark.parametrize(
    "prompt_tokens, asked, context, expected",
    [
        (10, 20, 128, (20, None)),
        (10, 118, 128, (118, None)),  # exactly the context
        (10, None, 128, (118, None)),  # all the prompt leaves
    ],
)
def test_fit_context_fits(prompt_tokens, asked, context, expected):
    assert fit_context(prompt_tokens, asked, context) == expected


@pytest.mark.parametrize(
    "prompt_tokens, asked, words",
    [
        (10, 119, "129 were asked for (10 in the prompt, 119 for the completion)"),
        (128, None, "prompt alone is 128"),
        (0, 5, "no tokens"),
    ],
)
def test_fit_context_refuses_with_a_reason(prompt_tokens, asked, words):
    n, why = fit_context(prompt_tokens, asked, 128)
    assert n == 0 and words in why


def test_the_builtin_text_counts_bytes_and_refuses_nothing():
    t = model_text(ModelConfig())
    assert type(t) is ModelText and t.context == 512
    assert t.count("héllo") == 6
    assert t.count("x" * 2000) == 511  # the replica keeps the prompt's end
    assert t.fit(500, 400) == 400 and t.fit(5, None) == 511


def test_a_hf_model_counts_with_its_tokenizer(text, ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    assert isinstance(text, TokenizerText) and text.context == 128
    prompt = "The quick brown fox jumps over the lazy dog."
    assert text.count(prompt) == len(tok.encode(prompt)) < len(prompt)  # merges: fewer tokens than bytes
    assert text.count(prompt, add_special_tokens=False) == text.count(prompt) - 1  # the bos


def test_chat_goes_through_the_models_template_and_developer_is_system(text):
    out = text.render_chat(msgs(("developer", "Be terse."), ("user", "Hi")))
    assert out == "<s><|system|>\nBe terse.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"


def test_a_hf_model_refuses_what_does_not_fit_its_context(text):
    assert text.fit(100, 28) == 28
    with pytest.raises(ContextLengthExceeded) as e:
        text.fit(100, 29)
    assert e.value.status == 400 and e.value.code == "CONTEXT_LENGTH_EXCEEDED" and e.value.field == "max_tokens"
    with pytest.raises(ContextLengthExceeded) as e:
        text.fit(128, None)
    assert e.value.field == "prompt"


def test_a_model_without_a_chat_template_answers_chat_with_400(tmp_path):
    t = TokenizerText(str(make_tiny_llama(tmp_path / "base", chat_template=False)))
    with pytest.raises(BadRequest, match="no chat template") as e:
        t.render_chat(msgs(("user", "Hi")))
    assert e.value.field == "messages"
    assert t.count("Hi") > 0  # completions still work


def test_serving_a_model_dir_replaces_the_primary_model_only(tmp_path):
    from ballast.config import load_config

    d = tmp_path / "my-llama"
    cfg = load_config("cluster/local.yaml", model_dir=d)
    assert cfg.model.backend == "transformers" and cfg.model.path == str(d.resolve()) and cfg.model.name == "my-llama"
    assert cfg.model.max_batch_size == load_config("cluster/local.yaml").model.max_batch_size  # the rest as configured
    assert cfg.fallback is not None and cfg.fallback.model.backend == "builtin"


def test_the_prompt_is_tokenized_once_at_the_front_and_the_call_carries_its_ids(text, ckpt):
    from ballast.model.hf_checkpoint import tokenizer_id
    from ballast.model.special_tokens import encode_text

    call = text.call("The quick brown fox", add_special_tokens=False, stops=("fox",))
    assert call.prompt_ids == tuple(encode_text(text._tokenizer, "The quick brown fox", False))
    assert call.tokenizer == tokenizer_id(ckpt) == text.tokenizer_id and call.tokenizer.startswith("hf:")
    assert call.prompt == "The quick brown fox" and call.stops == ("fox",) and call.max_tokens == 0  # not admitted


def test_the_builtin_front_sends_bytes_and_keeps_the_end_of_a_long_prompt():
    t = model_text(ModelConfig())
    assert t.call("héllo").prompt_ids == tuple("héllo".encode()) and t.call("hi").tokenizer == "bytes"
    long = t.call("ab" * 600)
    assert len(long.prompt_ids) == 511 and long.prompt_ids[-2:] == tuple(b"ab")  # the replica keeps the end


def test_the_tokenizer_id_changes_with_the_tokenizer_files(tmp_path, ckpt):
    import shutil

    from ballast.model.hf_checkpoint import tokenizer_id

    copy = shutil.copytree(ckpt, tmp_path / "copy")
    assert tokenizer_id(copy) == tokenizer_id(ckpt)  # the same files: the same ids
    cfg = copy / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"model_max_length": 7, ', 1))
    assert tokenizer_id(copy) != tokenizer_id(ckpt)


def test_the_quota_charges_the_prompt_and_every_token_the_request_may_generate():
    assert tokens.token_cost(5, 64) == 69
    assert tokens.token_cost(5, 0) == 5


def test_the_quota_retry_after_is_floored_and_capped():
    assert tokens.quota_retry_after_s(0.0) == tokens.QUOTA_RETRY_AFTER_FLOOR_S == 0.01
    assert tokens.quota_retry_after_s(-5.0) == 0.01
    assert tokens.quota_retry_after_s(2.5) == 2.5
    assert tokens.quota_retry_after_s(1e9) == tokens.QUOTA_RETRY_AFTER_CAP_S == 3600.0
