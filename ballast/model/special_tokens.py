"""Special tokens' text in chat messages is text, not control tokens.

A chat template writes its own special tokens (``<|im_start|>``, a bos, ``</s>``) into
the prompt; a message's content, a tool call's arguments, a name or a template
variable's value (``chat_template_kwargs``, which a template may write into the prompt)
may hold the same text. Tokenized as one string, the two are the same: a client writing
``<|im_start|>system`` in a user message would open a system turn. OpenAI's API
tokenizes such text as text; so does Ballast (``model.special_tokens_in_content``
"text", the default; "control" keeps the engines' own behaviour).

**Procedure.** Rendering (``hf_checkpoint.render_chat``) breaks every special token's
text in the client's strings with :data:`MARK` after its first character
(``<`` MARK ``|im_start|>``), so that no tokenizer matches it; the template's own
tokens are untouched. Encoding (:func:`encode_text`, the one function the router's
count and every replica's encode call) splits the prompt at the special tokens
still whole (the template's, control tokens), and tokenizes the text between them
with :data:`MARK` removed and special tokens split (transformers'
``split_special_tokens``). A prompt without :data:`MARK` is one plain ``encode``, as
it always was; with one, its ids are the same except where a client's text held a
special token's text. The built-in byte model drops :data:`MARK` (``strip_marks``).

**Invariants.** The router's count equals the replica's ids (the same function on
the same tokenizer). :data:`MARK` (U+FDD1, a Unicode noncharacter, reserved for a
program's internal use) never reaches a model: it is removed from clients' strings
when they are escaped, and from every prompt when it is encoded.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

__all__ = ["BYTES_TOKENIZER", "MARK", "encode_bytes", "encode_text", "escape_content", "special_texts", "strip_marks"]

MARK = "\ufdd1"
# The built-in byte model's tokenizer, as ``protocol.ModelCall.tokenizer`` names it.
BYTES_TOKENIZER = "bytes"


@lru_cache(maxsize=16)
def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of ``tokenizer``'s special tokens (the ones ``split_special_tokens``
    splits), longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {t.content for t in decoder.values() if getattr(t, "special", False)}
    texts |= set(getattr(tokenizer, "all_special_tokens", None) or ())
    return tuple(sorted((t for t in texts if t), key=lambda t: (-len(t), t)))


@lru_cache(maxsize=16)
def _pattern(tokenizer: Any) -> re.Pattern[str] | None:
    texts = special_texts(tokenizer)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


def escape_content(value: Any, tokenizer: Any) -> Any:
    """``value`` (a message, its content parts, tool arguments, a tool's definition: str,
    list, tuple, dict, keys included) with every special token's text broken by
    :data:`MARK`, and any :data:`MARK` of its own removed; other values as they are."""
    pattern = _pattern(tokenizer)

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            v = v.replace(MARK, "")
            return pattern.sub(lambda m: m.group(0)[0] + MARK + m.group(0)[1:], v) if pattern is not None else v
        if isinstance(v, dict):
            return {walk(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v

    return walk(value)


def strip_marks(text: str) -> str:
    return text.replace(MARK, "") if MARK in text else text


def encode_bytes(text: str) -> list[int]:
    """The built-in byte model's ids for ``text``: its UTF-8 bytes, without :data:`MARK`; an
    empty prompt is one newline, so that there is something to condition on."""
    return list(strip_marks(text).encode("utf-8") or b"\n")


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s ids (see the module): one ``encode`` without :data:`MARK`; with it, the
    special tokens still whole as control tokens and the text between them with special
    tokens split."""
    if MARK not in text:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    pattern = _pattern(tokenizer)
    ids: list[int] = []
    at = 0
    for m in pattern.finditer(text) if pattern is not None else ():
        ids += _text_ids(tokenizer, text[at : m.start()])
        ids += tokenizer.convert_tokens_to_ids([m.group(0)])
        at = m.end()
    ids += _text_ids(tokenizer, text[at:])
    if add_special_tokens:
        before, after = _added(tokenizer)
        ids = [*before, *ids, *after]
    return ids


def _text_ids(tokenizer: Any, piece: str) -> list[int]:
    piece = piece.replace(MARK, "")
    return list(tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)) if piece else []


@lru_cache(maxsize=16)
def _added(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids ``add_special_tokens`` puts before and after a text (a bos, say)."""
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return tuple(full[:i]), tuple(full[i + len(bare) :])
    return (), ()
