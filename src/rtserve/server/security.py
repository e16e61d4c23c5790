"""Authentication, per-client rate limits and TLS settings (all optional, off by default).

Auth (``--auth-file``): API keys / bearer tokens, each allowed some models (or all) and
optionally the admin routes (repository index and model control, metrics, statistics of
every model). Tokens are compared in constant time (``hmac.compare_digest``) against each
configured token; health probes and the dashboard's static page stay open (the page sends
a key for ``/metrics``). Clients send
``Authorization: Bearer <token>`` (or ``x-api-key: <token>``) as an HTTP header or gRPC
metadata.

Rate limits (``--rate-limit RPS [--rate-burst N]``): a token bucket per client address;
over the limit a request is refused with 429 + Retry-After / RESOURCE_EXHAUSTED before any
decoding.
"""

from __future__ import annotations

import hmac
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import yaml

from rtserve.errors import ConfigError, Overloaded, RTServeError
from rtserve.protocol.limits import shown
from rtserve.runtime.llm.options import PRIORITY_MAX, PRIORITY_MIN

if TYPE_CHECKING:
    from rtserve.config import ServerConfig


class Unauthenticated(RTServeError):
    """No credentials, or credentials that match no configured token."""

    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class Forbidden(RTServeError):
    """A valid token that is not allowed this model or route."""

    http_status = 403
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class RateLimited(Overloaded):
    """This client sends faster than its configured rate."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True, slots=True)
class Grant:
    name: str  # for logs: which key was used
    token: bytes
    models: frozenset[str]  # "*" = every model
    admin: bool
    # The most urgent generation ``priority`` this key may ask for (lower runs first);
    # None: the model's ``llm.min_priority`` (0 unless configured).
    min_priority: int | None = None


def _token_value(entry: dict[str, object], where: str, i: int) -> str:
    if "token" in entry:
        value = entry["token"]
    elif "token_env" in entry:
        env = str(entry["token_env"])
        value = os.environ.get(env, "")
        if not value:
            raise ConfigError(f"{where}: keys[{i}].token_env: environment variable {env} is empty")
    elif "token_file" in entry:
        value = Path(str(entry["token_file"])).read_text().strip()
    else:
        raise ConfigError(f"{where}: keys[{i}]: expected token, token_env or token_file")
    if not isinstance(value, str) or len(value) < 16:
        raise ConfigError(f"{where}: keys[{i}]: a token must be a string of 16+ characters")
    return value


def _min_priority(value: object, where: str, i: int) -> int | None:
    """A key's ``min_priority``: an integer in [PRIORITY_MIN, PRIORITY_MAX] (lower runs first)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (PRIORITY_MIN <= value <= PRIORITY_MAX)
    ):
        raise ConfigError(
            f"{where}: keys[{i}].min_priority: expected an integer in [{PRIORITY_MIN}, "
            f"{PRIORITY_MAX}] (the most urgent priority the key may ask for), got {value!r:.40}"
        )
    return value


class Auth:
    def __init__(self, grants: list[Grant], open_metrics: bool = False) -> None:
        self.grants = grants
        self.open_metrics = open_metrics

    @classmethod
    def from_file(cls, path: Path) -> Auth:
        """``keys: [{name, token | token_env | token_file, models: [..] | "*", admin,
        min_priority}]``, ``open_metrics: false``."""
        where = str(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read the auth file ({exc.strerror})") from None
        if len(text) > 1_000_000:
            raise ConfigError(f"{where}: auth file larger than 1 MB")
        doc = yaml.safe_load(text) or {}
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list) or not doc["keys"]:
            raise ConfigError(f"{where}: keys: expected a non-empty list of keys")
        grants = []
        for i, entry in enumerate(doc["keys"]):
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}: keys[{i}]: expected a mapping")
            models = entry.get("models", "*")
            if models == "*":
                allowed = frozenset({"*"})
            elif isinstance(models, list) and all(isinstance(m, str) for m in models):
                allowed = frozenset(models)
            else:
                raise ConfigError(f'{where}: keys[{i}].models: expected "*" or a list of names')
            grants.append(
                Grant(
                    str(entry.get("name", f"key{i}")),
                    _token_value(entry, where, i).encode(),
                    allowed,
                    bool(entry.get("admin", False)),
                    _min_priority(entry.get("min_priority"), where, i),
                )
            )
        return cls(grants, bool(doc.get("open_metrics", False)))

    def grant(self, credential: str | None) -> Grant:
        if not credential:
            raise Unauthenticated("missing credentials (Authorization: Bearer <token>)")
        token = credential[7:] if credential[:7].lower() == "bearer " else credential
        presented = token.strip().encode("utf-8", "replace")
        found = None
        for grant in self.grants:  # every token is compared, in constant time each
            if hmac.compare_digest(presented, grant.token):
                found = grant
        if found is None:
            raise Unauthenticated("invalid credentials")
        return found

    def check_model(self, credential: str | None, model: str) -> None:
        grant = self.grant(credential)
        if "*" not in grant.models and model not in grant.models:
            raise Forbidden(f"this key may not use model '{shown(model)}'")

    def check_admin(self, credential: str | None) -> None:
        if not self.grant(credential).admin:
            raise Forbidden("this route needs an admin key")

    def check_any(self, credential: str | None) -> None:
        self.grant(credential)


