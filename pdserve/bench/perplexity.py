"""`pdserve bench perplexity`: what computing on quantized blocks costs in accuracy.

For each linear backend (by default `quantized`, the GGUF's blocks with int8 activations, and
`blocked`, the same file dequantized to float32: the oracle), perplexity on a fixed English
text (engine/models/default_corpus.py), measured through the engine itself: the text is cut
into windows; each window's first token is the prompt and the rest is forced as the output
(`forced_output_token_ids`), whose raw log-probabilities (before any processing) are the
model's for each next token. `ratio` is the first backend's perplexity over the second's.

With `--llamacpp-python`, greedy agreement with llama.cpp on the same file: both continue the
same prompts (token ids) greedily; `agreement` is the share of output positions where the two
match before their first difference, and `identical` the number of continuations equal in
full.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.models.catalog import SMOLLM2_MODEL
from pdserve.flags import Flag, str_list


@dataclass(frozen=True)
class PerplexityBenchConfig:
    model: str = SMOLLM2_MODEL
    """the model (the shipped GGUF by default)"""
    linear_backends: tuple[str, ...] = ("quantized", "blocked")
    """linear backends to compare, comma-separated (the first over the others)"""
    window: int = 128
    """tokens per window of the text (the first is the prompt)"""
    greedy_tokens: int = 32
    """tokens each greedy continuation runs (with --llamacpp-python)"""
    llamacpp_python: str = ""
    """a Python with llama-cpp-python: greedy agreement with llama.cpp on the same GGUF"""

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be >= 2 tokens, got {self.window}")
        if not self.linear_backends:
            raise ValueError("give at least one linear backend")


GREEDY_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a kingdom between the mountains and the sea,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Science is a way of thinking",
    "To bake simple bread, mix",
)


def run(config: PerplexityBenchConfig) -> dict[str, Any]:
    from engine.llm import LLM

    report: dict[str, Any] = {"benchmark": "perplexity", "config": asdict(config)}
    perplexities: dict[str, float] = {}
    greedy: dict[str, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for backend in config.linear_backends:
        llm = LLM(config.model, device="cpu", linear_backend=backend, max_model_len=2048)
        try:
            windows = text_windows(llm, config.window)
            perplexities[backend] = perplexity(llm, windows)
            tokenizer = llm.tokenizer
            assert tokenizer is not None  # text_windows refused a model without one
            prompts = [tokenizer.encode(text) for text in GREEDY_TEXTS]
            greedy[backend] = greedy_tokens(llm, prompts, config.greedy_tokens)
        finally:
            llm.close()
    report["tokens_scored"] = sum(len(w) - 1 for w in windows)
    report["perplexity"] = {b: round(p, 4) for b, p in perplexities.items()}
    first, *others = config.linear_backends
    for other in others:
        report[f"ratio_to_{other}"] = round(perplexities[first] / perplexities[other], 4)
        report[f"greedy_agreement_with_{other}"] = agreement(greedy[first], greedy[other])
    if config.llamacpp_python:
        peer = llamacpp_greedy(config.llamacpp_python, config.model, prompts, config.greedy_tokens)
        report["llamacpp"] = {b: agreement(greedy[b], peer) for b in config.linear_backends}
    return report


def text_windows(llm: Any, window: int) -> list[list[int]]:
    """The fixed text's tokens in windows of `window` (the last one shorter)."""
    from engine.models.default_corpus import CORPUS

    if llm.tokenizer is None:
        raise ValueError("perplexity needs the model's tokenizer")
    ids = llm.tokenizer.encode(CORPUS, add_special_tokens=False)
    windows = [ids[i : i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= 2]


def perplexity(llm: Any, windows: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of each window's tokens after its first."""
    from engine.request import SamplingParams

    requests = [{"prompt_token_ids": w[:1]} for w in windows]
    params = [
        SamplingParams(
            max_tokens=len(w) - 1, temperature=0.0, logprobs=0, forced_output_token_ids=w[1:]
        )
        for w in windows
    ]
    total, count = 0.0, 0
    for window, output in zip(windows, llm.generate(requests, params), strict=True):
        completion = output.outputs[0]
        if list(completion.token_ids) != window[1:]:
            raise RuntimeError("the forced tokens were not the output")  # never: forced
        for token, (ids, logprobs, _rank) in zip(
            completion.token_ids, completion.logprobs, strict=True
        ):
            assert ids[0] == token  # the sampled token comes first
            total -= logprobs[0]
            count += 1
    return math.exp(total / count)


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Share of positions equal before each pair's first difference, and pairs equal in full."""
    matched, total, identical = 0, 0, 0
    for a, b in zip(ours, theirs, strict=True):
        length = min(len(a), len(b))
        same = next((i for i in range(length) if a[i] != b[i]), length)
        matched += same
        total += max(len(a), len(b))
        identical += a == b
    return {
        "agreement": round(matched / max(total, 1), 3),
        "identical": identical,
        "continuations": len(ours),
    }


# Runs in the peer's Python: greedy continuations of the same prompt ids.
_LLAMACPP_SCRIPT = """
import json, sys, llama_cpp
path, threads, n_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = json.loads(sys.argv[4])
m = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, verbose=False)
out = []
for prompt in prompts:
    tokens = []
    for token in m.generate(prompt, top_k=1, temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == n_out:
            break
    out.append(tokens)
print(json.dumps(out))
"""


def llamacpp_greedy(
    python: str, model: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    from engine.models.catalog import is_gguf_path, resolve_model

    path = str(resolve_model(model))
    if not is_gguf_path(path):
        raise ValueError("--llamacpp-python compares on the same GGUF file: give a .gguf model")
    threads = str(torch.get_num_threads())
    args = [python, "-c", _LLAMACPP_SCRIPT, path, threads, str(max_tokens), json.dumps(prompts)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"the llama.cpp peer failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


CONFIG = PerplexityBenchConfig
FLAGS = {"linear_backends": Flag(parse=str_list), "llamacpp_python": Flag(metavar="PYTHON")}
