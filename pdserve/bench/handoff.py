"""`pdserve bench handoff`: the hand-off of a prompt from a prefill engine to a decode engine
as the app makes it, against the same work on one engine, and what the KV checksums cost.

Two engines run in this process; the decode engine reads the prefill engine's KV over the
transport (NIXL or gRPC, through the prefill engine's side channel, as between processes).
For each prompt length, `repeats` times in turn: a fresh prompt of random tokens is prefilled
(max_tokens 1, handed off: the client's first token), then the decode engine, that token
forced as in the app's decode leg, reads the prompt's KV and computes the next one (the
client's second). `second_token_ms` covers both legs, less the router; `decode_leg_ms` is the
decode engine's part (read, checks, one step); `colocated_second_token_ms` is the same two
tokens of another fresh prompt on the decode engine alone. `adopted` counts the decode legs
that computed no prompt token (the forced token taken with the whole prompt's KV).
`checksum_ms` is the time both engines spent summing KV blocks for it — the producer at
hand-off, the reader before it used them (engine/block_checksums.py; the engines' own
counters, `checksum_us_produced` and `checksum_us_verified`) — and `checksum_share` its
median over the hand-off's median `second_token_ms`. The first run of each length is a
warm-up, not counted.

`agreement_prompts` N adds a third engine, colocated, and compares N greedy answers of
`agreement_tokens` through the hand-off with its own (`agreement`: how many are identical,
where the others first differ).

Either engine may be split over tensor-parallel ranks (`prefill_tensor_parallel_size`,
`decode_tensor_parallel_size`), sharing one KV cache of every head or keeping one per rank
(`tensor_parallel_kv_cache`; connector/kv_shards.py): `pieces_direct` and `pieces_staged`
say how the decode engine's reads went. Split, the default model is random weights in
Qwen2.5-0.5B's shape (SmolLM2's 9 query heads do not split in 2).
"""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from engine.config import check_transport
from engine.llm import LLM
from engine.models.catalog import SMOLLM2_MODEL
from engine.request import SamplingParams
from pdserve.bench.stats import summarize
from pdserve.flags import Flag, int_list

_FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
_TWO_TOKENS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class HandoffBenchConfig:
    model: str = ""
    """the model of both engines (default: the shipped GGUF; random weights in Qwen2.5-0.5B's
    shape where an engine is split)"""
    prompt_lens: tuple[int, ...] = (256, 1024)
    """prompt lengths in tokens, comma-separated"""
    transport: str = "nixl"
    """how the decode engine reads the KV (nixl or grpc)"""
    repeats: int = 5
    """hand-offs (and colocated runs) per length, after one warm-up"""
    seed: int = 0
    """the prompts' random tokens"""
    prefill_tensor_parallel_size: int = 1
    """ranks of the prefill engine"""
    decode_tensor_parallel_size: int = 1
    """ranks of the decode engine"""
    tensor_parallel_kv_cache: str = "auto"
    """where split engines keep KV: auto, shared or per_rank"""
    agreement_prompts: int = 0
    """random prompts (of the prompt lengths in turn) whose greedy answer through a hand-off
    is compared with a third, colocated engine's (0: none)"""
    agreement_tokens: int = 24
    """tokens of each answer compared"""

    def __post_init__(self) -> None:
        check_transport(self.transport)
        if min(self.prefill_tensor_parallel_size, self.decode_tensor_parallel_size) < 1:
            raise ValueError("tensor-parallel sizes must be >= 1")
        if not self.prompt_lens or min(self.prompt_lens) < 2:
            raise ValueError(f"prompt_lens must be >= 2 tokens each, got {self.prompt_lens}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.agreement_prompts < 0 or self.agreement_tokens < 2:
            raise ValueError("agreement_prompts must be >= 0 and agreement_tokens >= 2")


CONFIG = HandoffBenchConfig
FLAGS = {"prompt_lens": Flag(parse=int_list)}


def run(config: HandoffBenchConfig) -> dict[str, Any]:
    kv = {"connector": config.transport, "secret": secrets.token_hex(16)}
    args = {
        "max_model_len": max(config.prompt_lens) + max(8, config.agreement_tokens),
        "kv_transfer_config": kv,
        "tensor_parallel_kv_cache": config.tensor_parallel_kv_cache,
    }
    model = _model(config)
    # Both engines live in this process, whose torch threads a split engine's rank 0 sets
    # to its share: each engine computes with its own (all of them at one rank).
    threads = torch.get_num_threads()
    prefill = _Engine(
        LLM(model, tensor_parallel_size=config.prefill_tensor_parallel_size, **args), threads
    )
    decode = _Engine(
        LLM(model, tensor_parallel_size=config.decode_tensor_parallel_size, **args), threads
    )
    device = decode.llm.engine.runner.device
    try:
        vocab = int(decode.llm.engine.runner.arch.vocab_size)
        rng = random.Random(config.seed)
        by_length = {}
        for length in config.prompt_lens:
            runs = [
                _measure(prefill, decode, rng, length, vocab) for _ in range(config.repeats + 1)
            ]
            by_length[str(length)] = _summary(runs[1:])
        agreement = None
        if config.agreement_prompts:
            colocated_args = {**args, "kv_transfer_config": None}
            size = config.decode_tensor_parallel_size
            colocated = _Engine(LLM(model, tensor_parallel_size=size, **colocated_args), threads)
            try:
                agreement = _agreement(prefill, decode, colocated, rng, config, vocab)
            finally:
                colocated.llm.close()
    finally:
        torch.set_num_threads(threads)
        prefill.llm.close()
        decode.llm.close()
    report = {
        "benchmark": "handoff",
        "config": {**asdict(config), "model": config.model or model},
        "device": str(device),
        "prompt_lens": by_length,
    }
    return report if agreement is None else {**report, "agreement": agreement}


def _model(config: HandoffBenchConfig) -> str:
    if config.model:
        return config.model
    if max(config.prefill_tensor_parallel_size, config.decode_tensor_parallel_size) == 1:
        return SMOLLM2_MODEL
    from engine.testing.shaped_checkpoint import shaped_checkpoint

    return str(shaped_checkpoint("qwen2.5-0.5b"))


class _Engine:
    """An engine of this process and the torch threads it computes with."""

    def __init__(self, llm: LLM, threads: int) -> None:
        self.llm = llm
        self.threads = max(1, threads // llm.engine.runner.group.size)

    def generate(self, *args: Any) -> Any:
        torch.set_num_threads(self.threads)
        return self.llm.generate(*args)


def _measure(
    prefill: _Engine, decode: _Engine, rng: random.Random, length: int, vocab: int
) -> dict:
    """One hand-off and one colocated run, each on a fresh prompt (no prefix-cache hit)."""
    prompt = [rng.randrange(vocab) for _ in range(length)]
    produced, read = _counters(prefill), _counters(decode)
    t0 = time.perf_counter()
    first = prefill.generate([prompt], _FIRST_TOKEN, {"do_remote_decode": True})[0]
    t1 = time.perf_counter()
    sent = list(first.outputs[0].token_ids)
    leg = replace(_TWO_TOKENS, forced_output_token_ids=sent)
    out = decode.generate([prompt], leg, first.kv_transfer_params)[0]
    t2 = time.perf_counter()
    produced, read = _since(prefill, produced), _since(decode, read)
    params = first.kv_transfer_params
    blocks = len(params["remote_block_ids"]) if params else 0
    # The decode engine read the KV, checked it and used it: a failed or refused read is
    # recomputed, which is not what this times.
    used = read.get("blocks_read", 0) > 0 and not read.get("reads_failed", 0)
    if not blocks or not used or read.get("checksum_failures", 0):
        raise RuntimeError(f"the hand-off did not go through the transport: {read}")
    if len(out.outputs[0].token_ids) != 2:
        raise RuntimeError(f"the decode leg ended early: {out.outputs[0].finish_reason}")
    if out.outputs[0].token_ids[0] != sent[0]:
        raise RuntimeError("the decode leg did not continue the prefill engine's token")
    other = [rng.randrange(vocab) for _ in range(length)]
    t3 = time.perf_counter()
    decode.generate([other], _TWO_TOKENS)
    t4 = time.perf_counter()
    checksum_us = produced["checksum_us_produced"] + read["checksum_us_verified"]
    return {
        "second_token_ms": (t2 - t0) * 1e3,
        "prefill_ms": (t1 - t0) * 1e3,
        "decode_leg_ms": (t2 - t1) * 1e3,
        "colocated_second_token_ms": (t4 - t3) * 1e3,
        "checksum_ms": checksum_us / 1e3,
        "blocks": blocks,
        "adopted": bool(out.timing and out.timing.kv_load_adopted_first_token),
        "pieces_direct": read.get("pieces_direct", 0),
        "pieces_staged": read.get("pieces_staged", 0),
    }


def _agreement(
    prefill: _Engine,
    decode: _Engine,
    colocated: _Engine,
    rng: random.Random,
    config: HandoffBenchConfig,
    vocab: int,
) -> dict[str, Any]:
    """Greedy answers through the app's hand-off against a colocated engine's, on fresh
    random prompts: identical ones, and where the others first differ. Random tokens make
    near-ties common, where kernels whose results depend on the batch show."""
    greedy = replace(_TWO_TOKENS, max_tokens=config.agreement_tokens)
    identical, adopted, first_difference = 0, 0, []
    for i in range(config.agreement_prompts):
        length = config.prompt_lens[i % len(config.prompt_lens)]
        prompt = [rng.randrange(vocab) for _ in range(length)]
        want = list(colocated.generate([prompt], greedy)[0].outputs[0].token_ids)
        first = prefill.generate([prompt], _FIRST_TOKEN, {"do_remote_decode": True})[0]
        leg = replace(greedy, forced_output_token_ids=first.outputs[0].token_ids)
        out = decode.generate([prompt], leg, first.kv_transfer_params)[0]
        got = list(out.outputs[0].token_ids)
        adopted += bool(out.timing and out.timing.kv_load_adopted_first_token)
        if got == want:
            identical += 1
        else:
            first_difference.append(_first_difference(got, want))
    return {
        "prompts": config.agreement_prompts,
        "tokens": config.agreement_tokens,
        "identical": identical,
        "first_difference_at": first_difference,
        "adopted": adopted,
    }


def _first_difference(a: list[int], b: list[int]) -> int:
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return j
    return min(len(a), len(b))


def _counters(engine: _Engine) -> dict[str, int]:
    """The engine's KV connector counters (engine/stats.py)."""
    return dict(engine.llm.engine.refresh_stats().kv_transfer)


def _since(engine: _Engine, before: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in _counters(engine).items()}


def _summary(runs: list[dict]) -> dict[str, Any]:
    """Mean and median of each time; the medians' ratios."""
    names = ("second_token_ms", "prefill_ms", "decode_leg_ms", "colocated_second_token_ms")
    summary: dict[str, Any] = {
        name: summarize([run[name] for run in runs], (0.5,), digits=3)
        for name in (*names, "checksum_ms")
    }
    handoff = summary["second_token_ms"]["p50"]
    colocated = summary["colocated_second_token_ms"]["p50"]
    summary["handoff_over_colocated"] = round(handoff / colocated, 3)
    summary["checksum_share"] = round(summary["checksum_ms"]["p50"] / handoff, 5)
    summary["blocks"] = runs[0]["blocks"]
    summary["adopted"] = sum(run["adopted"] for run in runs)
    summary["pieces"] = {"direct": runs[0]["pieces_direct"], "staged": runs[0]["pieces_staged"]}
    return summary
