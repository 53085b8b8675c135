"""The app's credentials: API keys for both public APIs (vLLM's `--api-key`) and the engines'
shared KV secret. Neither is kept in plain text where Serve keeps a replica's arguments (its
checkpoint, in Redis with GCS fault tolerance).

API keys come from the app argument `api_key` (one key or a list; `pdserve serve --api-key`,
repeatable), the environment variable `PDSERVE_API_KEY` (comma-separated) and the file named by
`PDSERVE_API_KEY_FILE` (keys separated by commas or lines: on Kubernetes a mounted Secret, so no
key sits in the serve config, which Serve logs when it builds the app, and a rotated Secret
reaches the routers without a restart: they look at the file at most once a second and read it
again when it changed). Several keys may be live at once. Keys fail closed: a variable set but
holding no key, or a key file missing or empty, refuses to start the app; a key file that
becomes unreadable or empty later refuses every call until it holds a key again. `build_app`
binds only HMAC-SHA256 digests under a salt drawn for that build (and the key file's path); a
caller's key is digested the same way and compared, in constant time, against every digest. No
message names the key a caller sent.

HTTP: every route but `/health` needs `Authorization: Bearer KEY` (401 otherwise, OpenAI's error
shape, `WWW-Authenticate: Bearer`). gRPC: `Generate`, `Abort` and `ModelInfo` need metadata
`authorization: Bearer KEY` (UNAUTHENTICATED otherwise); `Health` stays open, as `/health`
does, for probes and load balancers — without a valid key it answers the status alone, from a
survey shared for a second.

The KV secret: the app argument `kv_secret`, else `$PDSERVE_KV_SECRET`, else drawn once per
build. From the environment it is not bound at all: the replicas get a reference and read the
variable when they start (every node has it, from the same Secret).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from connector.file_watch import FileWatch
from engine.config import SideChannelTLS

API_KEY_ENV = "PDSERVE_API_KEY"
API_KEY_FILE_ENV = "PDSERVE_API_KEY_FILE"
KEY_FILE_CHECK_S = 1.0  # how often a router looks at the key file (one stat)
KV_SECRET_ENV = "PDSERVE_KV_SECRET"
# Bound in place of a KV secret that every node has in its environment.
KV_SECRET_FROM_ENV = "$" + KV_SECRET_ENV
AUTHORIZATION = "authorization"  # the HTTP header, and the gRPC metadata key (lower case)
logger = logging.getLogger(__name__)

MISSING = "missing API key: send the header 'Authorization: Bearer <key>'"
WRONG = "invalid API key"


def configured_keys(api_key: str | list[str] | None, environ: Mapping[str, str]) -> list[str]:
    """The keys of the app argument and of $PDSERVE_API_KEY (ValueError for an empty one)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if not all(isinstance(key, str) for key in keys):
        raise ValueError("api_key must be a string or a list of strings")
    if any(not key.strip() for key in keys):
        raise ValueError("api_key entries must not be empty")
    from_env = environ.get(API_KEY_ENV)
    if from_env is not None:
        if not (env_keys := parse_keys(from_env)):
            raise ValueError(
                f"{API_KEY_ENV} is set but holds no key (empty, or only separators): set a key, "
                "or unset it to serve without keys"
            )
        keys += env_keys
    return keys


def parse_keys(text: str) -> list[str]:
    """Keys separated by commas or line breaks, surrounding blanks dropped."""
    return [key.strip() for key in text.replace("\n", ",").split(",") if key.strip()]


def read_key_file(path: str) -> list[str]:
    """The keys in `path`; ValueError (with the reason, never a key) where there are none."""
    try:
        with open(path, encoding="utf-8") as file:
            keys = parse_keys(file.read())
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        message = f"the API key file {API_KEY_FILE_ENV} names cannot be read: {reason}"
        raise ValueError(message) from None
    if not keys:
        raise ValueError(f"the API key file {API_KEY_FILE_ENV} names holds no key")
    return keys


