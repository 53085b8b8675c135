"""The servicer function Serve's gRPC proxy calls: tolerant decoders and quiet refusals."""

from __future__ import annotations

import logging
import sys
from typing import Any

import grpc
from ray.serve.exceptions import gRPCStatusError

from deployments.grpc_ingress import (
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
    assert set(handlers) == {"Generate", "Abort", "Health", "ModelInfo"}
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
    for error in (
        gRPCStatusError(RuntimeError("boom"), grpc.StatusCode.INTERNAL, "boom"),
        RuntimeError("boom"),
    ):
        fault = _record(error)
        assert log_filter.filter(fault)
        assert fault.levelno == logging.ERROR and fault.exc_info is not None
