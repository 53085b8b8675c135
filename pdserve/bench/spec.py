"""`pdserve bench spec`: speculative decoding (n-gram, and a draft model with `--draft-model`)
against plain decoding, one stream.

The workload is where prompt lookup pays: a code edit — the model is asked to repeat a piece of
source (a module of this package) with one change, so its answer copies long spans of its own
prompt. Both engines load the same weights in this process and run alternately (a noisy moment
hurts both alike); decode speed excludes the prompt (a run is timed from its first token to
its last by the engine's timestamps, best of `repeats`). Greedy outputs must be identical:
drafts only change how many tokens a step verifies, never which.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

from engine.models.catalog import SMOLLM2_MODEL
from pdserve.bench.stats import decode_seconds


@dataclass(frozen=True)
class SpecBenchConfig:
    model: str = SMOLLM2_MODEL
    """the target model"""
    output_len: int = 128
    """output tokens per run"""
    num_speculative_tokens: int = 4
    """drafts per step at most"""
    prompt_lookup_max: int = 4
    """the longest n-gram looked up (method ngram)"""
    prompt_lookup_min: int = 1
    """the shortest n-gram looked up (method ngram)"""
    draft_model: str = ""
    """also speculate with this draft model (method draft_model; it must share the target's
    tokenizer), on the same prompts"""
    repeats: int = 3
    """runs of each method, alternating"""
    device: str = "auto"
    """cpu or cuda (auto: cuda when there is one)"""

    def __post_init__(self) -> None:
        if self.output_len < 2:
            raise ValueError(f"output_len must be >= 2, got {self.output_len}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


def code_edit_messages() -> list[dict[str, str]]:
    from engine.spec_decode import ngram

    source = inspect.getsource(ngram.propose_ngram)
    request = "Rewrite this Python function with the parameter `token_ids` renamed to `tokens`."
    return [{"role": "user", "content": f"{request} Reply with the code only.\n\n{source}"}]


def run(config: SpecBenchConfig) -> dict[str, Any]:
    from engine.inputs import render_chat
    from engine.llm import LLM

    common = {"device": config.device, "enable_prefix_caching": False, "max_model_len": 2048}
    k = config.num_speculative_tokens
    methods = {
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": config.prompt_lookup_max,
            "prompt_lookup_min": config.prompt_lookup_min,
        }
    }
    if config.draft_model:
        methods["draft_model"] = {
            "method": "draft_model",
            "model": config.draft_model,
            "num_speculative_tokens": k,
        }
    engines = {"plain": LLM(config.model, **common)}
    for name, speculative in methods.items():
        engines[name] = LLM(config.model, speculative_config=speculative, **common)
    _, prompt = render_chat(engines["plain"].tokenizer, code_edit_messages())
    runs: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for _ in range(config.repeats):
        for name, llm in engines.items():
            seconds, tokens = _decode_seconds(llm, prompt, config.output_len)
            runs[name].append(seconds)
            outputs[name] = tokens
    decode_tokens = config.output_len - 1
    speeds = {name: decode_tokens / min(seconds) for name, seconds in runs.items()}
    report: dict[str, Any] = {
        "benchmark": "spec",
        "config": asdict(config),
        "workload": "code-edit",
        "prompt_tokens": len(prompt),
        "plain": {"decode_tokens_per_s": round(speeds["plain"], 1)},
    }
    for name in methods:
        stats = engines[name].engine.stats.spec_decode
        report[name] = {
            "decode_tokens_per_s": round(speeds[name], 1),
            "speedup": round(speeds[name] / speeds["plain"], 3),
            "acceptance_rate": round(stats.acceptance_rate, 3),
            "mean_accepted_length": round(stats.mean_accepted_length, 3),
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "greedy_outputs_identical": outputs[name] == outputs["plain"],
        }
    report["speedup"] = report["ngram"]["speedup"]
    report["greedy_outputs_identical"] = all(
        report[name]["greedy_outputs_identical"] for name in methods
    )
    return report


def _decode_seconds(llm: Any, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    """A run's decode seconds (from its first token to its last) and its tokens."""
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}], params)
    return decode_seconds(outputs), list(outputs[0].outputs[0].token_ids)


CONFIG = SpecBenchConfig