class RateLimiter:
    """A token bucket per client address (``rate`` requests/s, ``burst`` at once)."""

    def __init__(self, rate: float, burst: int, clock: object = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(max(1, burst))
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def take(self, client: str) -> None:
        now = self._clock()  # type: ignore[operator]
        tokens, at = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            raise RateLimited(
                f"rate limit of {self.rate:g} requests/s exceeded for this client",
                retry_after_s=(1.0 - tokens) / self.rate,
            )
        self._buckets[client] = (tokens - 1.0, now)
        if len(self._buckets) > 100_000:  # forget idle clients
            cutoff = now - self.burst / self.rate
            self._buckets = {k: v for k, v in self._buckets.items() if v[1] > cutoff}


def server_ssl_context(
    cert: Path, key: Path, client_ca: Path | None = None, alpn: str = "http/1.1"
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        ctx.load_verify_locations(str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols([alpn])
    return ctx


def grpc_credentials(
    cert: Path, key: Path, client_ca: Path | None = None
) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca is not None else None,
        require_client_auth=client_ca is not None,
    )


# (ModelReady needs the model's key, as HTTP's /v2/models/{m}/ready: open, it told any
# client which models exist)
_OPEN_GRPC = ("ServerLive", "ServerReady")
_ADMIN_GRPC = ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
# Any valid key, as their HTTP routes (/v2/systemsharedmemory/..., /v2/cudasharedmemory/...):
# their request's ``name`` is a region's, not a model's.
_ANY_KEY_GRPC = (
    "ServerMetadata",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
)


class Guard:
    """Decides, before any decoding, whether a request may proceed (auth, rate limit)."""

    def __init__(self, auth: Auth | None = None, limiter: RateLimiter | None = None) -> None:
        self.auth = auth
        self.limiter = limiter

    @classmethod
    def from_config(cls, config: ServerConfig) -> Guard | None:
        """The keys (``auth_file``) and the rate limit (``rate_limit_rps``,
        ``rate_limit_burst``) configured, as every entry applies them (``rtserve serve``,
        the Lambda handler, the Ray deployment); None when neither is. Errors name the
        setting."""
        auth = Auth.from_file(Path(config.auth_file)) if config.auth_file else None
        limiter = None
        if config.rate_limit_rps > 0:
            burst = config.rate_limit_burst or max(1, int(2 * config.rate_limit_rps))
            limiter = RateLimiter(config.rate_limit_rps, burst)
        return cls(auth, limiter) if auth is not None or limiter is not None else None

    def http(self, path: str, headers: dict[bytes, bytes], peer: str) -> None:
        """``path``: the request's canonical path (``server/paths.py``), as the router sees
        it; ``peer``: the client's IP address, the same key its gRPC calls are limited by."""
        parts = path.split("/")[1:]
        if parts[:2] == ["v2", "health"]:
            return  # probes stay open
        if self.limiter is not None:
            self.limiter.take(peer)
        auth = self.auth
        if auth is None:
            return
        credential = http_credential(headers)
        if parts == ["dashboard"]:
            return  # a static page without data: it sends a key for /metrics itself
        if parts == ["metrics"]:
            if not auth.open_metrics:
                auth.check_admin(credential)
        elif parts[:2] == ["v2", "repository"] or parts == ["v2", "models", "stats"]:
            auth.check_admin(credential)
        elif len(parts) >= 3 and parts[:2] == ["v2", "models"]:
            auth.check_model(credential, parts[2])
        else:
            auth.check_any(credential)

    def http_model(self, headers: dict[bytes, bytes], model: str) -> None:
        """A request that names its model in its body (the OpenAI API): after the route's
        own check, the key must also allow that model."""
        if self.auth is not None:
            self.auth.check_model(http_credential(headers), model)

    def may_use(self, headers: dict[bytes, bytes], model: str) -> bool:
        """Whether the request's key may use ``model`` (what a model listing shows it)."""
        try:
            self.http_model(headers, model)
        except RTServeError:
            return False
        return True

    def grpc(self, method: str, request: object, context: object) -> None:
        if method in _OPEN_GRPC:
            return
        if self.limiter is not None:
            self.limiter.take(grpc_address(str(context.peer())))  # type: ignore[attr-defined]
        auth = self.auth
        if auth is None:
            return
        credential = grpc_credential(context)
        if method in _ADMIN_GRPC:
            auth.check_admin(credential)
        elif method in _ANY_KEY_GRPC:
            auth.check_any(credential)
        elif method == "ModelStatistics" and not getattr(request, "name", ""):
            auth.check_admin(credential)
        else:
            name = getattr(request, "name", "") or getattr(request, "model_name", "")
            auth.check_model(credential, str(name))


def http_credential(headers: dict[bytes, bytes]) -> str | None:
    """The request's ``Authorization`` header, else its ``x-api-key``."""
    raw = headers.get(b"authorization") or headers.get(b"x-api-key")
    return raw.decode("latin-1") if raw is not None else None


def grpc_address(peer: str) -> str:
    """The IP address in a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``), written
    as HTTP's peer address is, so that both protocols share one rate-limit bucket."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rsplit(":", 1)[0]
        return host[1:-1] if host.startswith("[") else host
    return peer


def grpc_credential(context: object) -> str | None:
    """The call's ``authorization`` metadata, else its ``x-api-key``, as HTTP reads its
    headers (either may carry a ``Bearer`` prefix). gRPC metadata keys are lowercase."""
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():  # type: ignore[attr-defined]
        if key in ("authorization", "x-api-key"):
            found.setdefault(key, str(value))
    return found.get("authorization") or found.get("x-api-key")
