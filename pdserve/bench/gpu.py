"""`pdserve bench gpu`: the GPU check — the kernels, decode speed against the HBM bound, parity
— in one run of a few minutes, as one JSON object. Run from a source checkout (the kernels'
tests and the parity suite are the repository's `tests/`).

Sections, most important first, each written to `--out-dir` as it completes (a device run
that hits its time limit still returns what it finished); none starts after `--deadline-s`:
- kernels: the Triton kernels' tests (tests/unit/test_triton_kernels.py) compiled on the GPU;
- smollm2: decode tokens/s at 1 and 32 streams on SmolLM2-135M's shape (random bf16 weights,
  `load_format=dummy`: no model file needs to reach the machine, and a step's time does not
  depend on the weights' values), with the Triton backend and with the earlier `cuda`
  backend, CUDA graphs on, and each step's kernel count per layer;
- llama3_8b: the same on Llama-3-8B's shape (random bf16 weights, `load_format=dummy`), as a
  fraction of the HBM bound (read bandwidth measured in the same run / weight bytes);
- parity: the parity suite on CUDA (float32, transformers as the oracle) with the new default;
- offline: `bench offline` against transformers on the same GPU and weights;
- checksums: the KV block checksum's Triton kernel against torch's ops and a copy in HBM
  (tools/device_check.py, its JSON as it prints it);
- nixl_vram: NIXL between buffers in GPU memory — not measured yet; the JSON says why.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.flags import Flag, str_list

SECTIONS = ("kernels", "smollm2", "llama3_8b", "parity", "offline", "checksums", "nixl_vram")
_PARITY_TESTS = (
    "tests/model/test_parity.py",
    "tests/model/test_decode_graphs.py",
    "tests/model/test_triton_backend.py",
    "tests/model/test_dummy_weights.py",
)


@dataclass(frozen=True)
class GpuBenchConfig:
    sections: tuple[str, ...] = SECTIONS
    """which sections to run, comma-separated"""
    output_len: int = 64
    """decode steps timed per run"""
    repeats: int = 2
    """runs of each decode figure (the best is kept)"""
    deadline_s: float = 420.0
    """no section starts after this many seconds"""
    out_dir: str = ""
    """write each section's JSON here as it completes"""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")


