"""gRPC client of the pdserve.v1.Generation API (`pdserve client`, tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from deployments.credentials import bearer, client_api_key
from pdserve.cli_options import EndpointOptions
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

APP_METADATA_KEY = "application"  # Serve's gRPC proxy routes on it when several apps run


def sampling_message(**params: Any) -> pb.SamplingParams:
    """pb.SamplingParams from keyword arguments named like SamplingParams; None = unset."""
    message = pb.SamplingParams()
    for name, value in params.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(message, name).extend(value)
        elif name == "logit_bias":
            message.logit_bias.update(value)
        elif name == "structured_outputs":  # {"json_schema": "..."}, {"choice": [...]}, ...
            _set_structured(message.structured_outputs, value)
        else:
            setattr(message, name, value)
    return message


def _set_structured(message: pb.StructuredOutputs, value: dict[str, Any]) -> None:
    ((kind, setting),) = value.items()
    if kind == "choice":
        message.choice.choices.extend(setting)
    else:
        setattr(message, kind, setting)


def generate_request(
    prompt: str | Sequence[int],
    request_id: str = "",
    timeout_s: float = 0.0,
    chat: bool = False,
    **params: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest for a text or token-id prompt; `chat=True` sends text as one user
    message, which the server renders with the model's chat template."""
    request = pb.GenerateRequest(
        request_id=request_id, sampling_params=sampling_message(**params), timeout_s=timeout_s
    )
    if isinstance(prompt, str) and chat:
        request.chat.messages.add(role="user", content=prompt)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


@dataclass
class Completion:
    """A whole response, assembled from its chunks."""

    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    route: str = ""
    num_chunks: int = 0
    usage: pb.Usage | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        self.num_chunks += 1
        if response.prompt_token_ids:
            self.prompt_token_ids = list(response.prompt_token_ids)
        self.token_ids.extend(response.token_ids)
        self.text += response.text
        self.route = response.route or self.route
        if response.finish_reason:
            self.finish_reason = response.finish_reason
            self.usage = response.usage


MAX_ANSWER_BYTES = 256 << 20


class GenerationClient:
    """`api_key`: sent as `authorization: Bearer KEY`. `root_certificates` (PEM): TLS to the
    proxy's TLS port, trusting that CA (b"": the system's roots); None: plain text."""

    def __init__(
        self,
        target: str,
        application: str = "",
        api_key: str = "",
        root_certificates: bytes | None = None,
    ) -> None:
        # Answers may be larger than gRPC's default 4 MiB (a step trace of every engine).
        options = [("grpc.max_receive_message_length", MAX_ANSWER_BYTES)]
        if root_certificates is None:
            self.channel = grpc.insecure_channel(target, options)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates or None)
            self.channel = grpc.secure_channel(target, credentials, options)
        self.stub = pb_grpc.GenerationStub(self.channel)
        app = ((APP_METADATA_KEY, application),) if application else ()
        self.metadata = app + bearer(api_key)

    @classmethod
    def connect(cls, endpoint: EndpointOptions) -> GenerationClient:
        """As the CLI's flags say: `api_key` None: $PDSERVE_API_KEY's first key; `tls_ca`: a
        CA certificate file, "system" (the system's roots), or None (plain text)."""
        roots = None
        if endpoint.tls_ca is not None:
            roots = b"" if endpoint.tls_ca == "system" else Path(endpoint.tls_ca).read_bytes()
        key = client_api_key() if endpoint.api_key is None else endpoint.api_key
        return cls(endpoint.target, endpoint.application, key, roots)

    def stream(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def complete(self, request: pb.GenerateRequest, timeout: float | None = None) -> Completion:
        completion = Completion()
        for response in self.stream(request, timeout):
            completion.add(response)
        return completion

    def health(self, timeout: float = 10.0) -> pb.HealthResponse:
        return self.stub.Health(pb.HealthRequest(), timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float = 10.0) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def step_trace(
        self, max_steps: int = 0, keep_steps: int = 0, timeout: float = 60.0
    ) -> pb.StepTraceResponse:
        request = pb.StepTraceRequest(max_steps=max_steps, keep_steps=keep_steps)
        return self.stub.StepTrace(request, timeout=timeout, metadata=self.metadata)

    def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        reply = self.stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata
        )
        return bool(reply.found)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
