"""`pdserve serve` (what `make serve` runs) as a real process on its default model, SmolLM2-135M-
Instruct: `pdserve client` answers a question, gets the same completion as offline `pdserve
generate`, the OpenAI SDK chats with it (disaggregated and colocated), and Ctrl-C (SIGINT) shuts
it down cleanly."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.integration.serve_utils import free_port

pytestmark = pytest.mark.integration

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


class _Lines:
    """A process's output lines, read by a thread (select() on a buffered pipe would miss lines
    already sitting in Python's buffer)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if needle in line:
                return
        raise AssertionError(f"no {needle!r} from pdserve serve; output:\n{''.join(self.seen)}")

    def rest(self, timeout_s: float) -> str:
        self._thread.join(timeout_s)
        while not self._queue.empty():
            line = self._queue.get_nowait()
            if line is not None:
                self.seen.append(line)
        return "".join(self.seen)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(PDSERVE + args, capture_output=True, text=True, timeout=300)


QUESTION = "What is the capital of France?"
CAPITAL_SCHEMA = {
    "name": "capital",
    "schema": {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    },
}


def test_pdserve_serve_then_client_then_ctrl_c() -> None:
    grpc_port, http_port = free_port(), free_port()
    engine_args = json.dumps({"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20})
    proc = subprocess.Popen(
        [
            *PDSERVE,
            "serve",
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--num-cpus",
            "4",
            "--num-cpus-per-engine",
            "0.5",
            "--with-colocated",
            "--engine-args",
            engine_args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
        start_new_session=True,
    )
    lines = _Lines(proc)
    try:
        lines.wait_for("press Ctrl-C", 300)
        assert any(f"gRPC on 127.0.0.1:{grpc_port}" in line for line in lines.seen)
        assert any("serving model 'smollm2'" in line for line in lines.seen), lines.seen
        _check_grpc_client(grpc_port)
        _check_openai_sdk(http_port)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    output = lines.rest(30)
    assert proc.returncode == 0, output
    assert "shutting down" in output


def _check_grpc_client(grpc_port: int) -> None:
    target = ["--target", f"127.0.0.1:{grpc_port}"]
    # The README's command: a question, answered through the model's chat template.
    answer = _run(["client", *target, "--prompt", QUESTION, "--max-tokens", "24"])
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout
    served = _run(["client", *target, "--prompt", QUESTION, "--max-tokens", "12", "--json"])
    assert served.returncode == 0, served.stderr
    offline = _run(["generate", "--prompt", QUESTION, "--max-tokens", "12", "--json"])
    assert offline.returncode == 0, offline.stderr
    assert json.loads(served.stdout) == json.loads(offline.stdout)
    # --raw: the text as it is, no template (an instruct model may just end its turn).
    raw = _run(["client", *target, "--raw", "--prompt", "Hello", "--max-tokens", "4", "--json"])
    raw_offline = _run(["generate", "--raw", "--prompt", "Hello", "--max-tokens", "4", "--json"])
    assert json.loads(raw.stdout) == json.loads(raw_offline.stdout)
    assert (
        json.loads(raw.stdout)["prompt_token_ids"] != json.loads(served.stdout)["prompt_token_ids"]
    )
    bad = _run(["client", *target, "--prompt", "Hello", "--max-tokens", "0"])
    assert bad.returncode == 2 and "max_tokens" in bad.stderr


def _check_openai_sdk(http_port: int) -> None:
    import openai

    contents: list[str] = []
    for prefix in ("", "/colocated"):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}{prefix}/v1", api_key="x")
        assert [model.id for model in client.models.list().data] == ["smollm2"]
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content, (prefix, reply)
        assert reply.choices[0].finish_reason == "stop"
        structured = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"{QUESTION} Answer in JSON."}],
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": CAPITAL_SCHEMA},
        )
        value = json.loads(structured.choices[0].message.content)
        assert set(value) == {"country", "capital"} and isinstance(value["capital"], str)
        contents.append(structured.choices[0].message.content)
        with pytest.raises(openai.BadRequestError, match="tools is not supported"):
            client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": QUESTION}],
                tools=[{"type": "function", "function": {"name": "lookup", "parameters": {}}}],
            )
    assert contents[0] == contents[1]  # disaggregated == colocated, greedy