@dataclass(frozen=True)
class ApiKeys:
    """The salted digests of the keys a caller may present, and a key file read again when it
    changes; neither: the APIs are open."""

    digests: tuple[str, ...] = ()
    salt: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    key_file: str = ""
    _file: _KeyFile = field(default_factory=lambda: _KeyFile(), compare=False, repr=False)

    @classmethod
    def of(cls, keys: Iterable[str], key_file: str = "") -> ApiKeys:
        salt = secrets.token_bytes(16)
        return cls(tuple(sorted({_digest(salt, key) for key in keys})), salt, key_file)

    @classmethod
    def resolve(cls, api_key: str | list[str] | None) -> ApiKeys:
        """The keys configured for this build: ValueError where a source is set but empty."""
        key_file = os.environ.get(API_KEY_FILE_ENV)
        if key_file is not None:
            read_key_file(key_file)  # fails closed now, at build, with the reason
        return cls.of(configured_keys(api_key, os.environ), key_file or "")

    @property
    def required(self) -> bool:
        return bool(self.digests or self.key_file)

    def refusal(self, authorization: str | None) -> str | None:
        """Why a call with this `Authorization` value is refused; None: it may go on."""
        if not self.required:
            return None
        scheme, _, key = (authorization or "").strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return MISSING
        given = _digest(self.salt, key)
        known = self.digests + (
            self._file.digests(self.key_file, self.salt) if self.key_file else ()
        )
        # Every digest is compared (no early exit), each in constant time.
        matches = [hmac.compare_digest(given, digest) for digest in known]
        return None if any(matches) else WRONG


class _KeyFile:
    """The digests of a key file's keys, read again when it changed (connector/file_watch.py),
    looked at no more than once a second. A file that cannot be read or holds no key leaves no
    digest (every key from it is refused), and is read again a second later."""

    def __init__(self) -> None:
        self._watch: FileWatch | None = None
        self._digests: tuple[str, ...] = ()

    def digests(self, path: str, salt: bytes) -> tuple[str, ...]:
        if self._watch is None:  # here, in the replica: the clock is read from now on
            self._watch = FileWatch([path], KEY_FILE_CHECK_S)
        stamp = self._watch.changed()
        if stamp is not None:
            self._digests = self._read(path, salt)
            if self._digests:
                self._watch.accept(stamp)
        return self._digests

    @staticmethod
    def _read(path: str, salt: bytes) -> tuple[str, ...]:
        try:
            keys = read_key_file(path)
        except ValueError as exc:
            logger.error("%s: refusing every key until it holds one", exc)
            return ()
        return tuple(sorted({_digest(salt, key) for key in keys}))

    def __reduce__(self) -> tuple[type[_KeyFile], tuple[()]]:
        return (_KeyFile, ())  # each replica looks at the file itself


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


SIDE_CHANNEL_TLS_DIR_ENV = "PDSERVE_SIDE_CHANNEL_TLS_DIR"
SIDE_CHANNEL_TLS_NAME_ENV = "PDSERVE_SIDE_CHANNEL_TLS_NAME"


def side_channel_tls_from_env(environ: Mapping[str, str]) -> SideChannelTLS | None:
    """The side channel's mutual TLS from a directory laid out as cert-manager writes a
    Certificate's Secret (the same path on every pod), where the variable is set."""
    directory = environ.get(SIDE_CHANNEL_TLS_DIR_ENV)
    if directory is None:
        return None
    if not directory:
        raise ValueError(f"{SIDE_CHANNEL_TLS_DIR_ENV} is set but empty")  # fail closed
    base = directory.rstrip("/")
    return SideChannelTLS(
        certfile=f"{base}/tls.crt",
        keyfile=f"{base}/tls.key",
        ca_certs=f"{base}/ca.crt",
        server_name=environ.get(SIDE_CHANNEL_TLS_NAME_ENV, "pdserve-engine"),
    )
