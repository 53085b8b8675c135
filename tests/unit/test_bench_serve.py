"""`pdserve bench serve`'s workload and arithmetic (the load itself runs in integration)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.serve import (
    RequestResult,
    ServeBenchConfig,
    make_prompts,
    ratios,
    summarize_results,
)
from pdserve.bench.workloads import TOOLS, drive, max_tokens_needed, warmup_prompts


def test_prompts_share_the_prefix_and_have_the_asked_length() -> None:
    config = ServeBenchConfig(num_prompts=5, input_len=20, shared_prefix_len=8)
    prompts = make_prompts(config, vocab_size=100)
    assert all(len(p) == 20 for p in prompts)
    assert len({tuple(p[:8]) for p in prompts}) == 1
    assert len({tuple(p[8:]) for p in prompts}) == 5
    assert prompts == make_prompts(config, vocab_size=100)  # seeded


def test_summary_latencies_throughput_and_goodput() -> None:
    results = [
        RequestResult(
            ok=True,
            ttft_s=0.1,
            e2e_s=1.1,
            itl_s=[0.1] * 10,
            num_output_tokens=11,
            num_prompt_tokens=5,
        ),
        RequestResult(
            ok=True,
            ttft_s=0.5,
            e2e_s=2.5,
            itl_s=[0.2] * 10,
            num_output_tokens=11,
            num_prompt_tokens=5,
        ),
        RequestResult(ok=False, error="UNAVAILABLE: down"),
    ]
    config = ServeBenchConfig(slo_ttft_ms=200)
    summary = summarize_results(results, duration_s=2.0, config=config)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["errors"] == ["UNAVAILABLE: down"]
    assert summary["output_token_throughput"] == 11.0
    assert summary["total_token_throughput"] == 16.0
    assert summary["goodput"] == 0.5  # only the first meets ttft <= 200 ms
    assert summary["tpot_ms"]["mean"] == pytest.approx(150.0)  # (1000/10 + 2000/10) / 2
    assert summary["ttft_ms"]["p50"] == 500.0 and summary["ttft_ms"]["p99"] == 500.0
    assert summary["itl_ms"]["p50"] == 200.0


def test_ratios_compare_against_the_first_app() -> None:
    first = {
        "output_token_throughput": 100.0,
        "ttft_ms": {"p50": 10.0},
        "tpot_ms": {"p50": 4.0},
        "e2e_ms": {"p50": 0.0},
    }
    other = {
        "output_token_throughput": 150.0,
        "ttft_ms": {"p50": 5.0},
        "tpot_ms": {"p50": 4.0},
        "e2e_ms": {"p50": 3.0},
    }
    assert ratios(first, other) == {
        "output_token_throughput": 1.5,
        "ttft_p50": 0.5,
        "tpot_p50": 1.0,
        "e2e_p50": None,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_prompts": 0}, "num_prompts"),
        ({"shared_prefix_len": 200}, "shared_prefix_len"),
        ({"request_rate": 0}, "request_rate"),
        ({"concurrency": 0}, "concurrency"),
        ({"apps": ["a", "a"]}, "distinct"),
        ({"apps": []}, "distinct"),
        ({"workload": "bursty"}, "workload"),
        ({"turns": 0}, "turns"),
        ({"burst_every": 0}, "burst_every"),
        ({"trace": "t.jsonl"}, "replay workload only"),
        ({"workload": "replay", "trace": "t.jsonl", "trace_token_scale": 0}, "scale"),
        ({"deploy": {"a": {}}, "interleave": True}, "interleave"),
    ],
)
def test_bad_bench_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**kwargs)


class Recorder:
    """A fake endpoint for the workloads: answers each request at once with `output_len`
    tokens derived from its prompt, and records what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[int], int, str]] = []

    async def __call__(self, prompt: list[int], output_len: int, kind: str) -> RequestResult:
        self.sent.append((prompt, output_len, kind))
        answer = [1000 + len(prompt) + i for i in range(output_len)]
        return RequestResult(ok=True, kind=kind, token_ids=answer, num_output_tokens=output_len)


def test_multiturn_conversations_carry_their_answers_into_the_next_turn() -> None:
    config = ServeBenchConfig(
        workload="multiturn",
        num_prompts=3,
        input_len=20,
        shared_prefix_len=8,
        output_len=4,
        turns=3,
        turn_len=5,
        think_time_s=0,
        concurrency=2,
    )
    send = Recorder()
    asyncio.run(drive(config, 500, send))
    assert len(send.sent) == 9
    assert [k for _, _, k in send.sent].count("first_turn") == 3
    firsts = [p for p, _, k in send.sent if k == "first_turn"]
    assert all(len(p) == 20 and p[:8] == firsts[0][:8] for p in firsts)  # the system prompt
    sent = {tuple(p) for p, _, _ in send.sent}
    for prompt, _, kind in send.sent:
        if kind == "follow_up":
            # The earlier turn's prompt, its answer, then turn_len new tokens.
            earlier = prompt[: len(prompt) - 4 - 5]
            assert tuple(earlier) in sent
            answer = prompt[len(earlier) : len(earlier) + 4]
            assert answer == [1000 + len(earlier) + i for i in range(4)]
    longest = max(len(p) for p, _, _ in send.sent)
    assert longest == 20 + 2 * (4 + 5) and longest + 4 <= max_tokens_needed(config)
    again = Recorder()
    asyncio.run(drive(config, 500, again))
    assert sorted(map(str, again.sent)) == sorted(map(str, send.sent))  # seeded


