"""The tokenizer a GGUF file describes, built as a `tokenizers` tokenizer.

A GGUF has no tokenizer.json: llama.cpp keeps the vocabulary, the merges, the token types and the
special-token ids as metadata (`tokenizer.ggml.*`), and names the pre-tokenizer (how text is cut
into words before BPE) by a short string, `tokenizer.ggml.pre`. This module maps those onto the
`tokenizers` library's parts; `Tokenizer` (tokenizer.py) then works as for a model directory.

The reference is llama.cpp, the format's own runtime: a file encodes here as it does there.
Supported:
- byte-level BPE (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3, Qwen2) with the
  pre-tokenizers in `_PRE_TOKENIZERS`, each llama.cpp's split rules for that name;
- SentencePiece BPE (`"llama"`: Llama 2, Mistral), whose merges a GGUF does not store: they follow
  from the vocabulary and its scores (a pair merges with the priority of the token it makes).

Where transformers' GGUF reader differs, we follow llama.cpp (and, where there is one, the
model's own tokenizer.json): it knows no "smollm" digit rule, splits "default" GPT-2's way where
llama.cpp has a rule of its own, and gives a SentencePiece file Metaspace's "first" prefix where
llama.cpp prefixes a space to every stretch of text. The tests pin down each difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import Tokenizer, TokenizerConfig

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4

# GPT-2's split (ByteLevel's own regex, and llama.cpp's "gpt-2").
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
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
# llama.cpp's fallback ("default", or no `tokenizer.ggml.pre`): punctuation runs apart, then
# GPT-2's split, then numbers apart, then ASCII digits in threes. Not plain GPT-2.
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _PreTokenizer:
    """How one `tokenizer.ggml.pre` value splits text: llama.cpp's regexes, each applied to
    the pieces the previous one left (matches and the text between them both kept)."""

    splits: tuple[str, ...]
    # Look a whole word up in the vocabulary before merging (Llama 3's "ignore_merges").
    ignore_merges: bool = False
    # bos added when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos_default: bool = False

    def build(self) -> pre_tokenizers.PreTokenizer:
        steps: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
            for pattern in self.splits
        ]
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        return pre_tokenizers.Sequence(steps)


_GPT2 = _PreTokenizer((_GPT2_SPLIT,))
_DIGITS_THEN_GPT2 = _PreTokenizer((r"\p{N}", _GPT2_SPLIT))
_LLAMA3 = _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos_default=True)
_QWEN2 = _PreTokenizer((_QWEN2_SPLIT,))

# `tokenizer.ggml.pre` -> its rules, as llama.cpp's llama-vocab.cpp groups the names.
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer(_DEFAULT_SPLITS),
    "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
# No normalizer for any of them: Qwen2's tokenizer.json has NFC, but llama.cpp applies none.

SUPPORTED_TOKENIZERS = ("gpt2 (byte-level BPE)", "llama (SentencePiece BPE)")


@dataclass(frozen=True)
class _Defaults:
    """What llama.cpp assumes where a file is silent."""

    add_bos: bool = False
    bos_id: int | None = None
    eos_id: int | None = None


_SENTENCEPIECE_DEFAULTS = _Defaults(add_bos=True, bos_id=1, eos_id=2)
_SPACE = "\u2581"  # SentencePiece's visible space


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer in the metadata of the GGUF file at `path`, named after the file."""
    backend, config = gguf_tokenizer_parts(path)
    return Tokenizer(backend, config, name=Path(path).name)


def gguf_tokenizer_parts(path: str | Path) -> tuple[HFTokenizer, TokenizerConfig]:
    from engine.models.gguf_file import open_gguf, release_vocabulary

    parts = tokenizer_parts(open_gguf(path, vocabulary=True), Path(path).name)
    release_vocabulary(path)  # built: the engine's loading needs the rest of the reader only
    return parts


def tokenizer_parts(reader: Any, name: str) -> tuple[HFTokenizer, TokenizerConfig]:
    """The backend tokenizer and its config, from a GGUF reader's metadata; a tokenizer this
    module cannot build exactly is a ValueError that says what it can."""
    meta = _Metadata(reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        rules = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), name)
        vocab = _Vocab.read(meta)
        defaults = _Defaults(add_bos=rules.add_bos_default)
        return _byte_level(vocab, rules), _config(meta, vocab, defaults)
    if kind == "llama":
        vocab = _Vocab.read(meta)
        unknown = _special_id(meta, vocab, "unknown", 0)
        backend = _sentencepiece(
            vocab,
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            unknown=None if unknown is None else vocab.tokens[unknown],
        )
        return backend, _config(meta, vocab, _SENTENCEPIECE_DEFAULTS)
    raise ValueError(
        f"{name}: unsupported GGUF tokenizer {kind!r}; supported: "
        f"{', '.join(SUPPORTED_TOKENIZERS)} (or pass --tokenizer DIR)"
    )


