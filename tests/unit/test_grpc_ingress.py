"""The servicer function Serve's gRPC proxy calls: tolerant decoders and quiet refusals."""

from __future__ import annotations

import logging
import sys
from typing import Any

import grpc
from ray.serve.exceptions import gRPCStatusError

from deployments.router.grpc_ingress import (
    ClientErrorLogFilter,
    UndecodableRequest,
    add_GenerationServicer_to_server,
)
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1.generate_pb2_grpc import GenerationServicer


class _Server:
    """Records what is registered, as grpc's server would hold it."""

    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.registered[service] = handlers


def test_every_method_is_registered_with_a_decoder_that_never_fails() -> None:
    server = _Server()
    add_GenerationServicer_to_server(GenerationServicer(), server)
    handlers = server.registered["pdserve.v1.Generation"]
    assert set(handlers) == {"Generate", "Abort", "Health", "ModelInfo", "StepTrace"}
    assert len(server.generic) == 1
    good = pb.GenerateRequest(text="Hello", request_id="r1").SerializeToString()
    decode = handlers["Generate"].request_deserializer
    assert decode(good) == pb.GenerateRequest(text="Hello", request_id="r1")
    bad = decode(b"\xff\xff\xff")
    assert isinstance(bad, UndecodableRequest) and bad.method == "Generate"
    assert "not a valid protobuf message" in bad.message
    assert handlers["Generate"].response_streaming and not handlers["Abort"].response_streaming


def _record(error: BaseException, level: int = logging.ERROR) -> logging.LogRecord:
    try:
        raise error
    except BaseException:
        exc_info = sys.exc_info()
    return logging.LogRecord("ray.serve", level, __file__, 1, "Request failed.", (), exc_info)


def test_refusals_are_one_info_line_and_server_faults_keep_their_traceback() -> None:
    log_filter = ClientErrorLogFilter()
    refused = _record(
        gRPCStatusError(ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
    )
    assert log_filter.filter(refused)
    assert refused.levelno == logging.INFO and refused.exc_info is None
    assert refused.getMessage() == "request refused: INVALID_ARGUMENT: prompt is empty"
    starting = _record(
        gRPCStatusError(RuntimeError("x"), grpc.StatusCode.UNAVAILABLE, "no engine running yet")
    )
    assert log_filter.filter(starting) and starting.levelno == logging.INFO
    for error in (
        gRPCStatusError(RuntimeError("boom"), grpc.StatusCode.INTERNAL, "boom"),
        RuntimeError("boom"),
    ):
        fault = _record(error)
        assert log_filter.filter(fault)
        assert fault.levelno == logging.ERROR and fault.exc_info is not None


def test_the_proxy_never_tells_a_client_rays_own_text() -> None:
    """What Serve's proxy sets when the Router replica died mid-call becomes UNAVAILABLE and a
    line of ours; our own messages and everything else pass through."""
    import asyncio

    import grpc

    from deployments.router.grpc_ingress import ROUTER_DIED, PublicContext

    class Recording:
        def __init__(self) -> None:
            self.calls: list[tuple[str, object]] = []

        def set_code(self, code: grpc.StatusCode) -> None:
            self.calls.append(("code", code))

        def set_details(self, details: str) -> None:
            self.calls.append(("details", details))

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.calls.append(("abort", (code, details)))

        def peer(self) -> str:
            return "ipv4:127.0.0.1:5"

    ray_text = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: "
        "ServeReplica:pdserve:Router\n\tactor_id: af3184556e135a24b622ba6c01000000"
    )
    real = Recording()
    context = PublicContext(real)
    context.set_code(grpc.StatusCode.INTERNAL)
    context.set_details(ray_text)
    context.set_details("the decode engine failed mid-request: its replica died")
    context.set_details("The actor 8f2a is unavailable: RPC error 10.0.0.3:41919")
    asyncio.run(context.abort(grpc.StatusCode.INTERNAL, ray_text))
    assert real.calls == [
        ("code", grpc.StatusCode.INTERNAL),
        ("code", grpc.StatusCode.UNAVAILABLE),
        ("details", ROUTER_DIED),
        ("details", "the decode engine failed mid-request: its replica died"),
        ("code", grpc.StatusCode.UNAVAILABLE),
        ("details", ROUTER_DIED),
        ("abort", (grpc.StatusCode.UNAVAILABLE, ROUTER_DIED)),
    ]
    assert context.peer() == "ipv4:127.0.0.1:5"


def test_the_servicer_function_wraps_serves_behaviour_factory() -> None:
    """Serve's server builds each method's behaviour with its service_handler_factory: after
    our servicer function ran, those behaviours set details through a PublicContext."""
    import asyncio

    import grpc

    from deployments.router.grpc_ingress import ROUTER_DIED, add_GenerationServicer_to_server

    class Server:
        def __init__(self) -> None:
            self.service_handler_factory = self.factory
            self.handlers: list[object] = []

        def factory(self, service_method: str, streaming_type: str):
            async def unary(request, context):
                context.set_details("actor_id: 123abc ServeReplica:pdserve:Router")
                return b""

            async def stream(request, context):
                yield b"chunk"
                context.set_details("actor_id: 123abc")

            return stream if streaming_type == "stream" else unary

        def add_generic_rpc_handlers(self, handlers) -> None:
            self.handlers.append(handlers)

    class Context:
        details = ""

        def set_code(self, code) -> None:
            self.code = code

        def set_details(self, details: str) -> None:
            self.details = details

    from protos.pdserve.v1.generate_pb2_grpc import GenerationServicer

    server = Server()
    add_GenerationServicer_to_server(GenerationServicer(), server)
    wrapped = server.service_handler_factory
    add_GenerationServicer_to_server(GenerationServicer(), server)
    assert server.service_handler_factory is wrapped  # wrapped once, not twice
    assert server.handlers
    unary_context, stream_context = Context(), Context()

    async def go() -> list[bytes]:
        await server.service_handler_factory("/pdserve.v1.Generation/Health", "unary")(
            None, unary_context
        )
        behaviour = server.service_handler_factory("/pdserve.v1.Generation/Generate", "stream")
        return [m async for m in behaviour(None, stream_context)]

    assert asyncio.run(go()) == [b"chunk"]
    for context in (unary_context, stream_context):
        assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, ROUTER_DIED)
