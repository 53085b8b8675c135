"""`pdserve bench offload`: multi-turn conversations whose working set is several times the
primary KV pool, with and without a KV tier below it (kv_offloading_size), on the same
requests, engines loaded side by side in this process.

Between two turns of one conversation the others' turns run and push its prefix out of the
primary pool (LRU). Without a tier each turn computes the whole conversation again; with one,
the prefix comes back from the tier (verified) and only the new message is computed. Reported
per configuration: prompt tokens computed, tokens found in the pool and in the tier, TTFT
(from a turn's arrival at the engine to its first token), and whether every greedy output
equals the tier-less engine's.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from engine.models.catalog import SMOLLM2_MODEL
from pdserve.bench.stats import percentile

_BACKENDS = ("none", "cpu", "disk", "cpu+disk")


@dataclass(frozen=True)
class OffloadBenchConfig:
    model: str = SMOLLM2_MODEL
    """the model"""
    backends: str = "none,cpu"
    """comma-separated: none (no tier), cpu (host memory), disk (a file), cpu+disk (host
    memory for a third of the working set over a file: a third tier)"""
    conversations: int = 8
    """conversations, their turns sent round robin"""
    turns: int = 4
    """turns per conversation"""
    first_len: int = 256
    """tokens of a conversation's first message"""
    turn_len: int = 64
    """tokens of each later message"""
    output_len: int = 16
    """tokens of each answer (greedy)"""
    concurrency: int = 2
    """turns in the engine at once"""
    pool_fraction: float = 1 / 3
    """the primary pool's size as a fraction of the workload's working set"""
    block_size: int = 16
    """tokens per KV block"""
    disk_path: str = ""
    """backend disk: the directory of the tier's file (empty: the temporary directory)"""
    device: str = "auto"
    """cpu or cuda (auto: cuda when there is one)"""
    seed: int = 0
    """the messages' tokens"""

    def __post_init__(self) -> None:
        names = self.backend_names
        if not names or any(name not in _BACKENDS for name in names):
            raise ValueError(f"backends must be a list of {_BACKENDS}, got {self.backends!r}")
        for name in ("conversations", "turns", "first_len", "turn_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.concurrency <= self.conversations:
            raise ValueError("concurrency must be between 1 and conversations")
        if not 0 < self.pool_fraction <= 1:
            raise ValueError(f"pool_fraction must be in (0, 1], got {self.pool_fraction}")

    @property
    def backend_names(self) -> list[str]:
        return [name.strip() for name in self.backends.split(",") if name.strip()]

    @property
    def context_len(self) -> int:
        """A conversation's tokens by its last answer."""
        return self.first_len + (self.turns - 1) * self.turn_len + self.turns * self.output_len


def run(config: OffloadBenchConfig) -> dict[str, Any]:
    from engine.llm import LLM

    working_set = config.conversations * config.context_len
    pool_blocks = _pool_blocks(config, working_set)
    common = {
        "device": config.device,
        "block_size": config.block_size,
        "num_gpu_blocks_override": pool_blocks + 1,
        "max_model_len": config.context_len + config.block_size,
    }
    # The oracle: a pool that holds the whole working set finds every prefix in place. A
    # tier's blocks come back bit for bit, so its engine must answer exactly as this one does
    # (not as "none", which computes each whole prompt anew: other sums, other last bits).
    big_pool = -(-working_set // config.block_size) + config.conversations + 1
    oracle = LLM(config.model, **{**common, "num_gpu_blocks_override": big_pool + 1})
    # A tier of the whole working set, a quarter over (the blocks of answers' partial tails).
    tier_gib = working_set * 1.25 * oracle.engine.kv_block_bytes / config.block_size / (1 << 30)
    engines = {
        name: LLM(config.model, **common, **_tier_args(config, name, tier_gib))
        for name in config.backend_names
    }
    engines["oracle"] = oracle
    messages = _messages(config, oracle.engine.arch.vocab_size)
    results = {name: _converse(llm, messages, config) for name, llm in engines.items()}
    baseline = results["oracle"]
    report: dict[str, Any] = {
        "benchmark": "offload",
        "config": asdict(config),
        "working_set_tokens": working_set,
        "pool_tokens": pool_blocks * config.block_size,
        "working_set_over_pool": round(working_set / (pool_blocks * config.block_size), 2),
    }
    for name, result in results.items():
        report[name] = _summary(result, engines[name], baseline)
    if "none" in results:
        for name in config.backend_names:
            if name != "none":
                report[name]["prefill_tokens_vs_none"] = round(
                    report[name]["prefill_tokens"] / max(1, report["none"]["prefill_tokens"]), 3
                )
                report[name]["ttft_p50_vs_none"] = round(
                    report[name]["ttft_p50_ms"] / max(1e-9, report["none"]["ttft_p50_ms"]), 3
                )
    for llm in engines.values():
        llm.close()
    return report


def _pool_blocks(config: OffloadBenchConfig, working_set: int) -> int:
    """The primary pool: the fraction of the working set, but room for the turns in flight."""
    blocks = int(working_set * config.pool_fraction) // config.block_size
    per_turn = -(-config.context_len // config.block_size) + 1
    return max(blocks, config.concurrency * per_turn)


def _tier_args(config: OffloadBenchConfig, name: str, tier_gib: float) -> dict[str, Any]:
    if name == "none":
        return {}
    if name == "cpu+disk":  # host memory holds less than the working set: disk the rest
        args: dict[str, Any] = {
            "kv_offloading_size": tier_gib / 3,
            "kv_offloading_disk_size": tier_gib,
        }
    else:
        args = {"kv_offloading_backend": name, "kv_offloading_size": tier_gib}
    if "disk" in name and config.disk_path:
        args["kv_offloading_path"] = config.disk_path
    return args


def _messages(config: OffloadBenchConfig, vocab_size: int) -> list[list[list[int]]]:
    """Each conversation's messages (token ids), deterministic in the seed."""
    rng = random.Random(config.seed)
    high = min(vocab_size, 20000)

    def message(length: int) -> list[int]:
        return [rng.randrange(100, high) for _ in range(length)]

    return [
        [message(config.first_len)] + [message(config.turn_len) for _ in range(config.turns - 1)]
        for _ in range(config.conversations)
    ]


@dataclass
class _Turn:
    prompt_len: int
    cached: int
    ttft_s: float
    tokens: list[int]


def _converse(llm: Any, messages: list[list[list[int]]], config: OffloadBenchConfig) -> list:
    """Every turn of every conversation, round robin, `concurrency` at once."""
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=config.output_len, ignore_eos=True)
    engine = llm.engine
    contexts = [list(conversation[0]) for conversation in messages]
    next_turn = [1] * len(messages)
    turns: list[list[_Turn]] = [[] for _ in messages]
    ready = deque(range(len(messages)))
    in_flight: dict[str, tuple[int, float, list[int]]] = {}
    counter = 0
    while ready or in_flight:
        while ready and len(in_flight) < config.concurrency:
            conversation = ready.popleft()
            counter += 1
            request_id = f"c{conversation}-t{len(turns[conversation])}-{counter}"
            prompt = list(contexts[conversation])
            engine.add_request(llm.inputs.make_request(request_id, prompt, params))
            in_flight[request_id] = (conversation, time.time(), [])
        for output in engine.step().outputs:
            conversation, added, tokens = in_flight[output.request_id]
            tokens.extend(output.new_token_ids)
            if not output.finished:
                continue
            del in_flight[output.request_id]
            assert output.timing is not None and output.timing.first_token is not None
            prompt_len = len(contexts[conversation])
            turns[conversation].append(
                _Turn(
                    prompt_len, output.num_cached_tokens, output.timing.first_token - added, tokens
                )
            )
            turn = next_turn[conversation]
            if turn < config.turns:
                contexts[conversation] += tokens + messages[conversation][turn]
                next_turn[conversation] += 1
                ready.append(conversation)
    llm.drain()
    return turns


def _summary(result: list[list[_Turn]], llm: Any, baseline: list[list[_Turn]]) -> dict[str, Any]:
    turns = [turn for conversation in result for turn in conversation]
    later = [turn for conversation in result for turn in conversation[1:]]
    stats = llm.engine.stats
    scheduler = llm.engine.scheduler
    summary: dict[str, Any] = {
        "prefill_tokens": sum(turn.prompt_len - turn.cached for turn in turns),
        "prompt_tokens": sum(turn.prompt_len for turn in turns),
        "cached_tokens": sum(turn.cached for turn in turns),
        "pool_hit_tokens": stats.prefix_cache_hits,
        "ttft_p50_ms": _ms(turns, 0.5),
        "ttft_p90_ms": _ms(turns, 0.9),
        "follow_up_ttft_p50_ms": _ms(later, 0.5),
        "preemptions": stats.num_preemptions,
        "greedy_outputs_equal_oracle": [[t.tokens for t in c] for c in result]
        == [[t.tokens for t in c] for c in baseline],
    }
    tier = scheduler.tier
    if tier is not None:
        summary["tier"] = {**asdict(tier.stats), "slots": tier.num_slots}
    scheduler.kv_cache_manager.check_integrity()
    summary["blocks_held_after"] = stats.num_blocks - stats.num_free_blocks
    return summary


def _ms(turns: list[_Turn], q: float) -> float:
    return round(percentile(sorted(turn.ttft_s for turn in turns), q) * 1e3, 1)


CONFIG = OffloadBenchConfig
