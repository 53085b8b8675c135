"""The tokenizer a GGUF file describes, built as a `tokenizers` tokenizer.

A GGUF has no tokenizer.json: llama.cpp keeps the vocabulary, the merges, the token types and the
special-token ids as metadata (`tokenizer.ggml.*`), and names the pre-tokenizer (how text is cut
into words before BPE) by a short string, `tokenizer.ggml.pre`. This module maps those onto the
`tokenizers` library's parts; `Tokenizer` (tokenizer.py) then works as for a model directory.

Supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3, Qwen2) with
the pre-tokenizers in `_PRE_TOKENIZERS`, whose splitting rules are llama.cpp's; and SentencePiece
BPE (`"llama"`: Llama 2, Mistral), whose merges a GGUF does not store: they follow from the
vocabulary and its scores (a pair merges with the priority of the token it makes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import TokenizerConfig

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_CONTROL = 3
_USER_DEFINED = 4

# Llama 3: letters with an optional leading non-letter, numbers in runs of up to three digits.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: as Llama 3, but every digit is a word of its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is GPT-2's.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # Digits one by one, then GPT-2's rules (SmolLM's tokenizer.json; llama.cpp's "smollm").
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# `tokenizer.ggml.pre` -> the pre-tokenizer. Names follow llama.cpp's converter.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "smollm": _smollm,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
}
# Llama 3 looks a whole word up in the vocabulary before merging (its tokenizer.json says
# "ignore_merges": true); the others always merge. No normalizer: Qwen2's tokenizer.json has
# NFC, but neither llama.cpp nor transformers applies it to a GGUF, and we tokenize as they do.
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})
SUPPORTED_TOKENIZERS = ("gpt2 (byte-level BPE)", "llama (SentencePiece BPE)")
_SPACE = "\u2581"  # SentencePiece's visible space


def tokenizer_parts(reader: Any, name: str) -> tuple[HFTokenizer, TokenizerConfig]:
    """The backend tokenizer and its config, from a GGUF reader's metadata."""
    from engine.models.gguf_file import metadata

    kind = metadata(reader, "tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece(reader)
    if kind != "gpt2":
        raise ValueError(
            f"{name}: unsupported GGUF tokenizer {kind!r}; supported: "
            f"{', '.join(SUPPORTED_TOKENIZERS)} (or pass --tokenizer DIR)"
        )
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{name}: unsupported GGUF pre-tokenizer {pre!r}; supported: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))} (or pass --tokenizer DIR)"
        )
    tokens: list[str] = list(metadata(reader, "tokenizer.ggml.tokens", []))
    token_types: list[int] = list(metadata(reader, "tokenizer.ggml.token_type", []))
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges", [])]
    backend = HFTokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, token_types)
    return backend, _config(reader, tokens)


def _sentencepiece(reader: Any) -> tuple[HFTokenizer, TokenizerConfig]:
    """SentencePiece BPE: spaces written as U+2581 (one prepended to the text), unknown
    characters spelled as byte tokens <0xNN>."""
    from engine.models.gguf_file import metadata

    tokens: list[str] = list(metadata(reader, "tokenizer.ggml.tokens", []))
    types: list[int] = list(metadata(reader, "tokenizer.ggml.token_type", []))
    scores: list[float] = list(metadata(reader, "tokenizer.ggml.scores", [0.0] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(vocab, scores),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_special_tokens(backend, tokens, types)
    config = _config(reader, tokens)
    if metadata(reader, "tokenizer.ggml.add_bos_token") is None:  # SentencePiece's default
        config = replace(config, add_bos_token=True)
    return backend, config


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; merges rank by the made token's score
    (best first), then by the lengths of their halves (longer left first), then by the made
    token's id and the halves' ids: SentencePiece's order, ties as transformers breaks them."""
    candidates: list[tuple[float, int, int, int, int, int, str, str]] = []
    for token, token_id in vocab.items():
        score = scores[token_id]
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                rank = (-score, -len(left), -len(right), token_id, vocab[left], vocab[right])
                candidates.append((*rank, left, right))
    candidates.sort()
    return [(left, right) for *_, left, right in candidates]


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (`<|im_start|>`) become special added tokens: matched whole in text and
    dropped by skip_special_tokens. User-defined ones (`<think>`) are matched whole but kept."""
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _config(reader: Any, tokens: list[str]) -> TokenizerConfig:
    from engine.models.gguf_file import metadata

    def token(key: str) -> tuple[str | None, int | None]:
        token_id = metadata(reader, f"tokenizer.ggml.{key}")
        if token_id is None or not 0 <= int(token_id) < len(tokens):
            return None, None
        return tokens[int(token_id)], int(token_id)

    bos, bos_id = token("bos_token_id")
    eos, eos_id = token("eos_token_id")
    return TokenizerConfig(
        bos_token=bos,
        eos_token=eos,
        add_bos_token=bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata(reader, "tokenizer.chat_template"),
        eos_token_ids=() if eos_id is None else (eos_id,),
        bos_token_id=bos_id,
    )


def gguf_tokenizer_parts(path: str | Path) -> tuple[HFTokenizer, TokenizerConfig]:
    from engine.models.gguf_file import open_gguf

    return tokenizer_parts(open_gguf(path), Path(path).name)
