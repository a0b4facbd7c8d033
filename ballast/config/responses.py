"""``responses``: OpenAI's Responses API, its stored responses kept in the batch store.

The per-tenant bounds (``max_stored``, ``max_stored_bytes``) hold for each tenant alike; a
tenant's oldest stored responses are deleted to make room for a new one, and each expires
``ttl_s`` after it was stored (``ballast/batch/store_responses.py``).
"""

from __future__ import annotations

from pydantic import Field

from ballast.config.base import Strict

MIB = 1024 * 1024
DAY_S = 86400.0


class ResponsesConfig(Strict):
    # Keep the responses asked with `store: true` (OpenAI's default) in the batch store
    # (batch.store_url, or the embedded one `make serve` starts), so that
    # `previous_response_id` and GET / DELETE /v1/responses/{id} find them. false: none is kept.
    store: bool = True
    # Per tenant: responses kept, and the bytes of their records; past either, the tenant's
    # oldest are deleted to make room. A response larger than max_stored_bytes alone is not
    # stored (413 PAYLOAD_TOO_LARGE).
    max_stored: int = Field(default=1000, ge=1, le=100_000)
    max_stored_bytes: int = Field(default=64 * MIB, ge=1, le=16 * 1024 * MIB)
    # A stored response is deleted this long after it was stored (on the store's own clock).
    ttl_s: float = Field(default=30 * DAY_S, gt=0, le=365 * DAY_S)
    # A conversation continued by previous_response_id holds at most this many responses
    # (each turn reads the chain before it).
    max_chain_depth: int = Field(default=64, ge=1, le=1024)
    # Items of a request's `input` (messages, function calls and their outputs), at most.
    max_input_items: int = Field(default=256, ge=1, le=10_000)
