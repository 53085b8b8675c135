"""`pdserve bench handoff` on the tiny model: two engines, a real transport between them."""

from __future__ import annotations

import pytest

from pdserve.bench.handoff import HandoffBenchConfig, run

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_handoff_bench_times_the_hand_off_and_its_checksums(transport: str) -> None:
    # 40 tokens: 3 blocks of 16 handed off (the bench itself fails unless the decode engine
    # verified and used every one of them rather than recomputing). The decode leg is the
    # app's: the prefill's token forced, one token computed after it.
    config = HandoffBenchConfig(model="tiny", prompt_lens=(16, 40), repeats=2, transport=transport)
    report = run(config)
    assert report["benchmark"] == "handoff" and report["config"]["transport"] == transport
    assert set(report["prompt_lens"]) == {"16", "40"}
    for length, figures in report["prompt_lens"].items():
        assert figures["blocks"] == -(-int(length) // 16), length
        handoff, checksums = figures["second_token_ms"]["p50"], figures["checksum_ms"]["p50"]
        assert 0 < checksums < handoff
        assert figures["checksum_share"] == pytest.approx(checksums / handoff, abs=1e-4)
        parts = figures["prefill_ms"]["mean"] + figures["decode_leg_ms"]["mean"]
        assert figures["second_token_ms"]["mean"] == pytest.approx(parts, abs=0.01)
        assert figures["colocated_second_token_ms"]["p50"] > 0
        # Every decode leg took the prefill's token with the whole prompt's KV.
        assert figures["adopted"] == config.repeats, length


def test_handoff_bench_compares_answers_through_the_hand_off_with_colocated() -> None:
    config = HandoffBenchConfig(
        model="tiny", prompt_lens=(16, 40), repeats=1, agreement_prompts=3, agreement_tokens=6
    )
    agreement = run(config)["agreement"]
    # float32 kernels: every answer is colocated's, and every decode leg adopted its token.
    assert agreement == {
        "prompts": 3,
        "tokens": 6,
        "identical": 3,
        "first_difference_at": [],
        "adopted": 3,
    }


def test_handoff_bench_between_engines_of_other_tensor_parallel_layouts() -> None:
    # Prefill at two ranks, each with its own heads' cache; decode at one: each read is one
    # piece per prefill rank, staged (the decode engine's cache holds every head).
    config = HandoffBenchConfig(
        model="tiny",
        prompt_lens=(40,),
        repeats=1,
        prefill_tensor_parallel_size=2,
        tensor_parallel_kv_cache="per_rank",
    )
    report = run(config)
    figures = report["prompt_lens"]["40"]
    assert figures["pieces"] == {"direct": 0, "staged": 2}
    assert report["config"]["prefill_tensor_parallel_size"] == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"transport": "carrier-pigeon"}, "must be one of"),
        ({"prompt_lens": ()}, "prompt_lens must be >= 2"),
        ({"prompt_lens": (16, 1)}, "prompt_lens must be >= 2"),
        ({"repeats": 0}, "repeats must be >= 1"),
        ({"decode_tensor_parallel_size": 0}, "tensor-parallel sizes must be >= 1"),
        ({"agreement_prompts": -1}, "agreement_prompts must be >= 0"),
        ({"agreement_tokens": 1}, "agreement_tokens >= 2"),
    ],
)
def test_handoff_bench_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HandoffBenchConfig(**kwargs)
