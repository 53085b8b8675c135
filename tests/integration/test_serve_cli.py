"""`pdserve serve` (what `make serve` runs) as a real process on its default model, SmolLM2-135M-
Instruct: `pdserve client` answers a question, gets the same completion as offline `pdserve
generate`, the OpenAI SDK chats with it (disaggregated and colocated), Serve's CLI and a
Prometheus scrape see it, and SIGTERM shuts it down cleanly."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deployments.launch import free_port
from deployments.metrics import ReplicaMetrics
from deployments.replica.telemetry import EngineMetrics
from deployments.router.telemetry import RouterMetrics
from tests.prometheus_relabel import monitor_rules, relabel
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
ROOT = Path(__file__).resolve().parents[2]


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


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        PDSERVE + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _end(processes: Iterable[subprocess.Popen[str]]) -> None:
    """Kill and reap those still running or unread (one already read by `_output` is done)."""
    for process in processes:
        if process.poll() is None:
            process.kill()
        if process.stdout is not None and not process.stdout.closed:
            process.communicate()


def _output(process: subprocess.Popen[str]) -> Any:
    """A `--json` command's output, once it has ended successfully."""
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    return json.loads(stdout)


QUESTION = "What is the capital of France?"
# What `pdserve generate` answers offline, for the served answers to equal.
OFFLINE = {
    "chat": ["generate", "--prompt", QUESTION, "--max-tokens", "12", "--json"],
    "raw": ["generate", "--raw", "--prompt", "Hello", "--max-tokens", "4", "--json"],
}
CAPITAL_SCHEMA = {
    "name": "capital",
    "schema": {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    },
}


@dataclass(frozen=True)
class Ports:
    grpc: int
    http: int
    dashboard: int
    metrics: int


def test_pdserve_serve_then_clients_dashboard_metrics_then_sigterm() -> None:
    """What an operator does: serve, call it, ask Serve's own CLI for its status, scrape its
    Prometheus metrics, then stop it with SIGTERM (what Kubernetes and systemd send): it shuts
    down as Ctrl-C does, leaving no Ray process behind."""
    ports = Ports(free_port(), free_port(), free_port(), free_port())
    # The offline answers the served ones must equal, computed while the app starts (much of
    # which is waiting on Ray).
    offline: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, args in OFFLINE.items():
            offline[name] = _start(args)
        proc, lines, ray_processes = _serve_and_check(ports, offline)
    finally:
        _end(offline.values())
    _check_clean_shutdown(proc, lines, ray_processes)


def _serve_and_check(
    ports: Ports, offline: dict[str, subprocess.Popen[str]]
) -> tuple[subprocess.Popen[str], _Lines, list[psutil.Process]]:
    """Start `pdserve serve`, check it with every client, then SIGTERM it."""
    proc = _start_pdserve_serve(ports)
    lines = _Lines(proc)
    ray_processes: list[psutil.Process] = []
    try:
        lines.wait_for("press Ctrl-C", 300)
        _check_what_it_printed("".join(lines.seen), ports)
        _check_metrics_at_start(ports.metrics)
        ray_processes = psutil.Process(proc.pid).children(recursive=True)
        _check_grpc_client(ports.grpc, {name: _output(p) for name, p in offline.items()})
        _check_openai_sdk(ports.http)
        _check_serve_status(ports.dashboard)
        _check_metrics_scrape(ports.http, ports.metrics)
    finally:
        _sigterm(proc)
    return proc, lines, ray_processes


