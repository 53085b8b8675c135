"""`pdserve bench offline`: engine throughput against transformers.generate, same run.

Two workloads on the same model, greedy:
- fixed: every prompt `input_len` tokens, every request `output_len` tokens. HF's static
  batch wastes nothing here, so this measures the raw forward pass (both are compute-bound).
- mixed: prompt lengths U[input_len/4, input_len], output lengths U[output_len/8, output_len].
  HF left-pads the batch and runs every row to the longest output; the engine (continuous
  batching, paged KV) computes only what each request needs.
Throughput counts only the tokens each request asked for. Each side gets one warm-up.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.catalog import SMOLLM2_MODEL, is_gguf_path
from pdserve.flags import Flag


@dataclass(frozen=True)
class OfflineBenchConfig:
    model: str = SMOLLM2_MODEL
    """the model both engines run"""
    num_prompts: int = 32
    """prompts per workload"""
    input_len: int = 128
    """prompt tokens (the mixed workload varies around it)"""
    output_len: int = 128
    """output tokens (the mixed workload varies around it)"""
    seed: int = 0
    """the prompts' random tokens"""
    device: str = "auto"
    """cpu or cuda (auto: cuda when there is one)"""
    skip_hf: bool = False
    """the engine's figures only, without transformers.generate"""
    workloads: tuple[str, ...] = ("fixed", "mixed")
    """fixed (every prompt alike) and mixed (lengths drawn around the given ones)"""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for workload in self.workloads:
            if workload not in ("fixed", "mixed"):
                raise ValueError(f"unknown workload {workload!r}; choose fixed or mixed")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(config: OfflineBenchConfig, kind: str, vocab_size: int) -> Workload:
    rng = random.Random(config.seed)
    low = min(16, vocab_size - 1)  # the lowest ids are special tokens in small vocabularies
    prompts, outputs = [], []
    for _ in range(config.num_prompts):
        if kind == "fixed":
            length, out = config.input_len, config.output_len
        else:
            length = rng.randint(max(1, config.input_len // 4), config.input_len)
            out = rng.randint(max(1, config.output_len // 8), config.output_len)
        prompts.append([rng.randrange(low, vocab_size) for _ in range(length)])
        outputs.append(out)
    return Workload(prompts, outputs)


def _run_engine(llm: Any, workload: Workload) -> tuple[float, list[list[int]]]:
    from engine.request import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outputs]


def _run_hf(model: Any, device: str, workload: Workload) -> tuple[float, list[list[int]]]:
    longest = max(len(p) for p in workload.prompts)
    # Left padding, as HF generation requires for decoder-only batches.
    ids = torch.zeros((len(workload.prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(workload.prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    max_new = max(workload.output_lens)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
    generated = out[:, longest:].tolist()
    return elapsed, [row[:n] for row, n in zip(generated, workload.output_lens, strict=True)]


def _load_hf(path: str, device: str, dtype: str) -> Any:
    """transformers on the same weights, device and dtype as the engine (fair figures)."""
    try:
        import transformers
    except ImportError as exc:
        raise ValueError("bench offline needs transformers (pip install transformers)") from exc
    if is_gguf_path(path):  # transformers dequantizes a GGUF file too, to the same weights
        file = Path(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=getattr(torch, dtype)
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()  # type: ignore[arg-type]


def run(config: OfflineBenchConfig) -> dict[str, Any]:
    from engine.llm import LLM
    from engine.models import ModelArchConfig

    llm = LLM(
        config.model,
        device=config.device,
        max_model_len=config.input_len + config.output_len,
        max_num_seqs=config.num_prompts,
        seed=config.seed,
    )
    path = llm.engine.config.model.model
    device = llm.engine.config.model.device
    vocab_size = ModelArchConfig.from_pretrained(path).vocab_size
    dtype = llm.engine.config.model.dtype
    hf = None if config.skip_hf else _load_hf(path, device, dtype)
    warm = Workload([[20, 21, 22]] * 2, [4, 4])
    _run_engine(llm, warm)
    if hf is not None:
        _run_hf(hf, device, warm)
    report: dict[str, Any] = {
        "benchmark": "offline",
        "config": asdict(config),
        "device": device,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
    }
    for kind in config.workloads:
        workload = make_workload(config, kind, vocab_size)
        seconds, tokens = _run_engine(llm, workload)
        entry: dict[str, Any] = {"engine": _throughput(seconds, workload)}
        if hf is not None:
            hf_seconds, hf_tokens = _run_hf(hf, device, workload)
            entry["transformers"] = _throughput(hf_seconds, workload)
            entry["speedup"] = round(hf_seconds / seconds, 3)
            same = sum(a == b for a, b in zip(tokens, hf_tokens, strict=True))
            entry["greedy_outputs_identical"] = f"{same}/{config.num_prompts}"
        report[kind] = entry
    return report


def _throughput(seconds: float, workload: Workload) -> dict[str, float]:
    total = workload.num_output_tokens + workload.num_prompt_tokens
    return {
        "seconds": round(seconds, 6),
        "output_tokens_per_s": round(workload.num_output_tokens / seconds, 1),
        "total_tokens_per_s": round(total / seconds, 1),
    }


CONFIG = OfflineBenchConfig
FLAGS = {"workloads": Flag(name="--workload", choices=("fixed", "mixed"), repeat=True)}
