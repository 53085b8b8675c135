"""API keys for both public APIs (vLLM's `--api-key`).

Where keys come from: the app argument `api_key` (one key or a list; `pdserve serve --api-key`,
repeatable) and the environment variable `PDSERVE_API_KEY` (comma-separated; on Kubernetes it
comes from a Secret, so no key sits in the serve config). Several keys may be live at once, so
one can be rotated without downtime.

Only SHA-256 digests of the keys leave `build_app`: the Router's init arguments (which Serve
keeps in its checkpoints) hold no key, and a caller's key is hashed before it is compared, in
constant time, against every digest. No message names the key a caller sent.

HTTP: every route but `/health` needs `Authorization: Bearer KEY` (401 otherwise, OpenAI's error
shape, `WWW-Authenticate: Bearer`). gRPC: `Generate`, `Abort` and `ModelInfo` need metadata
`authorization: Bearer KEY` (UNAUTHENTICATED otherwise); `Health` stays open, as `/health`
does, for probes and load balancers.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

API_KEY_ENV = "PDSERVE_API_KEY"
AUTHORIZATION = "authorization"  # the HTTP header, and the gRPC metadata key (lower case)
MISSING = "missing API key: send the header 'Authorization: Bearer <key>'"
WRONG = "invalid API key"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


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
    """The digests of the keys a caller may present; none: the APIs are open."""

    digests: tuple[str, ...] = ()

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        return cls(tuple(sorted({digest(key) for key in keys})))

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
        given = digest(key)
        # Every digest is compared (no early exit), each in constant time.
        matches = [hmac.compare_digest(given, known) for known in self.digests]
        return None if any(matches) else WRONG


def without_credentials(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers or metadata minus the credentials (what may reach telemetry)."""
    return {name: value for name, value in headers.items() if name.lower() != AUTHORIZATION}
