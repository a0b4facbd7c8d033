"""API keys and the admin token: who a request is, from the key it presents.

A tenant is what its key maps to, never something the client names. Keys come from
the config's demo keys (local only), a keys file or the environment, and are held
only as SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from ballast.config import BallastConfig, read_text
from ballast.errors import ConfigError
from ballast.policies.cache_groups import salts_of, secret_of


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def _parse_key_entries(text: str, where: str) -> dict[bytes, str]:
    out: dict[bytes, str] = {}
    # Comments are whole lines, dropped *before* splitting on commas, so that a
    # commented-out line never yields a live key.
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("#")]
    for raw in ",".join(lines).split(","):
        entry = raw.strip()
        if not entry:
            continue
        key, sep, tenant = entry.rpartition("=")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ConfigError(where, "each API key entry must read 'key=tenant' or 'sha256:<hex>=tenant'")
        if key.startswith("sha256:"):
            try:
                digest = bytes.fromhex(key[len("sha256:") :])
            except ValueError:
                raise ConfigError(where, "a sha256: key must be 64 hex digits") from None
            if len(digest) != 32:
                raise ConfigError(where, "a sha256: key must be 64 hex digits")
        else:
            digest = _digest(key)
        out[digest] = tenant
    return out


def _admin_token(cfg: BallastConfig, env: Mapping[str, str]) -> str | None:
    a = cfg.auth
    admin: str | None = a.demo_admin_token
    if a.admin_token_file:
        admin = read_text(a.admin_token_file, "admin token file").strip() or None
    if env.get(a.admin_token_env, "").strip():  # blank means unset, never "admin off"
        admin = env[a.admin_token_env].strip()
    return admin


def cache_salts(cfg: BallastConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each tenant's prefix-cache salt (``ballast.policies.cache_groups``), from its cache
    group and the salt secret: ``auth.cache_salt_secret_file`` or its environment variable,
    else derived from the admin token."""
    env = os.environ if environ is None else environ
    a = cfg.auth
    secret: str | None = None
    if a.cache_salt_secret_file:
        secret = read_text(a.cache_salt_secret_file, "cache salt secret file").strip() or None
    if env.get(a.cache_salt_secret_env, "").strip():
        secret = env[a.cache_salt_secret_env].strip()
    key = secret_of(secret, _admin_token(cfg, env), cfg.app_name)
    return salts_of({name: t.cache_group for name, t in cfg.tenants.items()}, key)


class KeyStore:
    """API keys and the admin token, held only as SHA-256 digests.

    A presented key is hashed, its bucket found by the digest's first 4 bytes (an
    attacker cannot steer a digest, so the bucket leaks nothing), and every entry of
    the bucket is compared with ``hmac.compare_digest``: constant time per
    comparison, and O(1) per request however many keys there are.
    """

    def __init__(self, keys: dict[bytes, str], admin_digest: bytes | None):
        self._buckets: dict[bytes, list[tuple[bytes, str]]] = {}
        for digest, tenant in keys.items():
            self._buckets.setdefault(digest[:4], []).append((digest, tenant))
        self._count = len(keys)
        self._admin = admin_digest

    @classmethod
    def from_config(cls, cfg: BallastConfig, environ: dict[str, str] | None = None) -> KeyStore:
        env = os.environ if environ is None else environ
        a = cfg.auth
        keys: dict[bytes, str] = {}
        for key, tenant in a.demo_keys.items():
            keys[_digest(key)] = tenant
        if a.api_keys_file:
            keys.update(_parse_key_entries(read_text(a.api_keys_file, "API keys file"), a.api_keys_file))
        if env.get(a.api_keys_env):
            keys.update(_parse_key_entries(env[a.api_keys_env], f"${a.api_keys_env}"))
        unknown = sorted(set(keys.values()) - set(cfg.tenants))
        if unknown:
            raise ConfigError("auth", f"API keys map to tenants not in the config: {unknown}")
        admin = _admin_token(cfg, env)
        return cls(keys, _digest(admin) if admin else None)

    def tenant_for(self, presented: str) -> str | None:
        digest = _digest(presented)
        found: str | None = None
        for stored, tenant in self._buckets.get(digest[:4], ()):
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def is_admin(self, presented: str) -> bool:
        return self._admin is not None and hmac.compare_digest(self._admin, _digest(presented))

    def __len__(self) -> int:
        return self._count

    def digests(self) -> list[tuple[bytes, str]]:
        """(SHA-256 digest, tenant) of every API key (the edge vouches for these)."""
        return [entry for bucket in self._buckets.values() for entry in bucket]
