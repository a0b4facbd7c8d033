"""vLLM's own renderer renders the router's chats on the vLLM engine (ballast.router.vllm_render):
the real HfRenderer over the demo tokenizer, no engine. Each vLLM symbol the module relies
on is exercised here: ModelConfig, VllmConfig, RENDERER_REGISTRY.load_renderer,
tokenizer_args_from_config, ChatParams, HfRenderer.render_messages, VLLMClientError."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import pytest

from ballast.config import ModelConfig
from ballast.model.demo import make_tiny_llama
from ballast.model.hf_checkpoint import ChatTemplateError, load_tokenizer, render_chat
from ballast.model.special_tokens import encode_text
from ballast.router.openai_api import BadRequest, ChatMessage
from ballast.router.tokens import model_text

pytest.importorskip("vllm")

from ballast.router.vllm_render import VllmRenderer  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {"name": "w", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("render") / "m")


def renderer(ckpt, template=None, **engine_kwargs):
    """vLLM's renderer of ``ckpt`` with this template, in a directory of its own (vLLM
    caches what it detects of a template by the tokenizer's path)."""
    if template is not None:
        ckpt = Path(shutil.copytree(ckpt, ckpt.parent / f"t{zlib.crc32(template.encode())}", dirs_exist_ok=True))
    tokenizer, _ = load_tokenizer(ckpt)
    if template is not None:
        tokenizer.chat_template = template
    return VllmRenderer(str(ckpt), tokenizer, engine_kwargs), tokenizer


def test_a_conversation_with_a_call_and_its_result_renders_as_transformers_renders_it(ckpt):
    r, tok = renderer(ckpt)
    got = r.render(CONVERSATION, [WEATHER], None)
    assert got == render_chat(tok, CONVERSATION, [WEATHER])
    assert '<tool_call>{"name": "w", "arguments": {"city": "Paris"}}</tool_call>' in got
    assert got.endswith("<|assistant|>\n")


# A template that reads each message's content as parts (Llama 4's, Gemma 3's shape):
# transformers would iterate a string character by character; vLLM's renderer detects it.
PARTS = "{% for m in messages %}[{{ m['role'] }}]{% for p in m['content'] %}{{ p['text'] }}|{% endfor %}{% endfor %}"


def test_a_template_that_reads_content_parts_gets_parts(ckpt):
    r, _ = renderer(ckpt, PARTS)
    assert r.render([{"role": "user", "content": "hello"}], None, None) == "[user]hello|"


# No developer role in this template: vLLM renders developer as system.
ROLES = (
    "{% for m in messages %}{% if m['role'] not in ('system', 'user') %}{{ raise_exception('role ' + m['role']) }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
)


def test_developer_is_system_where_the_template_has_no_developer(ckpt):
    r, _ = renderer(ckpt, ROLES)
    assert r.render([{"role": "developer", "content": "rules"}, {"role": "user", "content": "hi"}], None, None) == (
        "<system>rules<user>hi"
    )


def test_a_template_that_raises_is_a_chat_template_error(ckpt):
    r, _ = renderer(ckpt, ROLES)
    with pytest.raises(ChatTemplateError, match="role assistant"):
        r.render([{"role": "assistant", "content": "x"}], None, None)


THINKING = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"


def test_template_variables_reach_the_template_and_those_it_does_not_read_are_dropped(ckpt):
    r, _ = renderer(ckpt, THINKING)
    turns = [{"role": "user", "content": "q"}]
    assert r.render(turns, None, {"enable_thinking": True, "unread": 1}) == "q<think>"
    assert r.render(turns, None, {"enable_thinking": False}) == "q"


def test_a_special_tokens_text_in_a_message_is_text_not_the_token(ckpt):
    r, tok = renderer(ckpt)
    prompt = r.render([{"role": "user", "content": "a </s> b"}], None, None)
    ids = encode_text(tok, prompt, add_special_tokens=False)
    assert ids.count(tok.eos_token_id) == 1  # the one the template writes after the turn, not the user's


NOTE = "{% if note is defined %}{{ note }}</s>{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_special_tokens_text_in_a_template_variable_is_text_not_the_token(ckpt):
    """A chat_template_kwargs value the template writes into the prompt is escaped as a
    message is; with special_tokens_in_content "control", as it is."""
    r, tok = renderer(ckpt, NOTE)
    turns = [{"role": "user", "content": "q"}]
    ids = encode_text(tok, r.render(turns, None, {"note": "a </s> b"}), add_special_tokens=False)
    assert ids.count(tok.eos_token_id) == 1  # the template's own, after the note
    assert tok.decode(ids) == "a </s> b</s>q"
    nested = r.render(turns, None, {"note": ["</s>", {"k": "</s>"}]})  # values in lists and mappings too
    assert encode_text(tok, nested, add_special_tokens=False).count(tok.eos_token_id) == 1
    path = str(ckpt.parent / f"t{zlib.crc32(NOTE.encode())}")  # renderer()'s copy with this template
    control = VllmRenderer(path, tok, {}, special_tokens_in_content="control")
    assert encode_text(tok, control.render(turns, None, {"note": "a </s> b"}), False).count(tok.eos_token_id) == 2


def test_a_tokenizer_mode_whose_renderer_makes_ids_is_refused_at_start(ckpt):
    tokenizer, _ = load_tokenizer(ckpt)
    with pytest.raises(ValueError, match="tokenizer_mode"):
        VllmRenderer(str(ckpt), tokenizer, {"tokenizer_mode": "deepseek_v32"})


def test_the_router_renders_a_vllm_models_chats_with_vllms_renderer(ckpt, tmp_path):
    text = model_text(ModelConfig(name="m", backend="vllm", path=str(ckpt)))
    assert text.parsing is not None
    msgs = [ChatMessage(role="user", content="hi")]
    assert text.render_chat(msgs) == render_chat(load_tokenizer(ckpt)[0], [{"role": "user", "content": "hi"}])


def test_a_template_that_refuses_the_messages_is_a_400_naming_messages(ckpt, tmp_path):
    strict = Path(shutil.copytree(ckpt, tmp_path / "strict"))
    (strict / "chat_template.jinja").write_text(ROLES)
    text = model_text(ModelConfig(name="m", backend="vllm", path=str(strict)))
    with pytest.raises(BadRequest, match="role assistant") as e:
        text.render_chat([ChatMessage(role="assistant", content="x")])
    assert e.value.field == "messages"
