"""`pdserve bench tp`: decode tokens/s of one engine at tensor_parallel_size N against one at
size 1, on the same cores, in one run.

Both engines live in this process (rank 0 of the split one, with its followers beside it) and
take turns: each repeat times every batch size on each engine, so a noisy moment hurts both.
The single-rank engine computes with all of this process's threads (`torch_threads`); the
split one with `torch_threads // N` per rank, each rank pinned to cores of its own where
there are enough. Decode is timed from the first sampled token to the last by the engine's
timestamps, best of `repeats`. `collective_share` is the part of rank 0's decode time spent
in all-reduce and all-gather (exchanging, and waiting for the slower rank).

The default model is random weights in Qwen2.5-0.5B's shape: 14 query and 2 KV heads split in
two (SmolLM2's 9 query heads do not), built once into the pdserve cache.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.bench.stats import decode_seconds
from pdserve.flags import Flag, int_list

DEFAULT_SHAPE = "qwen2.5-0.5b"


@dataclass(frozen=True)
class TPBenchConfig:
    model: str = ""
    """a model (name, directory or .gguf); none: random weights of Qwen2.5-0.5B's shape"""
    tensor_parallel_size: int = 2
    """ranks of the split engine (the other has one)"""
    collectives: str = "auto"
    """the split engine's tensor_parallel_collectives: auto, shm, torch"""
    input_len: int = 32
    """prompt tokens"""
    output_len: int = 64
    """decode steps timed"""
    batch_sizes: tuple[int, ...] = (1, 32)
    """decode batch sizes, comma-separated"""
    repeats: int = 3
    """runs of each, alternating engines"""
    seed: int = 0
    """the prompts' random tokens"""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 2:
            raise ValueError(f"tensor_parallel_size must be >= 2, got {self.tensor_parallel_size}")
        if self.output_len < 2 or self.input_len < 1 or self.repeats < 1:
            raise ValueError("input_len >= 1, output_len >= 2 and repeats >= 1, please")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")


def run(config: TPBenchConfig) -> dict[str, Any]:
    from engine.llm import LLM

    model = config.model or str(_default_model())
    shown = config.model or f"random weights in {DEFAULT_SHAPE}'s shape"
    threads = torch.get_num_threads()
    args = dict(
        max_model_len=config.input_len + config.output_len,
        max_num_seqs=max(config.batch_sizes),
        seed=config.seed,
        enable_prefix_caching=False,  # each timed run does the same work
        device="cpu",
    )
    single = LLM(model, **args)
    split = LLM(
        model,
        tensor_parallel_size=config.tensor_parallel_size,
        tensor_parallel_collectives=config.collectives,
        **args,
    )
    engines = {1: (single, threads), config.tensor_parallel_size: (split, torch.get_num_threads())}
    try:
        return _measure(config, shown, threads, engines)
    finally:
        torch.set_num_threads(threads)
        split.close()


def _default_model() -> Any:
    from engine.testing.shaped_checkpoint import shaped_checkpoint

    return shaped_checkpoint(DEFAULT_SHAPE)


def _measure(
    config: TPBenchConfig, model: str, threads: int, engines: dict[int, tuple[Any, int]]
) -> dict[str, Any]:
    from engine.request import SamplingParams

    rng = random.Random(config.seed)
    vocab = engines[1][0].engine.arch.vocab_size
    prompts = {
        n: [[rng.randrange(10, vocab) for _ in range(config.input_len)] for _ in range(n)]
        for n in config.batch_sizes
    }
    params = SamplingParams(max_tokens=config.output_len, temperature=0.0, ignore_eos=True)
    best = {(tp, n): float("inf") for tp in engines for n in config.batch_sizes}
    shares: dict[int, list[float]] = {n: [] for n in config.batch_sizes}
    for llm, per_rank in engines.values():  # warm-up: kernels, primitives, pages
        torch.set_num_threads(per_rank)
        llm.generate([{"prompt_token_ids": p} for p in prompts[max(prompts)]], params)
    for _ in range(config.repeats):
        for n, batch in prompts.items():
            for tp, (llm, per_rank) in engines.items():
                torch.set_num_threads(per_rank)
                group = llm.engine.runner.group
                before, start = group.seconds, time.perf_counter()
                outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
                wall = time.perf_counter() - start
                best[(tp, n)] = min(best[(tp, n)], decode_seconds(outputs))
                if tp > 1:  # rank 0's time in collectives over the run (its prefill too)
                    shares[n].append((group.seconds - before) / max(wall, 1e-9))
    size = config.tensor_parallel_size
    report: dict[str, Any] = {
        "benchmark": "tp",
        "config": asdict(config),
        "model": model,
        "torch_threads": threads,
        "threads_per_rank": engines[size][1],
        "collectives": type(engines[size][0].engine.runner.group).__name__,
        "batches": {},
    }
    for n in config.batch_sizes:
        tokens = n * (config.output_len - 1)
        one, many = tokens / best[(1, n)], tokens / best[(size, n)]
        report["batches"][str(n)] = {
            "tp1_decode_tokens_per_s": round(one, 1),
            f"tp{size}_decode_tokens_per_s": round(many, 1),
            f"tp{size}_to_tp1": round(many / one, 3),
            "collective_share": round(min(shares[n]), 3),
        }
    return report


CONFIG = TPBenchConfig
FLAGS = {"batch_sizes": Flag(parse=int_list)}