def _start_pdserve_serve(ports: Ports) -> subprocess.Popen[str]:
    """`pdserve serve` on its default model (SmolLM2), the colocated app beside it."""
    engine_args = json.dumps({"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20})
    return subprocess.Popen(
        [
            *PDSERVE,
            "serve",
            "--grpc-port",
            str(ports.grpc),
            "--http-port",
            str(ports.http),
            "--dashboard-port",
            str(ports.dashboard),
            "--metrics-export-port",
            str(ports.metrics),
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
        # Ray exports metrics every 10 s by default; a shorter period shortens the wait here.
        env={**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_metrics_report_interval_ms": "1000"},
        start_new_session=True,
    )


def _check_what_it_printed(printed: str, ports: Ports) -> None:
    assert f"gRPC on 127.0.0.1:{ports.grpc}" in printed
    assert "serving model 'smollm2'" in printed, printed
    assert (
        f"RAY_AUTH_MODE=token serve status --address http://127.0.0.1:{ports.dashboard}" in printed
    ), printed
    assert f"Prometheus metrics on http://127.0.0.1:{ports.metrics}/metrics" in printed


def _sigterm(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def _check_clean_shutdown(
    proc: subprocess.Popen[str], lines: _Lines, ray_processes: list[psutil.Process]
) -> None:
    output = lines.rest(30)
    assert proc.returncode == 0, output
    assert "shutting down" in output
    assert "must be >0" not in output  # the metrics sampler never failed
    assert len(ray_processes) > 3  # GCS, raylet, agents, workers...
    _, alive = psutil.wait_procs(ray_processes, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]


def _check_serve_status(dashboard_port: int) -> None:
    """Serve's own CLI works against `pdserve serve` (it talks to Ray's dashboard)."""
    serve_cli = str(Path(sys.executable).parent / "serve")
    address = f"http://127.0.0.1:{dashboard_port}"
    status = subprocess.run(
        [serve_cli, "status", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "RAY_AUTH_MODE": "token",  # as pdserve serve prints it
            # It imports the app's request routers: this checkout's, whatever is installed.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
    )
    assert status.returncode == 0, status.stderr
    apps = yaml.safe_load(status.stdout)["applications"]
    assert {name: app["status"] for name, app in apps.items()} == {
        "pdserve": "RUNNING",
        "colocated": "RUNNING",
    }, status.stdout


def _scrape(metrics_port: int) -> list[Any]:
    """Every sample of a real scrape of Ray's Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


class _StartedNames(ReplicaMetrics):
    """The sample names of what a replica's metrics start at 0 (histograms cannot be)."""

    def __init__(self) -> None:
        super().__init__({})
        self.names: set[str] = set()

    def counter(self, name: str, description: str, tag_keys: Any = (), start: Any = ({},)) -> Any:
        if list(start):
            self.names.add(f"ray_{name}_total")

    def gauge(self, name: str, description: str) -> Any:
        self.names.add(f"ray_{name}")

    def histogram(self, *args: Any, **kwargs: Any) -> Any:
        return None


def _check_metrics_at_start(metrics_port: int) -> None:
    """Before any request, a fresh Ray's scrape has every counter and gauge of the P/D app's
    router and engines, at 0 (what an alert on them reads on a healthy app); every pdserve
    series carries the replica's rank, not Serve's per-restart replica id; and after the
    PodMonitor's rules no label of Ray's session is left and no two series became one."""
    started = _StartedNames()
    EngineMetrics("nixl", started)
    RouterMetrics(("decode", "prefill"), started)
    samples: list[Any] = []

    def all_exported() -> bool:
        samples[:] = _scrape(metrics_port)
        ours = {s.name for s in samples if s.labels.get("application") == "pdserve"}
        return started.names <= ours

    assert wait_until(all_exported, 90, period_s=1.0), sorted(
        started.names - {s.name for s in samples}
    )
    pdserve = [s for s in samples if s.name.startswith("ray_pdserve_")]
    assert all(s.value == 0 for s in pdserve if s.name in started.names), [
        (s.name, s.labels, s.value) for s in pdserve if s.value
    ]
    assert all("rank" in s.labels and "replica" not in s.labels for s in pdserve)
    (monitor,) = yaml.safe_load_all((ROOT / "k8s" / "monitoring.yaml").read_text())
    rules = monitor_rules(monitor)
    scraped = [(s.name, tuple(sorted(relabel(s.labels, rules).items()))) for s in samples]
    assert len(set(scraped)) == len(scraped)
    assert not any(
        dict(labels).keys() & {"SessionName", "otel_scope_name"} for _, labels in scraped
    )


def _check_metrics_scrape(http_port: int, metrics_port: int) -> None:
    """A real scrape of Ray's Prometheus endpoint after a request whose prompt the prefix cache
    has never seen (lookups, no hits): the engines' hit-rate gauge reads 0 and the lookups are
    counted — the sample that once failed on Ray's refusal of `inc(0)`."""
    prompt = "Zebras in violet raincoats debate quantum knitting under seventeen moons " * 3
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions",
        body,
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200

    def scrape() -> dict[str, list[float]]:
        values: dict[str, list[float]] = {}
        for sample in _scrape(metrics_port):
            values.setdefault(sample.name, []).append(sample.value)
        return values

    def zero_hit_sample_seen() -> bool:
        values = scrape()
        return 0.0 in values.get("ray_pdserve_prefix_cache_hit_rate", []) and any(
            v > 0 for v in values.get("ray_pdserve_prefix_cache_queries_total", [])
        )

    assert wait_until(zero_hit_sample_seen, 90, period_s=1.0), sorted(
        name for name in scrape() if "pdserve" in name
    )


def _check_grpc_client(grpc_port: int, offline: dict[str, Any]) -> None:
    """`pdserve client`: the README's question, then the same prompts as `offline` (OFFLINE's
    answers), which it must answer alike."""
    target = ["--target", f"127.0.0.1:{grpc_port}"]
    # The README's command: a question, answered through the model's chat template.
    answer = _run(["client", *target, "--prompt", QUESTION, "--max-tokens", "24"])
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout
    served = _run(["client", *target, *OFFLINE["chat"][1:]])
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout) == offline["chat"]
    # --raw: the text as it is, no template (an instruct model may just end its turn).
    raw = _run(["client", *target, *OFFLINE["raw"][1:]])
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout) == offline["raw"]
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
