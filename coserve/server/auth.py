"""API keys and tenants: ``Authorization: Bearer KEY`` names the tenant whose files, jobs and models a call sees."""

from __future__ import annotations

import hmac
from pathlib import Path

from coserve.server.errors import APIError

DEFAULT_TENANT = "default"  # every caller's tenant when the server runs without keys
_TENANT_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def load_keys_file(path: str | Path) -> dict[str, str]:
    """``KEY TENANT`` per line (blank lines and ``#`` comments skipped); errors name the line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--api-keys: cannot read {path} ({e.strerror})") from e
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'KEY TENANT', got {len(parts)} fields")
        key, tenant = parts
        check_tenant(tenant, f"{path}:{number}")
        if key in keys:
            raise ValueError(f"{path}:{number}: this key is already given on another line")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"--api-keys: {path} holds no key")
    return keys


def check_tenant(tenant: str, where: str) -> None:
    if not tenant or len(tenant) > 64 or not set(tenant) <= _TENANT_CHARS:
        raise ValueError(f"{where}: tenant {tenant!r} must be 1-64 letters, digits, '.', '_' or '-'")


class Authenticator:
    """Maps the Authorization header to a tenant; with no keys, every caller is ``default``."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = dict(keys)

    def tenant(self, authorization: str | None) -> str:
        if not self.keys:
            return DEFAULT_TENANT
        if not authorization:
            raise APIError(401, "You didn't provide an API key: send it as 'Authorization: Bearer KEY'",
                           code="missing_api_key")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "The Authorization header must be 'Bearer KEY'", code="invalid_api_key")
        for known, tenant in self.keys.items():  # compare every key in constant time
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
