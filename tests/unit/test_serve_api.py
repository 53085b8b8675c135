"""The public API's pieces without Ray: the generated gRPC code, request validation, the app
config and the serve config file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import descriptor_pb2

from deployments.app import build_app
from deployments.app_config import AppConfig
from deployments.protocol import (
    ChatPrompt,
    GenerateInput,
    RequestLimits,
    ResponseChunk,
    Usage,
    chunk_to_proto,
    input_from_proto,
)
from deployments.router.grpc_ingress import SERVICER_FUNCTION
from engine.request import SamplingParams
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["generate", "kv_transfer"])
def test_generated_modules_match_the_proto(tmp_path: Path, name: str) -> None:
    """Compile the .proto now and compare its descriptor with the committed module's (run
    `make protos` after editing a .proto)."""
    out = tmp_path / "descriptor.bin"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--descriptor_set_out={out}",
            f"protos/pdserve/v1/{name}.proto",
        ],
        cwd=ROOT,
        check=True,
    )
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _clear_json_names(compiled.message_type)  # protoc's python plugin leaves defaults out
    module = __import__(f"protos.pdserve.v1.{name}_pb2", fromlist=["DESCRIPTOR"])
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    assert committed == compiled, f"protos/pdserve/v1/{name}_pb2*.py are stale: run make protos"


def _clear_json_names(messages: Any) -> None:
    for message in messages:
        for f in message.field:
            f.ClearField("json_name")
        _clear_json_names(message.nested_type)


def test_grpc_module_serves_every_rpc_of_the_service() -> None:
    methods = pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name
    assert set(methods) == {"Generate", "Abort", "Health", "ModelInfo", "StepTrace"}
    servicer = pb_grpc.GenerationServicer
    assert all(hasattr(servicer, name) for name in methods)


def test_input_from_proto_maps_sampling_fields() -> None:
    request = pb.GenerateRequest(
        request_id="r1",
        text="Hello",
        priority=2,
        cache_salt="salt",
        timeout_s=5,
        sampling_params=pb.SamplingParams(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=20,
            seed=3,
            stop=["\n"],
            stop_token_ids=[2],
            ignore_eos=True,
            logprobs=2,
            repetition_penalty=1.1,
            logit_bias={5: -1.0},
        ),
    )
    got = input_from_proto(request)
    assert (got.prompt, got.request_id, got.priority, got.cache_salt, got.timeout_s) == (
        "Hello",
        "r1",
        2,
        "salt",
        5.0,
    )
    p = got.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 20, 3)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (("\n",), (2,), True, 2)
    assert p.repetition_penalty == pytest.approx(1.1) and p.logit_bias == {5: -1.0}


@pytest.mark.parametrize(
    ("structured", "kind", "value"),
    [
        (pb.StructuredOutputs(json_schema='{"type": "object"}'), "json", '{"type": "object"}'),
        (pb.StructuredOutputs(json_object=True), "json_object", True),
        (pb.StructuredOutputs(regex="[0-9]+"), "regex", "[0-9]+"),
        (pb.StructuredOutputs(choice=pb.Choices(choices=["a", "b"])), "choice", ("a", "b")),
        (pb.StructuredOutputs(grammar='root ::= "x"'), "grammar", 'root ::= "x"'),
    ],
)
def test_structured_outputs_map_from_proto(structured, kind, value) -> None:
    params = pb.SamplingParams(structured_outputs=structured)
    got = input_from_proto(pb.GenerateRequest(text="a", sampling_params=params)).params
    assert got.structured_outputs is not None and got.structured_outputs.kind == kind
    assert getattr(got.structured_outputs, kind) == value


def test_chat_prompts_map_from_proto() -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    got = input_from_proto(pb.GenerateRequest(chat=chat))
    assert got.prompt == ChatPrompt([{"role": "user", "content": "hi"}])


def test_a_chat_without_max_tokens_fills_the_context() -> None:
    """As OpenAI's chat completions: the router sets max_tokens to what the context leaves
    once it has the prompt's length (deployments/router/orchestrator.py)."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    assert input_from_proto(pb.GenerateRequest(chat=chat)).fill_context
    given = pb.SamplingParams(max_tokens=16)
    assert not input_from_proto(pb.GenerateRequest(chat=chat, sampling_params=given)).fill_context
    assert not input_from_proto(pb.GenerateRequest(text="hi")).fill_context


