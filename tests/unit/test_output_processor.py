"""OutputProcessor: streamed and final-only outputs of the same token stream agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.default_model import make_default_model
from engine.output_processor import OutputProcessor
from engine.outputs import EngineCoreOutput
from engine.request import FinishReason, SamplingParams
from engine.tokenizer import Tokenizer

TEXT = "naïve café 🎉 日本語 done"  # characters that span several byte-level tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir: Path = make_default_model(tmp_path_factory.mktemp("default") / "model")
    return Tokenizer.from_pretrained(model_dir)


def run(processor: OutputProcessor, ids: list[int], params: SamplingParams):
    """Feed `ids` one token per step; return the outputs handed back and their delta texts
    (read at once: the processor updates one CompletionOutput per request in place)."""
    processor.add_request("r", None, [5, 6, 7], params)
    seen, deltas = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        output = EngineCoreOutput("r", [token], FinishReason.LENGTH if last else None)
        results, _ = processor.process([output])
        seen.extend(results)
        deltas.extend(r.outputs[0].delta_text for r in results)
    return seen, deltas


def test_final_only_returns_one_output_with_the_streamed_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids))
    streamed, deltas = run(OutputProcessor(tokenizer), ids, params)
    final, _ = run(OutputProcessor(tokenizer, final_only=True), ids, params)
    assert len(streamed) == len(ids) and len(final) == 1
    assert "".join(deltas) == TEXT
    completion = final[0].outputs[0]
    assert final[0].finished and completion.finish_reason == "length"
    assert completion.text == completion.delta_text == streamed[-1].outputs[0].text == TEXT
    assert completion.token_ids == completion.new_token_ids == ids


def test_final_only_still_stops_on_stop_strings_as_they_appear(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer, final_only=True)
    processor.add_request("r", None, [5], SamplingParams(stop=["café"]))
    stopped_at = None
    for i, token in enumerate(ids):
        results, stopped = processor.process([EngineCoreOutput("r", [token])])
        if stopped:
            stopped_at = i
            break
    assert stopped_at is not None and stopped_at < len(ids) - 1  # before the stream ended
    assert results[0].finished and results[0].outputs[0].text == "naïve "


def test_several_tokens_in_one_output_stop_at_the_token_that_completed_the_string(
    tokenizer: Tokenizer,
) -> None:
    """A coalesced output (an engine replica's batch of steps) ends exactly where a token-by-
    token stream would: the tokens after the stop string are neither reported nor counted."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(stop=["café"], logprobs=0)
    one_by_one = OutputProcessor(tokenizer)
    one_by_one.add_request("r", None, [5], params)
    for token in ids:
        results, stopped = one_by_one.process([EngineCoreOutput("r", [token])])
        if stopped:
            break
    expected = results[0].outputs[0]
    batched = OutputProcessor(tokenizer)
    batched.add_request("r", None, [5], params)
    logprobs = [([t], [-0.5], 1) for t in ids]
    results, stopped = batched.process([EngineCoreOutput("r", ids, new_logprobs=logprobs)])
    got = results[0].outputs[0]
    assert stopped == ["r"] and got.finish_reason == "stop" and got.stop_reason == "café"
    assert got.token_ids == got.new_token_ids == expected.token_ids
    assert len(got.token_ids) < len(ids)
    assert got.text == got.delta_text == expected.text == "naïve "
    assert got.new_logprobs == logprobs[: len(got.token_ids)]
