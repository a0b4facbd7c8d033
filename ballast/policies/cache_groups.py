"""Which tenants share a prefix cache: cache groups and the salt each one's KV is keyed by.

An engine's prefix cache reuses the KV of a prompt's leading blocks for any later prompt
that starts with the same tokens. Shared between tenants, it is a side channel: a hit skips
the prefill, so the time to a first token tells whether someone else sent a prefix, and a
tenant can recover another's templated prompt block by block. So every call carries its
tenant's **cache group** (by default the tenant alone; an operator may name one group for
several tenants, to share a common system prompt), and the cache is shared within a group
only:

* vLLM takes a ``cache_salt`` per request and mixes it into the hash of the prompt's first
  block, so blocks of two salts never match. The salt is ``HMAC-SHA256(secret, group)``:
  a tenant can neither choose it (the front refuses the field) nor compute another group's.
* Ballast's own view of what a replica holds (``prefix_cache``) keys blocks by the same
  salt, so routing by prefix never sends a probe to where another group's prefix is either.

Pure: the caller passes the secret and the tenants' groups (``TenantConfig.cache_group``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

#: Hex digits of the HMAC a salt keeps (128 bits: no two groups meet by chance).
SALT_HEX = 32
_DOMAIN = b"ballast-cache-salt-v1"


def cache_group(tenant: str, group: str | None) -> str:
    """The group a tenant's prompts are cached in: the one its config names, else its own."""
    return group if group else f"tenant:{tenant}"


def cache_salt(secret: bytes, group: str) -> str:
    """The salt of ``group``'s cache entries: HMAC-SHA256 of the group under ``secret``, in hex."""
    if not secret:
        raise ValueError("secret: a cache salt needs a non-empty secret")
    return hmac.new(secret, b"group:" + group.encode("utf-8"), hashlib.sha256).hexdigest()[:SALT_HEX]


def salts_of(groups: Mapping[str, str | None], secret: bytes) -> dict[str, str]:
    """Each tenant's salt, from its configured group (None: its own), computed once."""
    return {tenant: cache_salt(secret, cache_group(tenant, group)) for tenant, group in groups.items()}


def secret_of(configured: str | None, admin_token: str | None, app_name: str) -> bytes:
    """The key salts are made with: the configured secret; else one derived from the admin
    token (every router holds it, so every router derives the same salts); else, with
    neither, one derived from the app's name. Salts still differ per group in that last
    case: the secret only keeps a tenant from computing another group's salt, and no
    tenant can send a salt of its own."""
    if configured:
        return configured.encode("utf-8")
    base = admin_token if admin_token else f"app:{app_name}"
    return hmac.new(base.encode("utf-8"), _DOMAIN, hashlib.sha256).digest()