def test_the_router_fills_a_chat_s_context_once_it_has_the_prompt() -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from deployments.router.orchestrator import FlowConfig, ModelFacts, Orchestrator
    from engine.tokenizer import Tokenizer, TokenizerConfig

    words = HFTokenizer(WordLevel({"<unk>": 0, "user": 1, "hi": 2}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    template = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
    tokenizer = Tokenizer(words, TokenizerConfig(chat_template=template))

    async def never(request: Any) -> Any:
        raise AssertionError("prepare() sends nothing")
        yield

    flow = Orchestrator(tokenizer, ModelFacts("m", 64, 3), FlowConfig(), decode=never)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi hi")])
    prepared = flow.prepare(input_from_proto(pb.GenerateRequest(chat=chat)))
    assert len(prepared.prompt_token_ids) == 3
    assert prepared.params.max_tokens == 64 - 3
    text = flow.prepare(input_from_proto(pb.GenerateRequest(text="hi")))
    assert text.params.max_tokens == 16  # a completion keeps the API's default


def test_unset_fields_take_the_engine_defaults() -> None:
    got = input_from_proto(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])))
    assert got.prompt == [1, 2] and got.params.max_tokens == 16 and got.params.temperature == 1.0
    assert got.timeout_s is None and got.cache_salt is None


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "no prompt"),
        (pb.GenerateRequest(text="a", timeout_s=-1), "timeout_s"),
        (
            pb.GenerateRequest(text="a", sampling_params=pb.SamplingParams(max_tokens=0)),
            "max_tokens",
        ),
        (pb.GenerateRequest(text="a", sampling_params=pb.SamplingParams(top_k=0)), "top_k"),
        (pb.GenerateRequest(text="a", sampling_params=pb.SamplingParams(min_p=3)), "min_p"),
        (
            pb.GenerateRequest(
                text="a",
                sampling_params=pb.SamplingParams(structured_outputs=pb.StructuredOutputs()),
            ),
            "names no kind",
        ),
        (
            pb.GenerateRequest(
                text="a",
                sampling_params=pb.SamplingParams(
                    structured_outputs=pb.StructuredOutputs(regex="a(b")
                ),
            ),
            "invalid structured output regex",
        ),
    ],
)
def test_bad_requests_raise_value_error(request_: pb.GenerateRequest, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        input_from_proto(request_)


def test_chunk_to_proto() -> None:
    chunk = ResponseChunk(
        "r",
        [4, 5],
        "ab",
        finish_reason="length",
        prompt_token_ids=[1],
        usage=Usage(1, 2, 0),
        ttft_s=0.1,
        e2e_s=0.2,
        route="disaggregated",
        logprobs=[([4, 9], [-0.1, -2.0], 1), ([5], [-0.3], 1)],
    )
    message = chunk_to_proto(chunk)
    assert list(message.token_ids) == [4, 5] and message.text == "ab"
    assert message.usage.completion_tokens == 2 and message.timing.e2e_s == pytest.approx(0.2)
    assert list(message.logprobs[0].token_ids) == [4, 9] and message.route == "disaggregated"


def test_app_config_coerces_serve_run_strings() -> None:
    config = AppConfig.from_args(
        {
            "colocated": "true",
            "decode_replicas": "2",
            "request_timeout_s": "9.5",
            "engine_args": '{"max_model_len": 512}',
        }
    )
    assert config.colocated is True and config.decode_replicas == 2
    assert config.request_timeout_s == 9.5 and config.engine_args == {"max_model_len": 512}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"replicas": 2}, "unknown app argument"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"decode_replicas": 0}, "decode_replicas"),
        ({"colocated": "maybe"}, "colocated"),
        ({"engine_args": {"kv_transfer_config": {}}}, "kv_transfer_config"),
        # Decode-only while no prefill replica runs means no demand to scale prefill from 0.
        ({"prefill_autoscaling": {"min_replicas": 0}}, "min_replicas must be >= 1"),
    ],
)
def test_app_config_refuses_bad_args(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AppConfig.from_args(args)


def test_serve_config_file_is_a_valid_deploy_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app"
    assert config["grpc_options"]["grpc_servicer_functions"] == [SERVICER_FUNCTION]
    AppConfig.from_args(app.args)
    assert build_app(app.args) is not None  # binds the graph; nothing starts


def test_kuberay_service_embeds_a_valid_serve_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    service = yaml.safe_load((ROOT / "k8s" / "base" / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = ServeDeploySchema.model_validate(serve_config).applications
    config = AppConfig.from_args(app.args)
    assert config.num_gpus_per_engine == 1 and config.transport == "nixl"
    reference = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    assert serve_config["grpc_options"] == reference["grpc_options"]


def test_request_limits_refuse_by_name() -> None:
    limits = RequestLimits(
        max_prompt_chars=10, max_stop_strings=2, max_stop_chars=3, max_request_id_chars=4
    )
    ok = SamplingParams(stop=["ab", "c"])
    limits.check(GenerateInput("x" * 10, ok, request_id="abcd"))  # at each limit: accepted
    cases = [
        (GenerateInput("x" * 11, ok), "prompt has 11 characters; the limit is 10"),
        (
            GenerateInput(ChatPrompt([{"role": "user", "content": "x" * 6}] * 2), ok),
            "prompt has 12 characters",
        ),
        (GenerateInput("x", SamplingParams(stop=["a", "b", "c"])), "(max_stop_strings)"),
        (GenerateInput("x", SamplingParams(stop=["abcd"])), "(max_stop_chars)"),
        (GenerateInput("x", ok, request_id="abcde"), "(max_request_id_chars)"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            limits.check(request)
    limits.check(GenerateInput(list(range(50)), ok))  # token ids: bounded by max_model_len


def test_app_config_carries_and_checks_the_limits() -> None:
    config = AppConfig.from_args({"max_prompt_chars": "500", "max_body_bytes": 2048})
    assert config.flow().limits == RequestLimits(max_body_bytes=2048, max_prompt_chars=500)
    with pytest.raises(ValueError, match="max_stop_strings must be an integer >= 1"):
        AppConfig.from_args({"max_stop_strings": 0})


def test_a_ray_start_that_times_out_is_tried_once_more(monkeypatch) -> None:
    """Ray's fixed 30 s wait for its raylet can pass on a loaded machine: start again once;
    any other failure, or a second timeout, is the caller's. (ray.init is faked here.)"""
    import ray

    from deployments import launch

    calls: list[str] = []
    outcomes: list[Exception | None] = []

    def fake_init(**kwargs) -> None:
        calls.append("init")
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    timeout = Exception("The current node timed out during startup. This could happen ...")
    outcomes[:] = [timeout, None]
    launch._init_local_ray(2, launch.ServeOptions())
    assert calls == ["init", "shutdown", "init"]
    calls.clear()
    outcomes[:] = [timeout, timeout]
    with pytest.raises(Exception, match="timed out during startup"):
        launch._init_local_ray(2, launch.ServeOptions())
    calls.clear()
    gcs = RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc")
    outcomes[:] = [gcs, None]
    launch._init_local_ray(2, launch.ServeOptions())
    assert calls == ["init", "shutdown", "init"]
    outcomes[:] = [RuntimeError("port in use")]
    with pytest.raises(RuntimeError, match="port in use"):
        launch._init_local_ray(2, launch.ServeOptions())


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    """A port from the ephemeral range could be taken as a connection's source port before
    the proxy binds it (seen: Serve's HTTP proxy failing with 'Address already in use')."""
    import socket

    from deployments.launch import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), (low, ports)
    assert len(ports) > 1  # drawn, not one fixed port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
