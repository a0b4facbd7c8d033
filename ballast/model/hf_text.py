"""The text side of the engines over a Hugging Face tokenizer: transformers and vLLM.

Both engines turn prompts into ids and ids back into text the same way, so that is
written once here, in :class:`TokenizerText`, which each engine holds (composed, not
inherited) and hands its ``ModelBackend`` calls to:

- ``tokenize``: the prompt's ids as the router makes them (``special_tokens.encode_text``,
  the one function both call, so a client's special-token text stays text); no ids is
  :class:`ContextTooLong`;
- ``fit``: a row's ids and max new tokens within the context: max_new_tokens shortened
  to what the context leaves, never lengthened (the router refuses what does not fit
  with a 400 first; this is for a fallback whose context is shorter than the primary's);
  no ids, or no room left for a row that asks for tokens, is :class:`ContextTooLong` (a
  row of max_new_tokens 0, scored for its prompt's log-probabilities, may fill it);
- ``encode``: ``tokenize`` for a row that must fit whole (the benchmarks' and warmup's
  joins): :class:`ContextTooLong` when the prompt and max_new_tokens do not;
- ``stream_decoder``: an :class:`IncrementalDetokenizer` for one row's ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ContextTooLong", "IncrementalDetokenizer", "TokenizerText"]


class ContextTooLong(ValueError):
    """A prompt and its max_new_tokens do not fit the model's context (or the prompt is empty)."""


class IncrementalDetokenizer:
    """Text for a growing list of token ids, emitted piece by piece.

    A byte-level BPE token can hold part of a multi-byte character, so decoding
    each new token alone would print U+FFFD halves. As vLLM and TGI do, the new
    text is the decode of a short window of ids minus the decode of its prefix,
    held back while it ends in U+FFFD (an incomplete character) unless this is
    the last piece. Special tokens (bos, eos, turn markers) decode to nothing.
    The window keeps the last few ids only, so each step costs O(1).
    """

    WINDOW = 6  # ids of context kept before the unread ones (spacing, merges)

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] were emitted and give the context
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)
        return text

    def feed(self, ids: Sequence[int], final: bool = False) -> str:
        self._ids.extend(int(i) for i in ids)
        window = self._ids[self._prefix :]
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(window)
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""  # nothing new yet, or a character still incomplete
        # A window's decode starts with its prefix's for byte-level and sentencepiece
        # tokenizers alike; what is past it is new.
        new = text[len(before) :] if len(text) > len(before) else ""
        self._read = len(self._ids)
        self._prefix = max(0, self._read - self.WINDOW)
        # Drop ids before the window for good: the list stays bounded.
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new


class TokenizerText:
    """One model's tokenizer and context, as its engine's text side (see the module)."""

    def __init__(self, tokenizer: Any, context: int) -> None:
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context must be an int >= 1, got {context!r}")
        self.tokenizer = tokenizer
        self.context = context

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids; ContextTooLong when there are none."""
        from ballast.model.special_tokens import encode_text

        ids = encode_text(self.tokenizer, prompt, add_special_tokens)
        if not ids:
            raise ContextTooLong("the prompt is empty: there is no token to generate from")
        return ids

    def fit(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], int]:
        """(prompt ids, max new tokens) for a row within the context; ContextTooLong for no
        ids, a prompt longer than the context, or no room left for a row of
        ``max_new_tokens`` >= 1 (with 0 it emits nothing: its prompt may fill the context)."""
        _check_max_new_tokens(max_new_tokens)
        kept = [int(i) for i in ids]
        if not kept:
            raise ContextTooLong("the prompt is empty: there is no token to generate from")
        if len(kept) > self.context:
            raise ContextTooLong(
                f"the prompt is {len(kept)} tokens and max_tokens 0: together more than "
                f"the model's context of {self.context} tokens"
            )
        room = self.context - len(kept)
        if room < 1 and max_new_tokens >= 1:
            raise ContextTooLong(f"the prompt is {len(kept)} tokens: no room left in the context of {self.context}")
        return kept, min(max_new_tokens, room)

    def encode(self, prompt: str, max_new_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids for a row of ``max_new_tokens``; ContextTooLong when it is empty
        or prompt + max_new_tokens exceed the context."""
        _check_max_new_tokens(max_new_tokens)
        ids = self.tokenize(prompt, add_special_tokens)
        if len(ids) + max_new_tokens > self.context:
            raise ContextTooLong(
                f"the prompt is {len(ids)} tokens and max_tokens {max_new_tokens}: together more than "
                f"the model's context of {self.context} tokens"
            )
        return ids

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded alone, as vLLM names a log-probability's token
        (``convert_ids_list_to_tokens``: where the tokenizer's pieces mark a leading space
        that decoding one alone drops, the space is kept)."""
        try:
            from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
        except ImportError:  # the [serve] install has no vLLM: decode each alone
            return [self.tokenizer.decode([i]) or "" for i in ids]
        return list(convert_ids_list_to_tokens(self.tokenizer, list(ids)))

    def stream_decoder(self, keep_special_tokens: bool = False) -> IncrementalDetokenizer:
        """Text for one row's ids, piece by piece; ``keep_special_tokens``: their text too."""
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=not keep_special_tokens)


def _check_max_new_tokens(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
