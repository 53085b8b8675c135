"""The tokenizer in a GGUF file's metadata: encode, decode and the chat template agree with
transformers reading the same file, for SmolLM2's file and for files written from the tiny
model's tokenizer with several pre-tokenizers; what cannot be built is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers

from engine.models.catalog import resolve_model
from engine.models.default_model import build_tokenizer, ensure_default_model
from engine.testing.gguf_writer import write_gguf
from engine.tokenizer import Tokenizer

CORPUS = (
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159 and a million is 1,000,000.",
    "naïve café, Ελληνικά, 日本語のテキスト, 🙂🚀, e\u0301 (combining), ß",
    "  leading spaces\n\n\ttabs\r\nand\u00a0non-breaking   trailing  ",
    "def f(x):\n    return x**2  # square\n",
    "I'm here, you're there, they'll SEE it's OK",
    "",
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def _pair(path: Path) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, theirs


def _check_same(path: Path, corpus: tuple[str, ...]) -> None:
    ours, theirs = _pair(path)
    for text in corpus:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                expected = theirs.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected, (text, skip)
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATION) == expected
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id


def test_smollm2_tokenizes_as_transformers_does():
    path = resolve_model("smollm2")
    specials = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b")
    _check_same(path, CORPUS + specials)
    ours = Tokenizer.from_pretrained(path)
    # Digits one by one (llama.cpp's "smollm" pre-tokenizer), control tokens whole and special.
    assert [ours.decode([i]) for i in ours.encode("2024")] == ["2", "0", "2", "4"]
    assert ours.encode("<|im_end|>") == [2] and ours.decode([2]) == ""
    assert ours.eos_token_ids == (2,)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gguf")
    source = ensure_default_model()
    return {
        pre: write_gguf(source, root / f"tiny-{pre}.gguf", "F32", pre)
        for pre in ("default", "qwen2", "llama-bpe", "smollm")
    }


# The tiny vocabulary has no <|endoftext|>; transformers' GPT-2 class adds one of its own, so a
# text with it is left out here (SmolLM2's test covers control tokens in text).
TINY_SPECIALS = ("<|user|>\nhi</s>\n<|assistant|>\n", "<think>why</think> so")


# Not "smollm": transformers does not know it and splits digits GPT-2's way, where llama.cpp
# (and SmolLM's own tokenizer.json) split them one by one; SmolLM2's vocabulary has no
# multi-digit tokens, so on its file the two agree (above). The digit rule is checked below.
@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe"])
def test_written_files_tokenize_as_transformers_does(tiny_files, pre):
    _check_same(tiny_files[pre], CORPUS + TINY_SPECIALS)


def test_a_written_file_round_trips_the_source_tokenizer(tiny_files):
    """The tiny tokenizer.json is GPT-2-style byte-level BPE with bos added; so is its GGUF."""
    source = Tokenizer.from_pretrained(ensure_default_model())
    ours = Tokenizer.from_pretrained(tiny_files["default"])
    for text in CORPUS + TINY_SPECIALS:
        assert ours.encode(text) == source.encode(text)
        assert ours.encode(text)[:1] == [source.bos_token_id]
    assert ours.all_special_ids == source.all_special_ids
    # <think> is user-defined: matched whole, kept when special tokens are skipped.
    think = ours.encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and ours.decode(think) == "<think>"


def test_pre_tokenizers_differ_where_their_rules_do(tiny_files):
    digits = {pre: Tokenizer.from_pretrained(path) for pre, path in tiny_files.items()}
    pieces = {pre: [t.decode([i]) for i in t.encode("x 12345", False)] for pre, t in digits.items()}
    assert "".join(pieces["qwen2"]) == "".join(pieces["default"]) == "x 12345"
    assert pieces["qwen2"][-5:] == ["1", "2", "3", "4", "5"]  # one digit per word
    assert pieces["smollm"][-5:] == ["1", "2", "3", "4", "5"]
    assert all(len(p) <= 3 for p in pieces["llama-bpe"][2:])  # runs of up to three digits


def _tokenizer_file(path: Path, model: str, pre: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("model", "pre", "words"),
    [
        (
            "rwkv",
            "default",
            "unsupported GGUF tokenizer 'rwkv'; supported: gpt2 (byte-level BPE), llama",
        ),
        ("gpt2", "klingon", "pre-tokenizer 'klingon'; supported: deepseek-r1-qwen, default,"),
    ],
)
def test_unsupported_tokenizers_are_refused_by_name(tmp_path, model, pre, words):
    path = _tokenizer_file(tmp_path / "t.gguf", model, pre)
    with pytest.raises(ValueError) as excinfo:
        Tokenizer.from_pretrained(path)
    assert words in str(excinfo.value)
    assert str(tmp_path) not in str(excinfo.value)  # the file's name, never where it lives


def test_a_minimal_file_tokenizes(tmp_path):
    tokenizer = Tokenizer.from_pretrained(_tokenizer_file(tmp_path / "t.gguf", "gpt2", "default"))
    assert tokenizer.encode("abab") == [2, 2]
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_ids == ()


def _sentencepiece_file(path: Path, add_space_prefix: bool) -> Path:
    """A SentencePiece-style GGUF (Llama 2 / Mistral): special and byte tokens, then pieces with
    U+2581 for spaces and scores in merge order, taken from the tiny tokenizer's merges."""
    spec = json.loads(build_tokenizer().to_str())
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    scores = [0.0] * len(tokens)
    pieces = ["\u2581", *(chr(c) for c in range(33, 127))]
    for merge in spec["model"]["merges"]:
        piece = "".join(merge if isinstance(merge, list) else merge.split(" "))
        if all(32 < ord(c) < 127 or c == "Ġ" for c in piece):
            pieces.append(piece.replace("Ġ", "\u2581"))
    for rank, piece in enumerate(dict.fromkeys(pieces)):
        tokens.append(piece)
        types.append(1)
        scores.append(-1e6 if len(piece) == 1 else -float(rank))  # single characters last
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in dict(block_count=1, context_length=64, embedding_length=8).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_feed_forward_length(8)
    writer.add_head_count(2)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_files_tokenize_as_transformers_does(tmp_path):
    """Llama 2 / Mistral files store no merges: they follow from the scores. Text outside the
    pieces (accents, CJK, emoji) falls back to byte tokens."""
    path = _sentencepiece_file(tmp_path / "spm.gguf", add_space_prefix=True)
    corpus = (*CORPUS, "</s>hi<s> there", "  two  spaces")
    ours, theirs = _pair(path)
    for text in corpus:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("hi")[0] == 1  # bos added, SentencePiece's default
    byte_ids = ours.encode("日", add_special_tokens=False)
    assert [ours.backend.id_to_token(i) for i in byte_ids][-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert ours.decode(byte_ids) == "日"


def test_sentencepiece_without_a_space_prefix_adds_none(tmp_path):
    """`add_space_prefix: false` is honoured, as llama.cpp does (transformers' GGUF reader
    prepends the space regardless, so it is no oracle here)."""
    with_prefix = Tokenizer.from_pretrained(_sentencepiece_file(tmp_path / "a.gguf", True))
    without = Tokenizer.from_pretrained(_sentencepiece_file(tmp_path / "b.gguf", False))
    first = [
        t.backend.id_to_token(t.encode("Hello world", False)[0]) for t in (with_prefix, without)
    ]
    assert first[0].startswith("\u2581") and not first[1].startswith("\u2581")
    assert without.decode(without.encode(" Hello world", False)) == " Hello world"
    assert with_prefix.decode(with_prefix.encode("Hello world", False)) == "Hello world"
