"""``auth``: where the API keys, the admin token and the cache-salt secret come from."""

from __future__ import annotations

from pydantic import Field

from ballast.config.base import Strict


class AuthConfig(Strict):
    # "key=tenant" entries separated by commas or newlines; a key may be given as
    # "sha256:<hex>" so that plaintext keys never sit anywhere.
    api_keys_env: str = "BALLAST_API_KEYS"
    api_keys_file: str | None = None
    admin_token_env: str = "BALLAST_ADMIN_TOKEN"
    admin_token_file: str | None = None
    # Local demo only; refused in production.
    demo_keys: dict[str, str] = Field(default_factory=dict)
    demo_admin_token: str | None = None
    # The secret prefix-cache salts are made with (HMAC of each tenant's cache group); the
    # same on every router. Unset: derived from the admin token.
    cache_salt_secret_env: str = "BALLAST_CACHE_SALT_SECRET"
    cache_salt_secret_file: str | None = None
