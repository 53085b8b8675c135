"""The request streams `pdserve bench serve` sends (`--workload`).

- `random`: independent prompts (optionally behind one shared prefix), at a fixed concurrency
  or with Poisson arrivals.
- `multiturn`: conversations behind a shared system prompt; each turn sends the whole
  conversation so far (earlier prompts and the model's answers) plus a new user message, after
  a think time. What KV-aware routing and cache-aware disaggregation are for: a follow-up's
  earlier context is cached on the replicas that served the previous turn.
- `mixed`: steady decodes (short prompts, long answers, a fixed number in flight) with bursts
  of long prompts, one as every `burst_every` steady requests start. What disaggregation is
  for: with one engine doing both, a burst's prefills stall every running stream's next token.
- `replay`: a recorded trace's requests at its timestamps (pdserve/bench/replay.py).
- `agentic`: agent sessions whose turns end in tool calls: each turn comes back after its
  tool's time with the tool's result, naming its session and the tool (what the engines'
  `continuum` policy pins KV on), while one-shot prompts arrive beside them (eviction
  pressure on the KV pool).

Every workload sends the same requests to every configuration it compares: drawn from seeded
generators, bursts counted in requests, never in elapsed time (a slower app would otherwise
get fewer bursts). Only multiturn's later turns carry the answers the app gave.

Each workload calls `send(prompt, output_len, kind)` for every request and awaits its result
(`RequestResult.kind` tells the streams apart in the summary); prompts are token ids drawn from
a seeded generator, so two apps get the same requests.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.bench.serve import ServeBenchConfig

WORKLOADS = ("random", "multiturn", "mixed", "replay", "agentic")
# agentic: the tools the agents call, by their mean time as a share of `tool_gap_s`.
TOOLS = {"search": 0.5, "python": 1.0, "browse": 1.5}
# Low ids hold the special tokens of small vocabularies: random prompts avoid them.
_FIRST_PLAIN_TOKEN = 16


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    kind: str = "request"  # which stream of the workload sent it
    start_s: float = 0.0  # since the workload started
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the serving engine found in its prefix cache
    route: str = ""
    token_ids: list[int] = field(default_factory=list)
    pinned: bool = False  # the engine kept its KV for its session's next turn

    @property
    def tpot_s(self) -> float:
        if self.num_output_tokens < 2:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def itl_times_s(self) -> list[float]:
        """When each inter-token gap ended, since the workload started (for plots over time)."""
        at = self.start_s + self.ttft_s
        times = []
        for gap in self.itl_s:
            at += gap
            times.append(at)
        return times


# send(prompt, output_len, kind, session="", after_tool=""): `session` names an agent's
# session (its pin), `after_tool` the tool whose result the turn carries.
Send = Callable[..., Coroutine[Any, Any, RequestResult]]


class TokenDraw:
    """Seeded random token ids from the plain part of a vocabulary."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._rng = random.Random(seed)
        self._high = vocab_size - 1

    def __call__(self, n: int) -> list[int]:
        return [self._rng.randint(_FIRST_PLAIN_TOKEN, self._high) for _ in range(n)]


def make_prompts(config: ServeBenchConfig, vocab_size: int) -> list[list[int]]:
    """The random workload's prompts: `input_len` tokens each, the first `shared_prefix_len`
    the same for all."""
    draw = TokenDraw(vocab_size, config.seed)
    prefix = draw(config.shared_prefix_len)
    return [prefix + draw(config.input_len - len(prefix)) for _ in range(config.num_prompts)]


def warmup_prompts(config: ServeBenchConfig, vocab_size: int) -> list[list[int]]:
    """Prompts unlike any the workload sends (another seed): a warm-up must not fill the
    caches the measured requests will look in."""
    draw = TokenDraw(vocab_size, config.seed + 1_000_003)
    return [draw(config.input_len) for _ in range(config.warmup)]


def max_tokens_needed(config: ServeBenchConfig) -> int:
    """The longest sequence the workload produces (checked against max_model_len)."""
    if config.workload in ("multiturn", "agentic"):
        return config.input_len + config.turns * (config.output_len + config.turn_len)
    if config.workload == "mixed":
        burst = config.long_input_len + config.burst_output_len
        return max(config.input_len + config.output_len, burst)
    if config.workload == "replay":
        from pdserve.bench.replay import replay_max_tokens

        return replay_max_tokens(config)
    return config.input_len + config.output_len


async def drive(config: ServeBenchConfig, vocab_size: int, send: Send) -> None:
    """Send the configured workload through `send` until it is done."""
    if config.workload == "multiturn":
        await _multiturn(config, vocab_size, send)
    elif config.workload == "mixed":
        await _mixed(config, vocab_size, send)
    elif config.workload == "replay":
        from pdserve.bench.replay import replay

        await replay(config, vocab_size, send)
    elif config.workload == "agentic":
        await _agentic(config, vocab_size, send)
    else:
        await _random(config, make_prompts(config, vocab_size), send)


