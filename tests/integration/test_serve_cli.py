"""`pdserve serve` (what `make serve` runs) as a real process: it comes up with the default
model, `pdserve client` gets the same completion as offline `pdserve generate`, and Ctrl-C
(SIGINT) shuts it down cleanly."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.serve_utils import free_port

pytestmark = pytest.mark.integration

PDSERVE = [sys.executable, "-m", "deployments.cli"]


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if needle in line:
                return lines
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no {needle!r} from pdserve serve; output so far:\n{''.join(lines)}")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(PDSERVE + args, capture_output=True, text=True, timeout=300)


def test_pdserve_serve_then_client_then_ctrl_c() -> None:
    grpc_port, http_port = free_port(), free_port()
    engine_args = json.dumps({"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20})
    proc = subprocess.Popen(
        [
            *PDSERVE,
            "serve",
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--num-cpus-per-engine",
            "0.5",
            "--engine-args",
            engine_args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "RAY_DEDUP_LOGS": "0"},
        start_new_session=True,
    )
    try:
        lines = _wait_for_line(proc, "press Ctrl-C", 240)
        assert any(f"gRPC on 127.0.0.1:{grpc_port}" in line for line in lines)
        target = ["--target", f"127.0.0.1:{grpc_port}"]
        served = _run(["client", *target, "--prompt", "Hello", "--max-tokens", "12", "--json"])
        assert served.returncode == 0, served.stderr
        offline = _run(["generate", "--prompt", "Hello", "--max-tokens", "12", "--json"])
        assert offline.returncode == 0, offline.stderr
        assert json.loads(served.stdout) == json.loads(offline.stdout)
        plain = _run(["client", *target, "--prompt", "Hello", "--max-tokens", "12"])
        assert plain.stdout.strip() == json.loads(offline.stdout)["text"].strip()
        bad = _run(["client", *target, "--prompt", "Hello", "--max-tokens", "0"])
        assert bad.returncode == 2 and "max_tokens" in bad.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, rest
    assert "shutting down" in rest