def _pre_tokenizer(pre: str, name: str) -> _PreTokenizer:
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{name}: unsupported GGUF pre-tokenizer {pre!r}; supported: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))} (or pass --tokenizer DIR)"
        )
    return _PRE_TOKENIZERS[pre]


@dataclass(frozen=True)
class _Metadata:
    reader: Any

    def get(self, key: str, default: Any = None) -> Any:
        from engine.models.gguf_file import metadata

        return metadata(self.reader, key, default)


@dataclass(frozen=True)
class _Vocab:
    """The `tokenizer.ggml.*` arrays: token strings, their types, scores and merges."""

    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[tuple[str, str]]

    @classmethod
    def read(cls, meta: _Metadata) -> _Vocab:
        tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens", [])]
        # "left right", cut at the first space after the first character (as llama.cpp does).
        cuts = [(m, m.find(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        return cls(
            tokens=tokens,
            types=[int(t) for t in meta.get("tokenizer.ggml.token_type", [])],
            scores=[float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))],
            merges=[(m[:cut], m[cut + 1 :]) for m, cut in cuts if cut > 0],
        )

    @cached_property
    def ids(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}

    def of_type(self, *kinds: int) -> list[str]:
        return [t for t, kind in zip(self.tokens, self.types, strict=False) if kind in kinds]


def _byte_level(vocab: _Vocab, rules: _PreTokenizer) -> HFTokenizer:
    backend = HFTokenizer(
        models.BPE(vocab=vocab.ids, merges=vocab.merges, ignore_merges=rules.ignore_merges)
    )
    backend.pre_tokenizer = rules.build()
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, vocab)
    return backend


def _sentencepiece(vocab: _Vocab, *, add_space_prefix: bool, unknown: str | None) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp runs it: spaces written as U+2581, one more in front of
    every stretch of text (at the start and after each special token) when the file says
    `add_space_prefix`, characters outside the vocabulary spelled as byte tokens <0xNN>."""
    ids = vocab.ids
    backend = HFTokenizer(
        models.BPE(
            vocab=ids,
            merges=vocab.merges or _merges_from_scores(ids, vocab.scores),
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # A normalizer, not Metaspace: it runs on each stretch between added tokens and prepends
    # even to text that starts with a space (" hi" -> "▁▁hi"), as llama.cpp and sentencepiece do.
    spaces: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPACE)]
    if add_space_prefix:
        spaces.insert(0, normalizers.Prepend(_SPACE))
    backend.normalizer = normalizers.Sequence(spaces)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_special_tokens(backend, vocab)
    return backend


def _merges_from_scores(ids: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; merges rank by the made token's score
    (best first), then by the lengths of their halves (longer left first), then by the made
    token's id: SentencePiece's order, ties as transformers breaks them."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for token, token_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[token_id], -len(left), -len(right), token_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: HFTokenizer, vocab: _Vocab) -> None:
    """Control and unknown tokens (`<|im_start|>`, `<unk>`) become special added tokens:
    matched whole in text and dropped by skip_special_tokens. User-defined ones (`<think>`)
    are matched whole but kept."""
    special = vocab.of_type(_CONTROL, _UNKNOWN)
    user = vocab.of_type(_USER_DEFINED)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _special_id(meta: _Metadata, vocab: _Vocab, role: str, default: int | None) -> int | None:
    """`tokenizer.ggml.{role}_token_id`, or `default`; None if neither names a token."""
    token_id = meta.get(f"tokenizer.ggml.{role}_token_id", default)
    if token_id is None or not 0 <= int(token_id) < len(vocab.tokens):
        return None
    return int(token_id)


def _config(meta: _Metadata, vocab: _Vocab, defaults: _Defaults) -> TokenizerConfig:
    """bos/eos from their ids, add_bos/add_eos from the flags. Generation ends on eos and on
    the end-of-turn/-message tokens a file may name, as in llama.cpp."""
    bos_id = _special_id(meta, vocab, "bos", defaults.bos_id)
    eos_id = _special_id(meta, vocab, "eos", defaults.eos_id)
    ends = (eos_id, _special_id(meta, vocab, "eot", None), _special_id(meta, vocab, "eom", None))
    return TokenizerConfig(
        bos_token=None if bos_id is None else vocab.tokens[bos_id],
        eos_token=None if eos_id is None else vocab.tokens[eos_id],
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", defaults.add_bos)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        eos_token_ids=tuple(dict.fromkeys(i for i in ends if i is not None)),
        bos_token_id=bos_id,
    )
