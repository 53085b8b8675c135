"""`pdserve serve` (what `make serve` runs) as a real process: it comes up with the default
model, `pdserve client` gets the same completion as offline `pdserve generate`, and Ctrl-C
(SIGINT) shuts it down cleanly."""

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
    lines = _Lines(proc)
    try:
        lines.wait_for("press Ctrl-C", 240)
        assert any(f"gRPC on 127.0.0.1:{grpc_port}" in line for line in lines.seen)
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
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    output = lines.rest(30)
    assert proc.returncode == 0, output
    assert "shutting down" in output