def test_mixed_sends_the_same_bursts_to_a_fast_and_a_slow_app() -> None:
    """Bursts are counted in requests: an app answering ten times slower gets exactly the
    requests a fast one gets (in elapsed time, it got fewer bursts)."""
    config = ServeBenchConfig(
        workload="mixed",
        num_prompts=7,
        input_len=10,
        output_len=3,
        concurrency=2,
        long_input_len=50,
        burst_output_len=2,
        burst_size=3,
        burst_every=3,
    )

    class Slow(Recorder):
        """Answers after the event loop has run everything else `turns` times: a slower app,
        without a clock."""

        def __init__(self, turns: int) -> None:
            super().__init__()
            self.turns = turns

        async def __call__(self, prompt, output_len, kind):
            loop = asyncio.get_running_loop()
            for _ in range(self.turns):  # one turn of the loop each: no clock involved
                turn = loop.create_future()
                loop.call_soon(turn.set_result, None)
                await turn
            return await super().__call__(prompt, output_len, kind)

    fast, slow = Slow(0), Slow(40)
    asyncio.run(drive(config, 500, fast))
    asyncio.run(drive(config, 500, slow))
    assert sorted(map(str, fast.sent)) == sorted(map(str, slow.sent))
    steady = [p for p, n, k in fast.sent if k == "steady"]
    bursts = [(p, n) for p, n, k in fast.sent if k == "burst"]
    assert len(steady) == 7 and all(len(p) == 10 for p in steady)
    assert len(bursts) == 2 * 3  # after the 3rd and the 6th steady request
    assert all(len(p) == 50 and n == 2 for p, n in bursts)
    assert max_tokens_needed(config) == 52


def test_warm_up_prompts_share_nothing_with_the_workload() -> None:
    config = ServeBenchConfig(num_prompts=4, input_len=16, warmup=2)
    prompts = make_prompts(config, 1000)
    warm = warmup_prompts(config, 1000)
    assert len(warm) == 2 and all(len(p) == 16 for p in warm)
    assert not {tuple(p) for p in warm} & {tuple(p) for p in prompts}
    # Not even a first block in common: the warm-up fills no cache the workload looks in.
    assert not {tuple(p[:4]) for p in warm} & {tuple(p[:4]) for p in prompts}


def test_summary_counts_cache_hits_routes_and_each_stream() -> None:
    results = [
        RequestResult(
            ok=True,
            kind="first_turn",
            num_prompt_tokens=100,
            num_cached_tokens=0,
            route="disaggregated",
            num_output_tokens=1,
        ),
        RequestResult(
            ok=True,
            kind="follow_up",
            num_prompt_tokens=150,
            num_cached_tokens=96,
            route="decode_cached",
            num_output_tokens=1,
        ),
    ]
    summary = summarize_results(results, 1.0, ServeBenchConfig())
    assert summary["prefill_tokens_computed"] == 154
    assert summary["prefix_hit_rate"] == round(96 / 250, 4)
    assert summary["routes"] == {"decode_cached": 1, "disaggregated": 1}
    assert summary["by_kind"]["follow_up"]["prefix_hit_rate"] == 0.64
    assert summary["by_kind"]["first_turn"]["prefill_tokens_computed"] == 100


def test_agentic_sessions_name_themselves_and_the_tool_each_turn_follows() -> None:
    config = ServeBenchConfig(
        workload="agentic",
        num_prompts=3,
        input_len=12,
        output_len=4,
        turns=3,
        turn_len=5,
        tool_gap_s=0,  # tools answer at once: no clock in the test
        background_prompts=4,
        background_input_len=7,
        background_rate=1e6,
        background_output_len=2,
    )
    sessions: list[tuple[list[int], str, str, str]] = []

    class Agents(Recorder):
        async def __call__(self, prompt, output_len, kind, session="", after_tool=""):
            sessions.append((prompt, kind, session, after_tool))
            return await super().__call__(prompt, output_len, kind)

    send = Agents()
    asyncio.run(drive(config, 500, send))
    one_shots = [(p, n) for p, n, k in send.sent if k == "background"]
    assert len(one_shots) == 4 and all(len(p) == 7 and n == 2 for p, n in one_shots)
    turns = [s for s in sessions if s[1] != "background"]
    assert len(turns) == 9 and {s[2] for s in turns} == {"agent-0", "agent-1", "agent-2"}
    assert all(s[3] == "" for s in turns if s[1] == "first_turn")  # no tool before a first turn
    assert all(s[3] in TOOLS for s in turns if s[1] == "follow_up")
    for prompt, kind, session, _ in turns:
        if kind == "follow_up":  # the session's earlier turn, its answer, the tool's result
            earlier = prompt[: len(prompt) - 4 - 5]
            assert (tuple(earlier), session) in {(tuple(p), s) for p, _, s, _ in turns}
    again: list[tuple[list[int], str, str, str]] = []
    sessions, first = again, sessions
    asyncio.run(drive(config, 500, Agents()))
    assert sorted(map(str, first)) == sorted(map(str, again))  # the same requests every run
    assert max_tokens_needed(config) == 12 + 3 * (4 + 5)
