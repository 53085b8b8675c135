"""Structured outputs with xgrammar: grammars from requests, compiled once per engine.

A request's `StructuredOutputsParams` becomes an xgrammar `Grammar` (JSON schema, any JSON
object, regex, choice, EBNF); `StructuredOutputs` compiles it against the model's vocabulary
(cached: a schema compiles once per engine, however many requests use it) and hands out
matchers, which the logits processor (logits_processor/structured.py) advances token by token.

JSON is compact (no free whitespace between tokens): with "any whitespace" allowed, a model
can emit whitespace forever and still satisfy the grammar — a known failure of constrained
decoding that vLLM has a flag against. Compact JSON parses the same.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.request import StructuredOutputsParams
    from engine.tokenizer import Tokenizer

# Compiled grammars kept per engine (least recently used go first): a server that sees many
# distinct schemas must not grow without bound.
_COMPILED_CACHE_BYTES = 256 << 20

# xgrammar's errors start with a timestamp and its C++ source position: not for clients.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def check_grammar(params: StructuredOutputsParams) -> None:
    """Build the grammar (no tokenizer needed); ValueError with a clean message if it is bad."""
    build_grammar(params)


@functools.lru_cache(maxsize=256)
def build_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar Grammar of `params`, cached by value: one request builds it when its
    params are made (and remade, for each leg) and again when each engine admits it."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            return _json_schema_grammar(str(params.json))
        if kind == "json_object":  # OpenAI's: an object, not any JSON value
            return _json_schema_grammar('{"type": "object"}')
        if kind == "regex":
            return xgr.Grammar.from_regex(str(params.regex))
        if kind == "choice":
            # JSON string literals are EBNF string literals, escapes included.
            choices = params.choice or ()
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))
        return xgr.Grammar.from_ebnf(str(params.grammar))
    except RuntimeError as err:
        raise ValueError(f"invalid structured output {kind}: {_clean(err)}") from None


def _json_schema_grammar(schema: str) -> Any:
    import xgrammar as xgr

    try:
        json.loads(schema)
    except json.JSONDecodeError as err:
        raise RuntimeError(f"the schema is not JSON ({err.msg})") from None
    return xgr.Grammar.from_json_schema(schema, any_whitespace=False)


def _clean(err: BaseException) -> str:
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return _XGRAMMAR_PREFIX.sub("", lines[0])


class StructuredOutputs:
    """One engine's grammar compiler over its tokenizer's vocabulary, built on first use."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._lock = threading.Lock()  # the engine loop and the admission check both compile

    @property
    def available(self) -> bool:
        return self._tokenizer is not None and bool(self._stop_token_ids)

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh xgrammar GrammarMatcher for `params` (compiled grammars are cached)."""
        import xgrammar as xgr

        compiled = self._compiler_once().compile_grammar(build_grammar(params))
        return xgr.GrammarMatcher(compiled)

    def _compiler_once(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        import transformers
        import xgrammar as xgr

        if self._tokenizer is None:
            raise ValueError("structured outputs need a model with a tokenizer")
        # xgrammar reads a vocabulary through transformers' tokenizer class (it works out the
        # byte-level encoding and the special tokens from it).
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(
            fast, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
        )
        return xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=_COMPILED_CACHE_BYTES
        )
