"""`pdserve generate` and `make-model` through the real console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def pdserve(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """The CLI on the tiny model unless `args` name another (the CLI's default is smollm2)."""
    if args[0] in ("generate", "bench") and "--model" not in args:
        args = (
            (*args[:2], "--model", "tiny", *args[2:])
            if args[0] == "bench"
            else (args[0], "--model", "tiny", *args[1:])
        )
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_with_the_default_model_prints_a_completion():
    result = pdserve("generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() != ""


def test_generate_json_has_one_object_per_prompt():
    result = pdserve(
        "generate",
        "--prompt",
        "Hello",
        "--prompt-token-ids",
        "5,6,7",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 2
    assert records[1]["prompt_token_ids"] == [5, 6, 7]
    for record in records:
        assert set(record) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
        assert len(record["token_ids"]) == 5
        assert record["finish_reason"] == "length"
    # greedy by default: the same prompt twice gives the same tokens
    again = pdserve(
        "generate", "--prompt-token-ids", "5,6,7", "--max-tokens", "5", "--ignore-eos", "--json"
    )
    assert json.loads(again.stdout)["token_ids"] == records[1]["token_ids"]


@pytest.fixture
def gpt2_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/model"], "is not a model directory, a .gguf file"),
        (["--model", "llama-70b"], "or a named model (tiny, smollm2)"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
        (["--prompt-token-ids", "1,x"], "comma-separated integers"),
        (["--max-model-len", "4", "--prompt-token-ids", "1,2,3,4,5"], "max_model_len=4"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = pdserve("generate", "--prompt", "Hi", *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error:")
    assert message in lines[0]


def test_unsupported_architecture_lists_the_supported_ones(gpt2_dir):
    result = pdserve("generate", "--model", gpt2_dir, "--prompt", "Hi")
    assert result.returncode == 2
    assert "unsupported model architecture" in result.stderr
    assert "Qwen3ForCausalLM" in result.stderr


def test_make_model_writes_a_loadable_model(tmp_path):
    result = pdserve("make-model", "--path", str(tmp_path / "m"), "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "m")
    out = pdserve("generate", "--model", str(tmp_path / "m"), "--prompt", "Hi", "--json")
    assert out.returncode == 0, out.stderr


def test_bench_offline_reports_both_sides_and_their_ratio():
    result = pdserve(
        "bench",
        "offline",
        "--num-prompts",
        "3",
        "--input-len",
        "8",
        "--output-len",
        "6",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout[result.stdout.index("{") :])
    for kind in ("fixed", "mixed"):
        entry = report[kind]
        assert entry["engine"]["output_tokens_per_s"] > 0
        assert entry["transformers"]["output_tokens_per_s"] > 0
        ratio = entry["transformers"]["seconds"] / entry["engine"]["seconds"]
        assert entry["speedup"] == pytest.approx(ratio, rel=0.01)
        # greedy on the same weights: the engine and transformers agree token for token
        assert entry["greedy_outputs_identical"] == "3/3"


def test_bench_latency_reports_decode_speed_bound_breakdown_and_a_trace(tmp_path):
    result = pdserve(
        "bench",
        "latency",
        "--model",
        "tiny",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--batch-sizes",
        "1,2",
        "--repeats",
        "1",
        "--profile",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    bound = report["bandwidth_bound_tokens_per_s"]
    assert bound == pytest.approx(
        report["read_bandwidth_gbps"] * 1e9 / report["weight_bytes"], rel=0.01
    )
    for size in (1, 2):
        entry = report["batches"][str(size)]
        tps = entry["decode_tokens_per_s"]
        # Both figures are rounded (ms to 3 places): allow half a unit of the last.
        assert entry["ms_per_step"] == pytest.approx(1000 * size / tps, rel=0.01, abs=0.0005)
        breakdown = entry["breakdown_ms_per_step"]
        assert breakdown["steps"] >= 6  # the prefill step and five decode steps, at least
        assert breakdown["forward"] > 0 and breakdown["sample"] > 0
    single = report["batches"]["1"]
    assert single["fraction_of_bandwidth_bound"] == pytest.approx(
        single["decode_tokens_per_s"] / bound, abs=0.002
    )
    trace = json.loads(Path(report["profile"]).read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    # The prefill's linears and the fused decode steps (a CPU's defaults) are named.
    assert {"pdserve::blocked_linear", "pdserve::fused_decode_step"} <= names


def test_bench_latency_at_two_ranks_reports_rank_0s_share_and_collective_time():
    single = pdserve("bench", "latency", "--model", "tiny", "--output-len", "4", "--repeats", "1",
                     "--batch-sizes", "1")  # fmt: skip
    split = pdserve("bench", "latency", "--model", "tiny", "--output-len", "4", "--repeats", "1",
                    "--batch-sizes", "1", "--tensor-parallel-size", "2")  # fmt: skip
    assert single.returncode == 0 and split.returncode == 0, split.stderr
    one, two = json.loads(single.stdout), json.loads(split.stdout)
    assert two["config"]["tensor_parallel_size"] == 2
    assert two["weight_bytes"] < one["weight_bytes"]  # rank 0 reads its share
    assert "collective_share" not in one["batches"]["1"]
    assert 0 < two["batches"]["1"]["collective_share"] < 1
    assert two["batches"]["1"]["decode_tokens_per_s"] > 0


def test_bench_spec_reports_speedup_acceptance_and_identical_outputs():
    result = pdserve(
        "bench", "spec", "--model", "tiny", "--output-len", "16", "--repeats", "1",
        "--draft-model", "tiny",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["greedy_outputs_identical"] is True
    plain = report["plain"]
    assert report["speedup"] == report["ngram"]["speedup"]
    for name in ("ngram", "draft_model"):
        method = report[name]
        assert method["greedy_outputs_identical"] is True
        ratio = method["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        assert method["speedup"] == pytest.approx(ratio, rel=0.02)
        assert method["num_drafts"] > 0  # the code edit recurs; the draft always proposes
        accepted, drafted = method["num_accepted_tokens"], method["num_draft_tokens"]
        assert method["acceptance_rate"] == pytest.approx(accepted / drafted, abs=0.001)
        assert method["mean_accepted_length"] == pytest.approx(
            1 + accepted / method["num_drafts"], abs=0.001
        )
    # The model drafting for itself: its greedy drafts are the target's greedy tokens.
    assert report["draft_model"]["acceptance_rate"] > 0.9


def test_weight_bytes_counts_a_tied_head_once_and_packed_linears():
    from torch import nn

    from engine.layers import cpu_kernels
    from engine.layers.linear import BlockedEmbedding, BlockedLinear, PackedLinear
    from pdserve.bench.latency import weight_bytes

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 16)
            self.proj = PackedLinear(nn.Linear(16, 32, bias=False))
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 100, bias=False)

    model = Tiny()
    # Untied: the head is read whole each step, the embedding table only a row per token.
    assert weight_bytes(model) == 4 * (16 * 32 + 2 * 16 + 100 * 16)
    model.head = nn.Linear(16, 100, bias=False)
    model.head.weight = model.embed.weight  # tied: the table, read once, as the head
    assert weight_bytes(model) == 4 * (16 * 32 + 2 * 16 + 100 * 16)
    del model.head
    assert weight_bytes(model) == 4 * (16 * 32 + 2 * 16)  # no head: the table is not read
    # A blocked linear counts its matrix (not its padding to 16 columns) and its bias.
    model.proj = BlockedLinear(nn.Linear(16, 20, bias=True), cpu_kernels.load())
    assert weight_bytes(model) == 4 * (16 * 20 + 20 + 2 * 16)
    # A tied head in blocks, its embedding gathering from them: the table counted once.
    tied = nn.Linear(16, 100, bias=False)
    tied.weight = model.embed.weight
    model.head = BlockedLinear(tied, cpu_kernels.load())
    model.embed = BlockedEmbedding(model.head)
    assert weight_bytes(model) == 4 * (16 * 20 + 20 + 2 * 16 + 100 * 16)


@pytest.mark.parametrize("streams", [1, 3, 8])
@pytest.mark.parametrize("size", [7, 8, 1001, 4096 + 13])
def test_read_probe_sums_every_element_whatever_the_stream_count(size, streams):
    """The bandwidth probe interleaves streams per thread; whatever their count it must read
    every element once (remainders of the streams, of the 8-lane vectors), or the bound it
    times would be for fewer bytes than it claims."""
    from engine.layers import cpu_kernels

    buffer = torch.arange(size, dtype=torch.float32)
    assert cpu_kernels.load().stream_sum(buffer, streams) == size * (size - 1) / 2
    with pytest.raises(RuntimeError, match="streams"):
        cpu_kernels.load().stream_sum(buffer, 0)


def test_bench_structured_reports_both_runs_on_the_same_token_count():
    result = pdserve(
        "bench", "structured", "--model", "tiny", "--num-prompts", "2", "--max-tokens", "24"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["output_tokens"] > 0
    for run in ("constrained", "unconstrained"):
        ms = report[run]["ms_per_token"]
        assert ms == pytest.approx(report[run]["seconds"] * 1e3 / report["output_tokens"], 0.05)
    assert report["sample"].startswith('{"name": "')  # the schema's first key, by the grammar
    assert set(report["compile_ms"]) == {
        "first_with_vocabulary",
        "same_schema_cached",
        "new_schema",
    }
