"""Structured outputs: the parameters, the xgrammar logits processor row by row, and the engine
producing text of the asked-for language (on the tiny model, whose random weights would
otherwise write noise: every valid output here is the grammar's doing)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.llm import LLM
from engine.request import SamplingParams, StructuredOutputsParams
from engine.sample.logits_processor import BatchUpdate, LogitsProcessorConfig, MoveDirectionality
from engine.sample.logits_processor.structured import StructuredOutputLogitsProcessor

MODEL = "tiny"  # the generated test model
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "tag", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, max_model_len=256)


# --- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
        ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
        ({"choice": []}, "choice must be a list of non-empty strings"),
        ({"json": "{not json"}, "invalid structured output json: the schema is not JSON"),
        (
            {"json": '{"type": "objekt"}'},
            'invalid structured output json: Unsupported type "objekt"',
        ),
        ({"regex": "a(b"}, "invalid structured output regex: Regex parsing error"),
        ({"grammar": 'root ::= "a" |'}, "invalid structured output grammar: EBNF parser error"),
        ({"choice": "ab"}, "choice must be a list of strings, not a string"),
    ],
)
def test_bad_structured_params_are_refused_when_made(kwargs, words):
    with pytest.raises(ValueError) as excinfo:
        StructuredOutputsParams(**kwargs)
    message = str(excinfo.value)
    assert words in message
    assert ".cc:" not in message and "/project/" not in message  # no C++ source positions


def test_min_tokens_does_not_combine_with_a_grammar():
    """A grammar that completes early allows only eos, which min_tokens forbids."""
    structured = StructuredOutputsParams(choice=("a", "b"))
    with pytest.raises(ValueError, match="min_tokens does not combine with structured outputs"):
        SamplingParams(min_tokens=3, structured_outputs=structured)


# --- the processor, row by row -----------------------------------------------------------------


def _processor(llm: LLM) -> StructuredOutputLogitsProcessor:
    config = LogitsProcessorConfig(
        vocab_size=llm.engine.arch.vocab_size,
        max_num_seqs=4,
        eos_token_id=llm.engine.arch.eos_token_id,
        tokenizer=llm.tokenizer,
    )
    return StructuredOutputLogitsProcessor(config, torch.device("cpu"))


def _allowed(processor: StructuredOutputLogitsProcessor, rows: int, vocab: int) -> list[set[int]]:
    logits = processor.apply(torch.zeros(rows, vocab))
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def test_processor_masks_advances_and_ends_with_eos(llm):
    tokenizer, vocab, eos = llm.tokenizer, llm.engine.arch.vocab_size, llm.engine.arch.eos_token_id
    processor = _processor(llm)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=("yes", "no")))
    plain = SamplingParams()
    output: list[int] = []
    processor.update_state(BatchUpdate(2, (), ((0, plain, [1], []), (1, params, [1], output)), ()))
    free, constrained = _allowed(processor, 2, vocab)
    assert len(free) == vocab  # an unconstrained row is left alone
    first = {tokenizer.decode([t]) for t in constrained}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)
    output.extend(tokenizer.encode("yes", add_special_tokens=False))  # the live output grows
    processor.update_state(None)
    assert _allowed(processor, 2, vocab)[1] == {eos}  # complete: only the end is allowed
    # A row that moves keeps its matcher; a removed row is forgotten.
    processor.update_state(BatchUpdate(2, (), (), ((1, 0, MoveDirectionality.SWAP),)))
    assert _allowed(processor, 2, vocab)[0] == {eos}
    processor.update_state(BatchUpdate(2, (0,), (), ()))
    assert all(len(allowed) == vocab for allowed in _allowed(processor, 2, vocab))


def test_a_row_that_starts_with_output_replays_it(llm):
    """A decode leg or a resumed request joins with output tokens: the matcher catches up."""
    tokenizer, vocab = llm.tokenizer, llm.engine.arch.vocab_size
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"ab(cd|ef)"))
    processor = _processor(llm)
    output = tokenizer.encode("ab", add_special_tokens=False)
    processor.update_state(BatchUpdate(1, (), ((0, params, [1], output),), ()))
    allowed = {tokenizer.decode([t]) for t in _allowed(processor, 1, vocab)[0]}
    assert allowed and all("cd".startswith(s) or "ef".startswith(s) for s in allowed)
    # The output shrinks (rolled back): the matcher starts over from what is left.
    del output[:]
    processor.update_state(None)
    allowed = {tokenizer.decode([t]) for t in _allowed(processor, 1, vocab)[0]}
    assert allowed and all("abcd".startswith(s) for s in allowed)


def test_a_forced_token_outside_the_grammar_ends_the_constraint(llm):
    """The decode leg's forced first token comes from a prefill that used the same grammar, so
    it is accepted; one the grammar forbids leaves the row unconstrained, not stuck."""
    tokenizer, vocab = llm.tokenizer, llm.engine.arch.vocab_size
    structured = StructuredOutputsParams(regex="[0-9]+")
    (digit,) = tokenizer.encode("7", add_special_tokens=False)
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    processor = _processor(llm)
    accepted, refused = [digit], [letter]
    params = SamplingParams(structured_outputs=structured)
    added = ((0, params, [1], accepted), (1, params, [1], refused))
    processor.update_state(BatchUpdate(2, (), added, ()))
    after_digit, after_letter = _allowed(processor, 2, vocab)
    assert digit in after_digit and letter not in after_digit
    assert llm.engine.arch.eos_token_id in after_digit  # "7" is already a whole match
    assert len(after_letter) == vocab


class _TwoEos:
    """The tiny tokenizer with a second end-of-sequence id, as Llama 3 has."""

    def __init__(self, tokenizer, extra: int) -> None:
        self.backend = tokenizer.backend
        self.eos_token_ids = (*tokenizer.eos_token_ids, extra)


def test_a_complete_grammar_allows_every_eos_id(llm):
    tokenizer, vocab, eos = llm.tokenizer, llm.engine.arch.vocab_size, llm.engine.arch.eos_token_id
    extra = 2
    config = LogitsProcessorConfig(
        vocab_size=vocab, max_num_seqs=4, eos_token_id=eos, tokenizer=_TwoEos(tokenizer, extra)
    )
    processor = StructuredOutputLogitsProcessor(config, torch.device("cpu"))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=("yes",)))
    output = tokenizer.encode("yes", add_special_tokens=False)
    processor.update_state(BatchUpdate(1, (), ((0, params, [1], output),), ()))
    assert _allowed(processor, 1, vocab)[0] == {eos, extra}


def test_an_engine_without_a_tokenizer_refuses_constrained_requests(llm):
    config = LogitsProcessorConfig(vocab_size=llm.engine.arch.vocab_size, max_num_seqs=4)
    processor = StructuredOutputLogitsProcessor(config, torch.device("cpu"))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="need a model with a tokenizer"):
        processor.validate_params(params)


# --- the engine ----------------------------------------------------------------------------------


def _generate(llm: LLM, structured: StructuredOutputsParams, **params) -> tuple[str, str | None]:
    sampling = SamplingParams(max_tokens=60, structured_outputs=structured, **params)
    out = llm.generate("Tell me something", sampling)[0].outputs[0]
    return out.text, out.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choice_regex_and_schema_outputs_belong_to_their_language(llm, temperature):
    text, reason = _generate(
        llm, StructuredOutputsParams(choice=("alpha", "beta")), seed=1, temperature=temperature
    )
    assert text in ("alpha", "beta") and reason == "stop"
    text, reason = _generate(
        llm, StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}"), seed=2, temperature=temperature
    )
    assert re.fullmatch(r"[a-z]{3}-\d{2}", text) and reason == "stop"
    text, reason = _generate(
        llm, StructuredOutputsParams(json=json.dumps(SCHEMA)), seed=3, temperature=temperature
    )
    value = json.loads(text)
    assert set(value) == {"ok", "tag", "n"} and isinstance(value["ok"], bool)
    assert value["tag"] in ("red", "green", "blue") and 0 <= value["n"] <= 99


def test_unconstrained_output_of_the_same_request_is_not_json(llm):
    """The control: without the grammar this model does not write JSON by itself."""
    out = llm.generate("Tell me something", SamplingParams(max_tokens=30, temperature=0.0))
    with pytest.raises(json.JSONDecodeError):
        json.loads(out[0].outputs[0].text)


def test_seeded_constrained_sampling_is_reproducible(llm):
    structured = StructuredOutputsParams(json=json.dumps(SCHEMA))
    runs = [_generate(llm, structured, temperature=1.0, seed=5) for _ in range(2)]
    assert runs[0] == runs[1]
