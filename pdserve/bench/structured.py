"""`pdserve bench structured`: what a JSON-schema constraint costs per output token.

Two runs of the same chat prompts on one engine, greedy. First constrained by a JSON schema:
each request writes its JSON object and stops. Then unconstrained, each request held to exactly
the length its constrained twin had (`ignore_eos`): the same batches, the same token counts, so
the difference in time is the grammar's (matcher advance + bitmask fill + mask per token). Also
reported: how long compiling a schema takes the first time (with the vocabulary set-up), again
(cached), and for a new schema.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
_TOPICS = ("a chef", "a pilot", "a painter", "a teacher", "a sailor", "a doctor", "a poet")


@dataclass(frozen=True)
class StructuredBenchConfig:
    model: str = "smollm2"
    """the model"""
    num_prompts: int = 16
    """prompts, each run with and without the schema"""
    max_tokens: int = 96
    """output tokens per prompt at most"""
    seed: int = 0
    """the prompts' choice"""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _prompts(n: int) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": f"Invent {_TOPICS[i % len(_TOPICS)]} number {i}. Reply in JSON.",
                }
            ]
        }
        for i in range(n)
    ]


def _timed_generate(llm: Any, prompts: list[Any], params: Any) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0] for o in outputs]


def _compile_seconds(llm: Any, schema: dict[str, Any]) -> float:
    from engine.request import SamplingParams, StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    start = time.perf_counter()
    llm.engine.runner.validate_params(params)  # what admission does: compile (or hit the cache)
    return time.perf_counter() - start


def run(config: StructuredBenchConfig) -> dict[str, Any]:
    from engine.llm import LLM
    from engine.request import SamplingParams, StructuredOutputsParams

    # No prefix caching: the second run would otherwise skip the prefills the first one did.
    llm = LLM(
        config.model,
        max_model_len=1024,
        max_num_seqs=config.num_prompts,
        seed=config.seed,
        enable_prefix_caching=False,
    )
    compile_first = _compile_seconds(llm, DEFAULT_SCHEMA)
    compile_cached = _compile_seconds(llm, DEFAULT_SCHEMA)
    other = {**DEFAULT_SCHEMA, "required": ["name", "age"]}
    compile_new = _compile_seconds(llm, other)
    structured = StructuredOutputsParams(json=json.dumps(DEFAULT_SCHEMA))
    constrained = SamplingParams(
        temperature=0.0, max_tokens=config.max_tokens, structured_outputs=structured
    )
    prompts = _prompts(config.num_prompts)
    _timed_generate(llm, prompts[:2], constrained)  # warm-up, both paths
    _timed_generate(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8))
    with_grammar, outputs = _timed_generate(llm, prompts, constrained)
    lengths = [len(o.token_ids) for o in outputs]
    twins = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    without, _ = _timed_generate(llm, prompts, twins)
    tokens = sum(lengths)
    valid = sum(_is_json_object(o.text) for o in outputs)
    return {
        "benchmark": "structured",
        "config": asdict(config),
        "output_tokens": tokens,
        "valid_json": f"{valid}/{config.num_prompts}",
        "finished_by_grammar": sum(o.finish_reason == "stop" for o in outputs),
        "constrained": {
            "seconds": round(with_grammar, 6),
            "ms_per_token": _ms(with_grammar, tokens),
        },
        "unconstrained": {"seconds": round(without, 6), "ms_per_token": _ms(without, tokens)},
        "overhead_ms_per_token": _ms(with_grammar - without, tokens),
        "compile_ms": {
            "first_with_vocabulary": round(compile_first * 1e3, 2),
            "same_schema_cached": round(compile_cached * 1e3, 3),
            "new_schema": round(compile_new * 1e3, 2),
        },
        "sample": outputs[0].text,
    }


def _ms(seconds: float, tokens: int) -> float:
    return round(seconds * 1e3 / max(tokens, 1), 3)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


CONFIG = StructuredBenchConfig