def run(config: GpuBenchConfig) -> dict[str, Any]:
    import torch
    import triton

    if not torch.cuda.is_available():
        raise ValueError("bench gpu needs a CUDA device")
    report: dict[str, Any] = {
        "benchmark": "gpu",
        "config": asdict(config),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    start = time.perf_counter()
    runners = {
        "kernels": lambda: _pytest(["tests/unit/test_triton_kernels.py"]),
        "smollm2": lambda: _smollm2(config),
        "llama3_8b": lambda: _llama3_8b(config),
        "parity": lambda: _pytest(list(_PARITY_TESTS)),
        "offline": _offline,
        "checksums": _checksums,
        "nixl_vram": _nixl_vram,
    }
    for name in (s for s in SECTIONS if s in config.sections):
        if time.perf_counter() - start > config.deadline_s:
            report[name] = {"skipped": f"past the {config.deadline_s:.0f} s deadline"}
            continue
        began = time.perf_counter()
        try:
            report[name] = runners[name]()
        except Exception as exc:  # a section's failure is reported; the others still run
            report[name] = _error(exc)
        report[name]["seconds"] = round(time.perf_counter() - began, 1)
        _release_gpu_memory()
        if config.out_dir:
            out = Path(config.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"gpu_{name}.json").write_text(json.dumps(report[name]))
    return report


def _error(exc: Exception) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _release_gpu_memory() -> None:
    """Engines of one section gone before the next sizes its KV cache from the free memory."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _pytest(paths: list[str]) -> dict[str, Any]:
    """The tests on the GPU (`--device cuda`), in a process of their own: counts and failures."""
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        return {"skipped": f"run from a source checkout: {missing[0]} is not here"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", "cuda"]
    done = subprocess.run([*args, *paths], capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else done.stderr.strip()[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|skipped)", summary)}
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20]
    return {"returncode": done.returncode, **counts, "summary": summary, "failures": failures}


def _decode(model: str, config: GpuBenchConfig, attention: str, load_format: str) -> dict:
    """bench latency's figures for one engine: tokens/s at 1 and 32 streams, the bound, the
    kernels per layer."""
    from pdserve.bench import latency

    bench = latency.LatencyBenchConfig(
        model=model,
        output_len=config.output_len,
        batch_sizes=(1, 32),
        repeats=config.repeats,
        device="cuda",
        dtype="bfloat16",
        attention_backend=attention,
        load_format=load_format,
    )
    report = latency.run(bench)
    batches = report["batches"]
    single, many = batches["1"], batches["32"]
    return {
        "attention_backend": report["attention_backend"],
        "weight_bytes": report["weight_bytes"],
        "read_bandwidth_gbps": report["read_bandwidth_gbps"],
        "bandwidth_bound_tokens_per_s": report["bandwidth_bound_tokens_per_s"],
        "single_stream_tokens_per_s": single["decode_tokens_per_s"],
        "fraction_of_bandwidth_bound": single["fraction_of_bandwidth_bound"],
        "eager_single_stream_tokens_per_s": single.get("eager_tokens_per_s"),
        # The figures above are the engine's default step mode's (sync); async scheduling's:
        "async_single_stream_tokens_per_s": single["async_scheduling_tokens_per_s"],
        "async_streams_32_tokens_per_s": many["async_scheduling_tokens_per_s"],
        "streams_32_tokens_per_s": many["decode_tokens_per_s"],
        "streams_32_over_single": round(
            many["decode_tokens_per_s"] / single["decode_tokens_per_s"], 2
        ),
        "ms_per_step": {"1": single["ms_per_step"], "32": many["ms_per_step"]},
        "kernels": report.get("kernels"),
    }


def _smollm2(config: GpuBenchConfig) -> dict[str, Any]:
    from engine.testing.shaped_checkpoint import shaped_config_dir

    model = str(shaped_config_dir("smollm2-135m"))
    sides: dict[str, Any] = {}
    for attention in ("triton", "cuda"):  # one failing leaves the other's figures
        try:
            sides[attention] = _decode(model, config, attention, "dummy")
        except Exception as exc:
            sides[attention] = _error(exc)
        _release_gpu_memory()
    new, old = sides["triton"], sides["cuda"]
    if "error" not in new and "error" not in old:
        single = new["single_stream_tokens_per_s"]
        sides["triton_over_cuda"] = {
            "1": round(single / old["single_stream_tokens_per_s"], 2),
            "32": round(new["streams_32_tokens_per_s"] / old["streams_32_tokens_per_s"], 2),
        }
    return sides


def _llama3_8b(config: GpuBenchConfig) -> dict[str, Any]:
    from engine.testing.shaped_checkpoint import shaped_config_dir

    return _decode(str(shaped_config_dir("llama-3-8b")), config, "triton", "dummy")


def _offline() -> dict[str, Any]:
    from engine.testing.shaped_checkpoint import shaped_checkpoint
    from pdserve.bench import offline

    model = str(shaped_checkpoint("smollm2-135m"))  # weights on disk: transformers reads them
    return offline.run(offline.OfflineBenchConfig(model=model, device="cuda"))


def _checksums() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "tools/device_check.py"], capture_output=True, text=True, timeout=300
    )
    lines = done.stdout.strip().splitlines()
    if not lines:
        return {"returncode": done.returncode, "error": done.stderr.strip()[-1000:]}
    return {"returncode": done.returncode, **json.loads(lines[-1])}


def _nixl_vram() -> dict[str, Any]:
    """Not measured yet, and why (the section stays so that the JSON says so every run)."""
    try:
        import nixl  # noqa: F401
    except ImportError:
        return {"skipped": "the nixl package is not installed here: the VRAM path is unmeasured"}
    return {"skipped": "nixl is here, but bench kv moves host-memory blocks only so far"}


CONFIG = GpuBenchConfig
FLAGS = {"sections": Flag(parse=str_list)}
