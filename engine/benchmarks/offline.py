"""`pdserve bench offline`: engine throughput against transformers.generate, same run.

Same model, same prompts (random token ids of one length, so the HF batch needs no padding),
greedy, every request generating exactly `output_len` tokens. Both sides get one warm-up.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OfflineBenchConfig:
    model: str = "default"
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    device: str = "auto"
    skip_hf: bool = False

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _prompts(config: OfflineBenchConfig, vocab_size: int) -> list[list[int]]:
    rng = random.Random(config.seed)
    # Skip the lowest ids, where the special tokens of small vocabularies live.
    low = min(16, vocab_size - 1)
    return [
        [rng.randrange(low, vocab_size) for _ in range(config.input_len)]
        for _ in range(config.num_prompts)
    ]


def _run_engine(config: OfflineBenchConfig, prompts: list[list[int]]) -> dict[str, Any]:
    from engine.llm import LLM
    from engine.request import SamplingParams

    llm = LLM(
        config.model,
        device=config.device,
        max_model_len=config.input_len + config.output_len,
        max_num_seqs=config.num_prompts,
        seed=config.seed,
    )
    params = SamplingParams(temperature=0.0, max_tokens=config.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return {"seconds": elapsed, "tokens": tokens, "path": llm.engine.config.model.model}


def _run_hf(path: str, device: str, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    try:
        import transformers
    except ImportError as exc:
        raise ValueError("bench offline needs transformers (pip install transformers)") from exc
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device).eval()
    input_ids = torch.tensor(prompts, device=device)

    def generate(ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )

    with torch.no_grad():
        generate(input_ids[:2], 4)
        start = time.perf_counter()
        out = generate(input_ids, output_len)
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": out[:, input_ids.shape[1] :].tolist()}


def run(config: OfflineBenchConfig) -> dict[str, Any]:
    from engine.arg_utils import EngineArgs
    from engine.models import ModelArchConfig

    path = EngineArgs(model=config.model).model_path()
    vocab_size = ModelArchConfig.from_pretrained(path).vocab_size
    prompts = _prompts(config, vocab_size)
    engine = _run_engine(config, prompts)
    num_output = config.num_prompts * config.output_len
    report: dict[str, Any] = {
        "benchmark": "offline",
        "config": asdict(config),
        "torch_threads": torch.get_num_threads(),
        "engine": _throughput(engine["seconds"], num_output, config),
    }
    if not config.skip_hf:
        device = (
            "cuda"
            if "cuda" in config.device or (config.device == "auto" and torch.cuda.is_available())
            else "cpu"
        )
        hf = _run_hf(str(path), device, prompts, config.output_len)
        report["transformers"] = _throughput(hf["seconds"], num_output, config)
        report["speedup_output_tokens_per_s"] = round(hf["seconds"] / engine["seconds"], 2)
        same = sum(a == b for a, b in zip(engine["tokens"], hf["tokens"], strict=True))
        report["greedy_outputs_identical"] = f"{same}/{config.num_prompts}"
    return report


def _throughput(seconds: float, num_output: int, config: OfflineBenchConfig) -> dict[str, float]:
    total = num_output + config.num_prompts * config.input_len
    return {
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(num_output / seconds, 1),
        "total_tokens_per_s": round(total / seconds, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = OfflineBenchConfig()
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--input-len", type=int, default=defaults.input_len)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--skip-hf", action="store_true", help="engine figures only")


def config_from_args(args: argparse.Namespace) -> OfflineBenchConfig:
    return OfflineBenchConfig(
        model=args.model,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        device=args.device,
        skip_hf=args.skip_hf,
    )
