"""What the router knows of the model's text: its context, its tokenizer, its chat template.

Tokens are the model's tokens: the quota, the answer's usage
and the metrics count with the model's own tokenizer, and chat messages become a
prompt through the model's own chat template. The router therefore loads the
primary model's tokenizer (not its weights) at start, from the same local directory
the replicas load, and checks each prompt against the context before any work.

* ``builtin``: one token per UTF-8 byte, the built-in template
  (``openai_api.render_chat``); a prompt longer than the context loses its start (here
  to ``context - 1`` bytes, at the replica to what its max_tokens leaves), so nothing
  is refused.
* ``transformers``: the tokenizer and template of ``model.path``; prompt + max_tokens
  beyond the context is ``400 CONTEXT_LENGTH_EXCEEDED``.
* ``vllm``: the same tokenizer and context, the chat rendered by vLLM's own renderer
  (``ballast.router.vllm_render``), as ``vllm serve`` renders it.

The prompt is tokenized here, once: the call carries its ids (``ModelText.call``) and
the replica prefills them as they are when its engine has the same tokenizer
(``tokenizer_id``); the count is the number of those ids. A chat prompt already holds
its special tokens (the template wrote them): it is encoded without adding more
(``add_special_tokens`` False in the call).
A special token's text in the messages themselves (content, tool arguments, names,
tools) is text, not a control token, unless ``model.special_tokens_in_content`` is
"control" (``ballast.model.special_tokens``); the count here and the replica's ids
come from the same ``encode_text``, so they agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ballast.config import ModelConfig
from ballast.errors import ContextLengthExceeded
from ballast.model.protocol import ModelCall
from ballast.model.special_tokens import BYTES_TOKENIZER, encode_bytes, encode_text
from ballast.policies import tokens as token_policy
from ballast.policies.engines import capabilities

if TYPE_CHECKING:
    from ballast.router.chat_parsing import ChatParsing

__all__ = ["ModelText", "model_text"]


class ModelText:
    """The built-in byte model's text: bytes are tokens, the built-in chat template."""

    strict = False  # the replica keeps the end of a prompt that is too long
    tokenizer_id = BYTES_TOKENIZER  # whose ids ``encode`` makes (``protocol.ModelCall.tokenizer``)

    def __init__(self, context: int, vocab_size: int = 256) -> None:
        self.context = context
        self.vocab_size = vocab_size  # token ids a resumed stream may carry are below it

    parsing: ChatParsing | None = None  # vLLM's parsers for the model, vLLM's only

    def render_chat(
        self,
        messages: Sequence[Any],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages``; ``tools`` and ``template_kwargs`` (None here: the
        built-in template takes neither, and the fronts refuse them for this engine)."""
        from ballast.router.openai_api import render_chat

        return render_chat(messages)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids as the replica prefills them: its bytes, at most its last
        ``context - 1`` (the replica keeps the end of a prompt that is too long)."""
        return encode_bytes(prompt)[-(self.context - 1) :]

    def count(self, prompt: str, add_special_tokens: bool = True) -> int:
        return len(self.encode(prompt, add_special_tokens))

    def call(self, prompt: str, add_special_tokens: bool = True, **fields: Any) -> ModelCall:
        """The model call for ``prompt``, tokenized here once: the replica prefills these ids."""
        ids = tuple(self.encode(prompt, add_special_tokens))
        return ModelCall(prompt, ids, self.tokenizer_id, add_special_tokens, **fields)

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids (a client's prompt sent as ids) as text: bytes, undecodable ones U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def call_ids(self, ids: Sequence[int], **fields: Any) -> ModelCall:
        """The model call for a prompt a client sent as this model's token ids (each below
        ``vocab_size``: the front checked), prefilled as they are; its text for a model of
        another tokenizer (a fallback) and for echo."""
        return ModelCall(self.decode(ids), tuple(ids), self.tokenizer_id, False, **fields)

    def fit(self, prompt_tokens: int, asked: int | None) -> int:
        """The max_tokens to ask for: what was asked, else all the model allows."""
        if not self.strict:
            return asked if asked is not None else self.context - 1
        max_tokens, why = token_policy.fit_context(prompt_tokens, asked, self.context)
        if why is not None:
            raise ContextLengthExceeded(
                why, field="max_tokens" if asked is not None and prompt_tokens < self.context else "prompt"
            )
        return max_tokens


class TokenizerText(ModelText):
    """A Hugging Face model's text: its tokenizer, its chat template, its context."""

    strict = True

    def __init__(
        self,
        path: str,
        context: int | None = None,
        special_tokens_in_content: str = "text",
        vllm: ModelConfig | None = None,
    ) -> None:
        from ballast.model.hf_checkpoint import load_tokenizer, tokenizer_id

        tokenizer, info = load_tokenizer(path)
        super().__init__(min(context or info.context_length, info.context_length), info.vocab_size)
        self.tokenizer_id = tokenizer_id(path)
        self._tokenizer = tokenizer
        self._special_tokens_in_content = special_tokens_in_content
        self._vllm_renderer: Any | None = None
        if vllm is not None:  # vLLM's renderer and parsers for the model, loaded now (seconds)
            from ballast.router.chat_parsing import ChatParsing
            from ballast.router.vllm_render import VllmRenderer

            self._vllm_renderer = VllmRenderer(path, tokenizer, vllm.engine_kwargs, special_tokens_in_content)
            self.parsing = ChatParsing(tokenizer, vllm.tool_parser, vllm.reasoning_parser, model_name=path)

    def render_chat(
        self,
        messages: Sequence[Any],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        from ballast.model.hf_checkpoint import ChatTemplateError, render_chat
        from ballast.router.openai_api import BadRequest

        if not getattr(self._tokenizer, "chat_template", None):  # a base model: completions only
            raise BadRequest("this model has no chat template; send a prompt to /v1/completions", field="messages")
        try:
            turns = [_turn(m) for m in messages]
            if self._vllm_renderer is not None:
                return str(self._vllm_renderer.render(turns, tools, template_kwargs))
            return render_chat(self._tokenizer, turns, tools, self._special_tokens_in_content, template_kwargs)
        except ChatTemplateError as e:
            raise BadRequest(f"messages: {e.reason}", field="messages") from None

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids, as every engine of this tokenizer encodes text
        (``special_tokens.encode_text``)."""
        return encode_text(self._tokenizer, prompt, add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))


def _turn(m: Any) -> dict[str, Any]:
    """A message as chat templates take it: developer as system; a tool call's arguments
    as a mapping (templates write them out; the request carries JSON text), as vLLM
    passes them."""
    turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
    if m.tool_calls:
        turn["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets the text as it came


def model_text(m: ModelConfig) -> ModelText:
    """The router's view of the model ``m`` names (its tokenizer is loaded here, at start)."""
    if m.backend in ("transformers", "vllm"):
        assert m.path is not None  # the config's validator
        # vLLM serves at most its max_model_len, which may be shorter than the model's.
        return TokenizerText(
            m.path,
            m.engine_kwargs.get("max_model_len"),
            m.special_tokens_in_content,
            m if capabilities(m.backend).tool_parsing else None,
        )
    return ModelText(m.architecture.max_seq_len)
