"""Who a request runs as, and which caches it may read: API keys that each name a tenant, and the scopes that keep
one tenant's prefix cache and store of earlier outputs apart from another's.

Keys are held as sha256 digests only (a keys file lists digests, never keys) and a presented key is compared with
every digest in constant time (hmac.compare_digest, no early exit), so neither the file nor the timing gives a key
away. A tenant's scope is folded into its sequences' ids (`<scope>:<id>`, core/rows.cache_scope), so the target's
and the draft's prefix caches fork only within a scope; the same scope keys the store of earlier outputs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from .app_config import TenantsConfig
from .http_api import ApiError

KEYS_FILE_ENV = "S2D_API_KEYS_FILE"
KEY_ENV = "S2D_API_KEY"
DEFAULT_TENANT = "default"  # the tenant of the single `api_key` / $S2D_API_KEY
TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class KeyEntry(BaseModel):
    """One line of the keys file."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(description="Tenant name (letters, digits, `.`, `_`, `-`; at most 64).")
    sha256: str = Field(description="Hex sha256 of the key (`printf %s KEY | sha256sum`).")
    operator: bool = Field(False, description="May read /stats and /metrics (every tenant's figures).")

    @field_validator("tenant")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TENANT_NAME.match(v):
            raise ValueError(f"tenant name {v!r}: use 1-64 letters, digits, '.', '_' or '-'")
        return v

    @field_validator("sha256")
    @classmethod
    def _digest(cls, v: str) -> str:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", v):
            raise ValueError("sha256 must be 64 hex digits (the digest of the key, not the key)")
        return v.lower()


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(min_length=1, description="The keys, several per tenant allowed (rotation).")


@dataclass(frozen=True)
class Tenant:
    name: str  # "" for the one anonymous tenant of an app without keys
    operator: bool = False


ANONYMOUS = Tenant("", operator=True)  # no keys configured: one tenant, every surface open


def read_keys_file(path: str) -> list[KeyEntry]:
    """The entries of a keys file; a clear error naming the file and the field otherwise."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"tenants.keys_file {path}: {type(exc).__name__}: {exc}") from None
    try:
        return KeysFile.model_validate(data).keys
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"tenants.keys_file {path}: {where}: {first['msg']}") from None


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantKeys:
    """Bearer key -> Tenant, over sha256 digests."""

    def __init__(self, entries: list[tuple[bytes, Tenant]], isolation: str = "tenant") -> None:
        self._entries, self.isolation = entries, isolation

    @classmethod
    def from_config(cls, api_key: SecretStr | None, tenants: TenantsConfig) -> "TenantKeys":
        """`api_key` (else $S2D_API_KEY) as tenant `default`, plus the keys file (else $S2D_API_KEYS_FILE)."""
        entries: list[tuple[bytes, Tenant]] = []
        key = api_key.get_secret_value() if api_key else os.environ.get(KEY_ENV)
        if key:
            entries.append((digest(key), Tenant(DEFAULT_TENANT, operator=True)))
        path = tenants.keys_file or os.environ.get(KEYS_FILE_ENV)
        if path:
            entries += [(bytes.fromhex(e.sha256), Tenant(e.tenant, e.operator)) for e in read_keys_file(path)]
        return cls(entries, tenants.isolation)

    @property
    def open(self) -> bool:
        """No keys: every request is the anonymous tenant."""
        return not self._entries

    @property
    def names(self) -> list[str]:
        return sorted({t.name for _, t in self._entries})

    def authenticate(self, request: Request) -> Tenant:
        """The tenant of `Authorization: Bearer <key>`; 401 for a missing or unknown key (no key configured: open)."""
        if self.open:
            return ANONYMOUS
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        presented = digest(token.strip())
        found = None
        for known, tenant in self._entries:  # every digest compared, so the time does not say which one matched
            if hmac.compare_digest(presented, known) and found is None:
                found = tenant
        if scheme.lower() != "bearer" or found is None:
            raise ApiError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)",
                           "invalid_api_key", type_="authentication_error")
        return found

    def require_operator(self, request: Request) -> Tenant:
        """An operator's key (every tenant's figures: /stats, /metrics): 401 without a valid key, 403 for a tenant's."""
        tenant = self.authenticate(request)
        if not tenant.operator:
            raise ApiError(403, "this key is not an operator key (tenants.keys_file `operator: true`)",
                           "permission_denied", type_="permission_error")
        return tenant

    def cache_scope(self, tenant: str | None, cache_salt: str | None) -> str:
        """The prefix-cache scope of a request: its tenant (under isolation `tenant`) and its `cache_salt`, hashed
        (bounded, and free of the ':' that ends a scope in a seq id); "" is the shared scope."""
        parts = [(tenant or "") if self.isolation == "tenant" else "", cache_salt or ""]
        if not any(parts):
            return ""
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def scoped_seq_id(scope: str, seq_id: str) -> str:
    """A seq id the caches read as belonging to `scope` (core/rows.cache_scope)."""
    return f"{scope}:{seq_id}" if scope else seq_id


def end_user_scope(*identities: str | None) -> str | None:
    """A digest of the client's end-user ids (`user`, `safety_identifier`) for the store of earlier outputs under
    `suffix.scope: api_key`; None when it gives none."""
    if not any(identities):
        return None
    return hashlib.sha256(json.dumps([i or "" for i in identities]).encode()).hexdigest()[:32]


def store_scope(cache_scope: str, end_user: str | None) -> str:
    """The scope in the store of earlier outputs: the request's cache scope, narrowed to its end user if given."""
    return f"{cache_scope}/{end_user}" if end_user else cache_scope
