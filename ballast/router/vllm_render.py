"""A chat on the vLLM engine rendered by vLLM's own renderer, as ``vllm serve`` renders it.

At router start, for a ``backend: vllm`` model, vLLM's config of the model
(``vllm.config.ModelConfig`` over the local directory, ``tokenizer_mode`` and
``trust_remote_code`` from ``model.engine_kwargs``; no weights are read) and its
renderer (``vllm.renderers.registry.RENDERER_REGISTRY.load_renderer``, over the router's
own tokenizer). Each chat is rendered by ``render_messages``: vLLM's message parsing
(content parts joined or kept as the template expects, ``developer`` as ``system`` where
the template has no such role, a call's arguments as a mapping), its choice of the
template (a tokenizer's ``tool_use`` template when tools are sent) and its filter of
``chat_template_kwargs`` (variables the template does not read are dropped).

The router keeps the rest of its split: it renders to text and tokenizes that text once
(``ballast.router.tokens``); a special token's text in the messages, tools and
``chat_template_kwargs`` values is escaped first as on every engine
(``special_tokens.escape_content``). Only vLLM's Hugging Face renderer renders
to text: a model whose tokenizer mode picks another (Mistral's ``tekken``, DeepSeek V3.2's
encoder) is refused at start, naming the mode.

vLLM symbols used: ``vllm.config.ModelConfig``, ``vllm.config.VllmConfig``,
``vllm.renderers.registry.RENDERER_REGISTRY`` (``load_renderer``),
``vllm.tokenizers.registry.tokenizer_args_from_config``, ``vllm.renderers.ChatParams``,
``HfRenderer.render_messages``, ``vllm.exceptions.VLLMClientError``; each is exercised
by ``tests/unit/test_vllm_render.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["VllmRenderer"]


class VllmRenderer:
    """vLLM's renderer for one model (the module docstring)."""

    def __init__(
        self, path: str, tokenizer: Any, engine_kwargs: Mapping[str, Any], special_tokens_in_content: str = "text"
    ) -> None:
        from vllm.config import ModelConfig, VllmConfig
        from vllm.renderers.registry import RENDERER_REGISTRY
        from vllm.tokenizers.registry import tokenizer_args_from_config

        # vLLM's own default (None: the model's context) where engine_kwargs give none; its
        # field is annotated int, so it is passed only when given.
        max_len = engine_kwargs.get("max_model_len")
        given: dict[str, Any] = {} if max_len is None else {"max_model_len": max_len}
        config = ModelConfig(
            model=path,
            tokenizer=path,
            tokenizer_mode=str(engine_kwargs.get("tokenizer_mode", "auto")),
            trust_remote_code=bool(engine_kwargs.get("trust_remote_code", False)),
            **given,
        )
        mode, *_ = tokenizer_args_from_config(config)
        if mode != "hf":
            raise ValueError(
                f"model.engine_kwargs.tokenizer_mode: vLLM renders this model with its {mode!r} renderer, "
                "which makes token ids, not text; Ballast's router serves models vLLM renders as text (mode 'hf')"
            )
        self._tokenizer = tokenizer
        self._escape = special_tokens_in_content == "text"
        self._renderer = RENDERER_REGISTRY.load_renderer(mode, VllmConfig(model_config=config), tokenizer)

    def render(
        self,
        turns: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        """The prompt text for ``turns`` (OpenAI's message shape), with the generation
        prompt; ``ChatTemplateError`` when the template refuses them. Special tokens' text
        in the turns, the tools and the template variables' values is escaped first
        (``model.special_tokens_in_content`` "text")."""
        import jinja2
        from vllm.exceptions import VLLMClientError
        from vllm.renderers import ChatParams

        from ballast.model.hf_checkpoint import ChatTemplateError
        from ballast.model.special_tokens import escape_content

        if self._escape:
            turns = escape_content(list(turns), self._tokenizer)
            tools = escape_content(list(tools), self._tokenizer) if tools else None
            template_kwargs = {k: escape_content(v, self._tokenizer) for k, v in (template_kwargs or {}).items()}
        kwargs = {**(template_kwargs or {}), "tools": list(tools) if tools else None}
        kwargs.update(add_generation_prompt=True, tokenize=False)
        params = ChatParams(chat_template=None, chat_template_content_format="auto", chat_template_kwargs=kwargs)
        try:
            _, prompt = self._renderer.render_messages(list(turns), params)
        except (VLLMClientError, ValueError, TypeError, KeyError, jinja2.TemplateError) as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
        text = prompt.get("prompt")
        if not isinstance(text, str):  # a renderer that tokenized: not one start lets through
            raise ChatTemplateError("vLLM's renderer gave token ids, not text")
        return text
