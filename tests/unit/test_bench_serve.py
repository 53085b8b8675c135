"""`pdserve bench serve`'s workload and arithmetic (the load itself runs in integration)."""

from __future__ import annotations

import pytest

from pdserve.bench.serve import (
    RequestResult,
    ServeBenchConfig,
    make_prompts,
    parse_slo,
    ratios,
    summarize_results,
)


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


def test_slo_parsing() -> None:
    assert parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert parse_slo("") == {}
    with pytest.raises(ValueError, match="ttft_ms=N"):
        parse_slo("latency=3")
    with pytest.raises(ValueError, match="number"):
        parse_slo("ttft_ms=fast")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_prompts": 0}, "num_prompts"),
        ({"shared_prefix_len": 200}, "shared_prefix_len"),
        ({"request_rate": 0}, "request_rate"),
        ({"concurrency": 0}, "concurrency"),
        ({"apps": ["a", "a"]}, "distinct"),
        ({"apps": []}, "distinct"),
    ],
)
def test_bad_bench_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**kwargs)
