"""OpenAI's ``metadata``: at most 16 pairs, keys of at most 64 characters, values of at
most 512 (the Batch API's and the Responses API's field, OpenAI's bounds on both)."""

from __future__ import annotations

from collections.abc import Mapping

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def metadata_fault(metadata: Mapping[str, str]) -> str | None:
    """Why ``metadata``'s keys or values are past OpenAI's bounds (a message naming the
    field), or None. The count of pairs is the model's ``max_length``, checked first."""
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            return (
                f"metadata: keys of at most {MAX_METADATA_KEY_CHARS} characters, values of at most "
                f"{MAX_METADATA_VALUE_CHARS}"
            )
    return None
