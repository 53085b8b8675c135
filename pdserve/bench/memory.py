"""An engine's resident memory, measured alone in a fresh process (`bench latency --memory`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# Runs in a fresh interpreter: an engine alone, its resident memory after it has generated.
_MEMORY_SCRIPT = """
import json, sys
def rss_mb(field="VmRSS"):
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith(field + ":")) / 1024
import torch
from engine.layers import cpu_kernels
from engine.llm import LLM
from engine.request import SamplingParams
try:
    cpu_kernels.load()
except cpu_kernels.KernelBuildError:
    pass
baseline, baseline_anon = rss_mb(), rss_mb("RssAnon")
llm = LLM(sys.argv[1], linear_backend=sys.argv[2], device="cpu", max_model_len=256,
          kv_cache_memory_bytes=int(sys.argv[3]), dtype=sys.argv[4])
llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
kv = llm.engine.runner.kv_cache
print(json.dumps({"baseline_mb": baseline, "engine_mb": rss_mb() - baseline,
                  "engine_anon_mb": rss_mb("RssAnon") - baseline_anon,
                  "kv_pool_mb": kv.numel() * kv.element_size() / 2**20,
                  "model": str(llm.engine.config.model.model)}))
"""
_MEMORY_KV_BYTES = 64 << 20


def engine_memory(model: str, backend: str, dtype: str = "auto") -> dict[str, Any]:
    """An engine's resident memory beyond the interpreter with torch and the kernels loaded
    (`baseline_mb`), measured alone in a fresh process on the CPU (one rank) with a 64 MiB KV
    pool, against its file
    (GGUF) or checkpoint size and the pool: `engine_over_file` = (engine - pool) / file, from
    all resident pages (VmRSS: the code of the libraries it loads, such as the tokenizer's,
    included) and `engine_anon_over_file` from the memory it allocated (RssAnon)."""
    args = [sys.executable, "-c", _MEMORY_SCRIPT, model, backend, str(_MEMORY_KV_BYTES), dtype]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"the memory probe failed: {last}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    path = Path(found.pop("model"))
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    file_mb = sum(os.path.getsize(f) for f in files) / 2**20
    over = (found["engine_mb"] - found["kv_pool_mb"]) / file_mb
    anon_over = (found["engine_anon_mb"] - found["kv_pool_mb"]) / file_mb
    rounded = {key: round(value, 1) for key, value in found.items()}
    return {
        **rounded,
        "file_mb": round(file_mb, 1),
        "engine_over_file": round(over, 3),
        "engine_anon_over_file": round(anon_over, 3),
    }