async def _arrivals(config: ServeBenchConfig, starts: list[Callable[[], Awaitable[None]]]) -> None:
    """Run `starts` with at most `concurrency` at once, or with Poisson arrivals at
    `request_rate` (per request, or per conversation for multiturn)."""
    limit = asyncio.Semaphore(config.concurrency or len(starts) or 1)
    rng = random.Random(config.seed + 1)

    async def bounded(start: Callable[[], Awaitable[None]]) -> None:
        async with limit:
            await start()

    tasks = []
    for start in starts:
        tasks.append(asyncio.create_task(bounded(start)))
        if config.request_rate is not None:
            await asyncio.sleep(rng.expovariate(config.request_rate))
    await asyncio.gather(*tasks)


async def _random(config: ServeBenchConfig, prompts: list[list[int]], send: Send) -> None:
    def start(prompt: list[int]) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            await send(prompt, config.output_len, "request")

        return one

    await _arrivals(config, [start(p) for p in prompts])


async def _multiturn(config: ServeBenchConfig, vocab_size: int, send: Send) -> None:
    """`num_prompts` conversations of `turns` turns: a shared system prompt of
    `shared_prefix_len` tokens and a first message up to `input_len`; each later turn adds the
    answer and `turn_len` new tokens after an exponential think time."""
    draw = TokenDraw(vocab_size, config.seed)
    system = draw(config.shared_prefix_len)
    firsts = [system + draw(config.input_len - len(system)) for _ in range(config.num_prompts)]
    # Every conversation's later messages are drawn up front: the same for every app.
    messages = [[draw(config.turn_len) for _ in range(config.turns - 1)] for _ in firsts]
    think = random.Random(config.seed + 2)
    mean = config.think_time_s
    pauses = [[think.expovariate(1 / mean) if mean > 0 else 0.0 for _ in m] for m in messages]

    def conversation(i: int) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            history = firsts[i]
            for turn in range(config.turns):
                kind = "first_turn" if turn == 0 else "follow_up"
                result = await send(history, config.output_len, kind)
                if not result.ok or turn == config.turns - 1:
                    return
                await asyncio.sleep(pauses[i][turn])
                history = [*history, *result.token_ids, *messages[i][turn]]

        return run

    await _arrivals(config, [conversation(i) for i in range(len(firsts))])


async def _mixed(config: ServeBenchConfig, vocab_size: int, send: Send) -> None:
    """`num_prompts` steady requests (`input_len` in, `output_len` out), `concurrency` of them
    in flight at all times; as every `burst_every`-th of them starts, a burst of `burst_size`
    prompts of `long_input_len` tokens (`burst_output_len` out)."""
    draw = TokenDraw(vocab_size, config.seed)
    steady = [draw(config.input_len) for _ in range(config.num_prompts)]
    every = config.burst_every
    bursts = [
        [draw(config.long_input_len) for _ in range(config.burst_size)]
        for _ in range(config.num_prompts // every)
    ]
    sent: list[asyncio.Task[RequestResult]] = []

    def start(i: int) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            if (i + 1) % every == 0:
                for prompt in bursts[(i + 1) // every - 1]:
                    burst = send(prompt, config.burst_output_len, "burst")
                    sent.append(asyncio.create_task(burst))
            await send(steady[i], config.output_len, "steady")

        return one

    await _arrivals(config, [start(i) for i in range(len(steady))])
    await asyncio.gather(*sent)


async def _agentic(config: ServeBenchConfig, vocab_size: int, send: Send) -> None:
    """`num_prompts` agent sessions of `turns` turns, `concurrency` (or all) at once: a first
    message of `input_len` tokens; each answer is followed by a tool call — its tool drawn from
    TOOLS, its time within 30% of the tool's mean (`tool_gap_s` scaled) — and the next turn
    adds the tool's result (`turn_len` tokens). Beside them, `background_prompts` one-shot
    prompts (`background_input_len` in, `background_output_len` out) at `background_rate` a
    second."""
    draw = TokenDraw(vocab_size, config.seed)
    firsts = [draw(config.input_len) for _ in range(config.num_prompts)]
    results = [[draw(config.turn_len) for _ in range(config.turns - 1)] for _ in firsts]
    rng = random.Random(config.seed + 2)
    names = sorted(TOOLS)
    tools = [[names[rng.randrange(len(names))] for _ in r] for r in results]
    gaps = [
        [config.tool_gap_s * TOOLS[tool] * rng.uniform(0.7, 1.3) for tool in session]
        for session in tools
    ]
    one_shot_len = config.background_input_len or config.input_len
    background = [draw(one_shot_len) for _ in range(config.background_prompts)]
    pauses = [rng.expovariate(config.background_rate) for _ in background]

    def session(i: int) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            history, tool = firsts[i], ""
            for turn in range(config.turns):
                kind = "first_turn" if turn == 0 else "follow_up"
                result = await send(history, config.output_len, kind, f"agent-{i}", tool)
                if not result.ok or turn == config.turns - 1:
                    return
                tool = tools[i][turn]
                await asyncio.sleep(gaps[i][turn])  # the tool runs
                history = [*history, *result.token_ids, *results[i][turn]]

        return run

    async def one_shots() -> None:
        sent = []
        for prompt, pause in zip(background, pauses, strict=True):
            await asyncio.sleep(pause)
            sent.append(
                asyncio.create_task(send(prompt, config.background_output_len, "background"))
            )
        await asyncio.gather(*sent)

    await asyncio.gather(one_shots(), _arrivals(config, [session(i) for i in range(len(firsts))]))
