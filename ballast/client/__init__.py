"""Python client SDK for Ballast's ``POST /v1/generate``: typed errors, retries, client-side throttling.

Installs without Ray, torch or NVML (``pip install .``): it imports httpx and
the standard-library ``policies`` package only. Two clients with one surface,
``BallastClient`` (``httpx.Client``) and ``AsyncBallastClient``
(``httpx.AsyncClient``)::

    with BallastClient(ClientConfig("http://127.0.0.1:8000", "dev-key-gold")) as client:
        gen = client.generate("Hello", max_tokens=32)            # -> Generation
        with client.stream("Hello") as tokens:                    # -> TokenStream
            for text in tokens:
                print(text, end="")
        print(tokens.done.degradation_level)                      # the `done` payload

Where things are:

* ``errors``   — the typed errors and the one mapping answer → error;
* ``protocol`` — the path, the request body, ``Generation``, ``SSEDecoder``;
* ``config``   — ``ClientConfig``;
* ``budget``   — ``RetryBudgetWindow``;
* ``core``     — every decision both clients share (attempts, retries, deadline,
  throttle, budget, stream parsing) and the retry rules with their reasons;
* ``sync`` / ``aio`` — the two clients: only their send, read and sleep differ.
"""

from ballast.client.aio import AsyncBallastClient, AsyncTokenStream
from ballast.client.budget import RetryBudgetWindow
from ballast.client.config import ClientConfig
from ballast.client.core import MAX_THROTTLES
from ballast.client.errors import (
    BallastClientError,
    ConcurrencyLimited,
    ConnectionFailed,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    KillSwitchActive,
    KillSwitched,
    ModelUnavailable,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    ReplicaLost,
    ServerError,
    ThrottledLocally,
    Unauthenticated,
    Unauthorized,
    error_from_answer,
    error_from_payload,
    is_overload_refusal,
    is_retryable_answer,
    parse_retry_after_header,
)
from ballast.client.protocol import CRITICALITIES, GENERATE_PATH, USER_AGENT, Generation, SSEDecoder
from ballast.client.sync import BallastClient, TokenStream

__all__ = [
    "AsyncBallastClient",
    "AsyncTokenStream",
    "BallastClient",
    "BallastClientError",
    "CRITICALITIES",
    "ClientConfig",
    "ConcurrencyLimited",
    "ConnectionFailed",
    "DeadlineExceeded",
    "Forbidden",
    "GENERATE_PATH",
    "Generation",
    "InvalidRequest",
    "KillSwitchActive",
    "KillSwitched",
    "MAX_THROTTLES",
    "ModelUnavailable",
    "ReplicaLost",
    "Overloaded",
    "PayloadTooLarge",
    "QuotaExceeded",
    "RetryBudgetWindow",
    "SSEDecoder",
    "ServerError",
    "ThrottledLocally",
    "TokenStream",
    "USER_AGENT",
    "Unauthenticated",
    "Unauthorized",
    "error_from_answer",
    "error_from_payload",
    "is_overload_refusal",
    "is_retryable_answer",
    "parse_retry_after_header",
]
