"""The app's credentials: API keys for both public APIs (vLLM's `--api-key`) and the engines'
shared KV secret. Neither is kept in plain text where Serve keeps a replica's arguments (its
checkpoint, in Redis with GCS fault tolerance).

API keys come from the app argument `api_key` (one key or a list; `pdserve serve --api-key`,
repeatable) and the environment variable `PDSERVE_API_KEY` (comma-separated; on Kubernetes it
comes from a Secret, so no key sits in the serve config, which Serve logs when it builds the
app). Several keys may be live at once. `build_app` binds only HMAC-SHA256 digests under a salt
drawn for that build; a caller's key is digested the same way and compared, in constant time,
against every digest. No message names the key a caller sent.

HTTP: every route but `/health` needs `Authorization: Bearer KEY` (401 otherwise, OpenAI's error
shape, `WWW-Authenticate: Bearer`). gRPC: `Generate`, `Abort` and `ModelInfo` need metadata
`authorization: Bearer KEY` (UNAUTHENTICATED otherwise); `Health` stays open, as `/health`
does, for probes and load balancers.

The KV secret: the app argument `kv_secret`, else `$PDSERVE_KV_SECRET`, else drawn once per
build. From the environment it is not bound at all: the replicas get a reference and read the
variable when they start (every node has it, from the same Secret).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

API_KEY_ENV = "PDSERVE_API_KEY"
KV_SECRET_ENV = "PDSERVE_KV_SECRET"
# Bound in place of a KV secret that every node has in its environment.
KV_SECRET_FROM_ENV = "$" + KV_SECRET_ENV
AUTHORIZATION = "authorization"  # the HTTP header, and the gRPC metadata key (lower case)
MISSING = "missing API key: send the header 'Authorization: Bearer <key>'"
WRONG = "invalid API key"


def configured_keys(api_key: str | list[str] | None, environ: Mapping[str, str]) -> list[str]:
    """The keys of the app argument and of $PDSERVE_API_KEY (ValueError for an empty one)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if not all(isinstance(key, str) for key in keys):
        raise ValueError("api_key must be a string or a list of strings")
    if any(not key.strip() for key in keys):
        raise ValueError("api_key entries must not be empty")
    from_env = environ.get(API_KEY_ENV, "")
    keys += [key.strip() for key in from_env.split(",") if key.strip()]
    return keys


@dataclass(frozen=True)
class ApiKeys:
    """The salted digests of the keys a caller may present; none: the APIs are open."""

    digests: tuple[str, ...] = ()
    salt: bytes = field(default_factory=lambda: secrets.token_bytes(16))

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        salt = secrets.token_bytes(16)
        return cls(tuple(sorted({_digest(salt, key) for key in keys})), salt)

    @classmethod
    def resolve(cls, api_key: str | list[str] | None) -> ApiKeys:
        return cls.of(configured_keys(api_key, os.environ))

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def refusal(self, authorization: str | None) -> str | None:
        """Why a call with this `Authorization` value is refused; None: it may go on."""
        if not self.required:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return MISSING
        given = _digest(self.salt, key)
        # Every digest is compared (no early exit), each in constant time.
        matches = [hmac.compare_digest(given, known) for known in self.digests]
        return None if any(matches) else WRONG


def _digest(salt: bytes, key: str) -> str:
    return hmac.new(salt, key.encode(), hashlib.sha256).hexdigest()


def bearer(api_key: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that presents `api_key` (none for no key)."""
    return ((AUTHORIZATION, f"Bearer {api_key}"),) if api_key else ()


def client_api_key() -> str:
    """What a client sends by default: the first key of $PDSERVE_API_KEY, if any."""
    keys = configured_keys(None, os.environ)
    return keys[0] if keys else ""


def without_credentials(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers or metadata minus the credentials (what may reach telemetry)."""
    return {name: value for name, value in headers.items() if name.lower() != AUTHORIZATION}


def kv_secret_to_bind(configured: str, environ: Mapping[str, str]) -> str:
    """What `build_app` binds into the replicas' arguments for the KV secret."""
    if configured:
        return configured
    if environ.get(KV_SECRET_ENV):
        return KV_SECRET_FROM_ENV
    return secrets.token_hex(16)


def kv_secret(bound: str) -> str:
    """The KV secret a replica uses, from what was bound (read from this node's environment
    when the app was built with $PDSERVE_KV_SECRET)."""
    if bound != KV_SECRET_FROM_ENV:
        return bound
    value = os.environ.get(KV_SECRET_ENV, "")
    if not value:
        raise RuntimeError(
            f"the app was built with {KV_SECRET_ENV}, which this node's environment lacks: "
            "set it on every node (on Kubernetes, from the same Secret on every pod)"
        )
    return value
