"""How `pdserve.v1.Generation` is put on Serve's gRPC proxy (`grpc_servicer_functions`).

Two things Serve's proxy would otherwise get wrong for us, fixed through its own extension point
(the servicer function runs in the proxy process) and Python logging, without patching Ray:

- A request whose bytes are not a valid message fails inside grpcio's decoder, before any Serve
  code runs, and the client gets UNKNOWN. Our decoders turn such bytes into an
  `UndecodableRequest`, which travels to the Router like a request and is refused there with
  INVALID_ARGUMENT.
- A refused request must raise (a streaming method that returns after set_code ends OK), and
  Serve then logs it at ERROR with a traceback, in the replica and in the proxy. A filter on
  Serve's logger turns those records, for client errors only, into one INFO line.
- A call whose Router replica dies mid-request ends, from the proxy, with INTERNAL and Ray's
  own text (actor id, pid, node address). Serve's server replaces the handlers a servicer
  function registers with behaviours of its `service_handler_factory`; ours wraps that factory
  on the server it is given, so each behaviour gets a servicer context that passes everything
  through except such details: the client reads UNAVAILABLE and a line of ours
  (`PublicContext`). Serve offers no interceptor hook for its proxy; if the factory is not
  there (another Ray), the proxy's own text goes through and a warning says so.
- Serve's gRPC proxy listens in plain text only (its HTTP proxy takes `ssl_keyfile` /
  `ssl_certfile`). With $PDSERVE_GRPC_TLS_CERTFILE and $PDSERVE_GRPC_TLS_KEYFILE set in the
  proxy's environment, the servicer function (which runs before the server starts) adds a TLS
  port to the same server: $PDSERVE_GRPC_TLS_PORT, default 9443. Same handlers, same
  behaviour; only the transport differs. Expose that port and keep the plain one internal.

Kept light (grpc, protobuf, the generated stubs): Serve's proxy imports this module.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from protos.pdserve.v1 import generate_pb2_grpc

SERVICER_FUNCTION = "deployments.router.grpc_ingress.add_GenerationServicer_to_server"

# Codes that mean "the request was wrong" or "not now", not "the server failed": logged at
# INFO. UNAVAILABLE is no engine running yet, or an engine that failed mid-request, which the
# router logged already with its traceback (router.py's _stream_fn).
CLIENT_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
    }
)


@dataclass(frozen=True)
class UndecodableRequest:
    """In place of a request message whose bytes did not parse (picklable: it goes to the
    Router replica as the request)."""

    method: str
    error: str

    @property
    def message(self) -> str:
        return f"the {self.method} request is not a valid protobuf message: {self.error}"


def _tolerant(decode: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def decode_or_mark(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError as exc:
            return UndecodableRequest(method, str(exc))

    return decode_or_mark


class _Recorder:
    """Stands in for the server while the generated function registers the service: keeps
    the method handlers it is given, so their decoders can be replaced."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the generated code registers the same handlers below as well

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services[service] = handlers


def add_GenerationServicer_to_server(servicer: Any, server: Any) -> None:
    """The generated registration, with decoders that never fail and no Ray text in what the
    proxy tells clients (see the module docstring)."""
    _public_factory(server)
    _add_tls_port(server)
    recorder = _Recorder()
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, recorder)
    for service, handlers in recorder.services.items():
        tolerant = {
            name: handler._replace(
                request_deserializer=_tolerant(handler.request_deserializer, name)
            )
            for name, handler in handlers.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, tolerant),))
        register = getattr(server, "add_registered_method_handlers", None)
        if register is not None:
            register(service, tolerant)
    quiet_client_errors()  # this runs in Serve's proxy process


TLS_CERTFILE_ENV = "PDSERVE_GRPC_TLS_CERTFILE"
TLS_KEYFILE_ENV = "PDSERVE_GRPC_TLS_KEYFILE"
TLS_PORT_ENV = "PDSERVE_GRPC_TLS_PORT"
DEFAULT_TLS_PORT = 9443


def _add_tls_port(server: Any) -> None:
    """A TLS port beside Serve's plain one when the environment names a certificate and key
    (see the module docstring). A half-given pair is an error: the proxy
    must not come up in plain text only when TLS was asked for."""
    certfile, keyfile = os.environ.get(TLS_CERTFILE_ENV), os.environ.get(TLS_KEYFILE_ENV)
    if not certfile and not keyfile:
        return
    if not (certfile and keyfile):
        raise ValueError(f"set both {TLS_CERTFILE_ENV} and {TLS_KEYFILE_ENV}, or neither")
    with open(keyfile, "rb") as key, open(certfile, "rb") as cert:
        credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
    port = int(os.environ.get(TLS_PORT_ENV) or DEFAULT_TLS_PORT)
    bound = int(server.add_secure_port(f"[::]:{port}", credentials))
    if bound == 0:
        raise OSError(f"the gRPC proxy cannot listen for TLS on port {port}")
    logging.getLogger(__name__).info("gRPC proxy also serves TLS on port %d", bound)


ROUTER_DIED = "the router replica serving this request died or failed; retry the request"
_RAY_MARKS = (
    "actor_id",
    "The actor ",
    "ActorDiedError",
    "ActorUnavailableError",
    "RayActorError",
    "ServeReplica",
    "Traceback",
    "\x1b[",
)


class PublicContext:
    """A servicer context that never lets Ray's own error text reach the client; everything
    else goes to the real context."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def set_details(self, details: str) -> None:
        if _ray_text(details):
            self._context.set_code(grpc.StatusCode.UNAVAILABLE)
            details = ROUTER_DIED
        self._context.set_details(details)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> Any:
        if _ray_text(details):
            code, details = grpc.StatusCode.UNAVAILABLE, ROUTER_DIED
        return await self._context.abort(code, details)


def _ray_text(details: Any) -> bool:
    return isinstance(details, str) and any(mark in details for mark in _RAY_MARKS)


def _public_factory(server: Any) -> None:
    """Wrap the server's behaviour factory (Serve's gRPCGenericServer) once."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        logging.getLogger(__name__).warning(
            "Serve's gRPC server has no service_handler_factory: a call cut by a dead router "
            "replica will carry Ray's error text"
        )
        return
    if getattr(factory, "_pdserve_public", False):
        return

    def public_factory(*args: Any, **kwargs: Any) -> Any:
        return _public(factory(*args, **kwargs))

    public_factory._pdserve_public = True  # type: ignore[attr-defined]
    server.service_handler_factory = public_factory


def _public(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """The behaviour, given a PublicContext instead of the real one."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: Any) -> Any:
            async for message in behaviour(request, PublicContext(context)):
                yield message

        return stream

    async def unary(request: Any, context: Any) -> Any:
        return await behaviour(request, PublicContext(context))

    return unary


class ClientErrorLogFilter(logging.Filter):
    """Serve's "Request failed" records for a request refused with a client-error code: one
    INFO line with the code and message, no traceback. Server faults are left as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        code = getattr(error, "grpc_code", None)  # Serve's gRPCStatusError (or its wrapper)
        if (
            record.levelno >= logging.ERROR
            and isinstance(code, grpc.StatusCode)
            and code in CLIENT_ERROR_CODES
        ):
            record.msg = "request refused: %s: %s"
            record.args = (code.name, getattr(error, "grpc_details", "") or "")
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def quiet_client_errors() -> None:
    """Install the filter on Serve's logger in this process (once)."""
    logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, ClientErrorLogFilter) for f in logger.filters):
        logger.addFilter(ClientErrorLogFilter())
