"""The tokenizer in a GGUF file's metadata. The oracle is transformers reading the same file, for
SmolLM2's file and for files written here (byte-level BPE with several pre-tokenizers,
SentencePiece BPE); where transformers departs from llama.cpp (SmolLM2's digit rule, llama.cpp's
"default" split, SentencePiece's space prefix) the test says so and pins llama.cpp's behaviour.
What cannot be built is refused by name."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers
from tokenizers import pre_tokenizers

from engine.gguf_tokenizer import tokenizer_from_gguf
from engine.models.catalog import resolve_model
from engine.models.default_model import CHAT_TEMPLATE, build_tokenizer, ensure_default_model
from engine.testing.gguf_writer import save, write_gguf
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
# Numbers after spaces: the digit rule decides what the spaces merge with.
NUMERALS = (
    "x  2024",
    " ²³",
    " ½ cup",
    "x ①②③",
    " ٣٤٥",
    " \uff12\uff10\uff12\uff14",
)  # the last: fullwidth 2024


def _pair(path: Path) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, theirs


def _check_same(
    pair: tuple[Tokenizer, transformers.PreTrainedTokenizerBase],
    corpus: tuple[str, ...],
    chat: bool = True,
) -> None:
    ours, theirs = pair
    for text in corpus:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                expected = theirs.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected, (text, skip)
    if chat:
        expected = theirs.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=True
        )
        assert ours.apply_chat_template(CONVERSATION) == expected
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.bos_token_id == theirs.bos_token_id


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(text, False)]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def smollm2_pair(smollm2) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    """Ours and transformers' for SmolLM2's file, read once (transformers takes seconds)."""
    return _pair(smollm2)


def test_smollm2_tokenizes_as_transformers_does(smollm2_pair):
    specials = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b")
    _check_same(smollm2_pair, CORPUS + specials)
    ours = smollm2_pair[0]  # Tokenizer.from_pretrained: tokenizer_from_gguf for a .gguf file
    assert ours.encode("<|im_end|>") == [2] and ours.decode([2]) == ""
    assert ours.eos_token_ids == (2,)
    assert ours.bos_token_id == 1 and ours.encode("hi")[0] != 1  # add_bos_token is false


def test_smollm2_splits_numbers_as_llama_cpp_does(smollm2_pair):
    """llama.cpp's "smollm" (and SmolLM2's own tokenizer.json: Digits(individual_digits) then
    ByteLevel) makes every number character a word; transformers' GGUF reader does not know the
    rule. Most text comes out the same (the vocabulary has no token with a digit and anything
    else), but not a number after two spaces, nor other numerals after one: there the space
    before the number is a word with it, and merges with the spaces or bytes next to it."""
    ours, theirs = smollm2_pair
    original = copy.deepcopy(theirs.backend_tokenizer)
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in NUMERALS + CORPUS:
        assert ours.encode(text, False) == original.encode(text, add_special_tokens=False).ids
    differ = [
        t for t in NUMERALS if ours.encode(t, False) != theirs.encode(t, add_special_tokens=False)
    ]
    assert differ == ["x  2024", " ²³", " ½ cup", "x ①②③", " ٣٤٥"]
    assert _pieces(ours, "x  2024") == ["x", "ĠĠ", "2", "0", "2", "4"]
    assert theirs.tokenize("x  2024") == ["x", "Ġ", "Ġ", "2", "0", "2", "4"]
    assert _pieces(ours, " ²³")[0] == "Ġ"  # the space alone; transformers: "ĠÂ", "²", ...
    assert [ours.decode([i]) for i in ours.encode("2024", False)] == ["2", "0", "2", "4"]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_gguf")
    source = ensure_default_model()
    return {
        pre: write_gguf(source, root / f"tiny-{pre}.gguf", "F32", pre)
        for pre in ("gpt-2", "default", "qwen2", "llama-bpe", "smollm")
    }


# The tiny vocabulary has no <|endoftext|>; transformers' GPT-2 class adds one of its own, so a
# text with it is left out here (SmolLM2's test covers control tokens in text).
TINY_SPECIALS = ("<|user|>\nhi</s>\n<|assistant|>\n", "<think>why</think> so")


# Not "smollm" (above) nor "default": transformers splits those GPT-2's way, llama.cpp does not.
@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe"])
def test_written_files_tokenize_as_transformers_does(tiny_files, pre):
    _check_same(_pair(tiny_files[pre]), CORPUS + NUMERALS + TINY_SPECIALS)


def test_a_written_file_round_trips_the_source_tokenizer(tiny_files):
    """The tiny tokenizer.json is GPT-2-style byte-level BPE with bos added; so is its GGUF."""
    source = Tokenizer.from_pretrained(ensure_default_model())
    ours = Tokenizer.from_pretrained(tiny_files["gpt-2"])
    for text in CORPUS + TINY_SPECIALS:
        assert ours.encode(text) == source.encode(text)
        assert ours.encode(text)[:1] == [source.bos_token_id]
    assert ours.all_special_ids == source.all_special_ids
    # <think> is user-defined: matched whole, kept when special tokens are skipped.
    think = ours.encode("<think>", add_special_tokens=False)
    assert len(think) == 1 and ours.decode(think) == "<think>"


# Words before BPE (in the byte alphabet, where Ġ is a space), as llama.cpp cuts them.
SPLITS = {
    "gpt-2": ["x", "Ġ12345", "Ġ(", "a", ")!!", "ĠI", "'m"],
    # llama.cpp's fallback: punctuation runs apart (the quote too), ASCII digits in threes.
    "default": ["x", "Ġ", "123", "45", "Ġ", "(", "a", ")!!", "ĠI", "'", "m"],
    "qwen2": ["x", "Ġ", "1", "2", "3", "4", "5", "Ġ(", "a", ")!!", "ĠI", "'m"],
    "llama-bpe": ["x", "Ġ", "123", "45", "Ġ(", "a", ")!!", "ĠI", "'m"],
    "smollm": ["x", "Ġ", "1", "2", "3", "4", "5", "Ġ(", "a", ")!!", "ĠI", "'m"],
}


@pytest.mark.parametrize("pre", sorted(SPLITS))
def test_pre_tokenizers_split_as_llama_cpp_does(tiny_files, pre):
    tokenizer = Tokenizer.from_pretrained(tiny_files[pre])
    words = tokenizer.backend.pre_tokenizer.pre_tokenize_str("x 12345 (a)!! I'm")
    assert [word for word, _ in words] == SPLITS[pre]


def _tokenizer_file(
    path: Path, model: str, pre: str, configure: Callable[[gguf.GGUFWriter], None] | None = None
) -> Path:
    """A GGUF with a three-token vocabulary (a, b, ab) and whatever `configure` adds."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    if configure is None:
        writer.add_token_list(["a", "b", "ab"])
        writer.add_token_types([1, 1, 1])
    else:
        configure(writer)
    writer.add_token_merges(["a b"])
    writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
    save(writer)
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
    message = str(excinfo.value)
    assert words in message and message.startswith("t.gguf: ") and "\n" not in message
    assert str(tmp_path) not in message  # the file's name, never where it lives


def test_a_minimal_file_tokenizes(tmp_path):
    path = _tokenizer_file(tmp_path / "t.gguf", "gpt2", "gpt-2")
    tokenizer = tokenizer_from_gguf(path)
    assert tokenizer.encode("abab") == [2, 2]
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_ids == ()
    assert Tokenizer.from_pretrained(path).encode("abab") == [2, 2]


def _with_specials(writer: gguf.GGUFWriter) -> None:
    writer.add_token_list(["a", "b", "ab", "<s>", "</s>", "<eot>"])
    writer.add_token_types([1, 1, 1, 3, 3, 3])
    writer.add_bos_token_id(3)
    writer.add_eos_token_id(4)
    writer.add_eot_token_id(5)
    writer.add_add_eos_token(True)


def test_special_ids_and_flags_come_from_the_file(tmp_path):
    """Llama 3's pre-tokenizer adds bos unless the file says otherwise (llama.cpp's default);
    add_eos_token is the file's; generation also ends at the end-of-turn token."""
    llama3 = tokenizer_from_gguf(
        _tokenizer_file(tmp_path / "l.gguf", "gpt2", "llama-bpe", _with_specials)
    )
    assert llama3.encode("ab") == [3, 2, 4]
    assert llama3.encode("ab", add_special_tokens=False) == [2]
    assert llama3.eos_token_ids == (4, 5) and llama3.all_special_ids == [3, 4, 5]
    gpt2 = tokenizer_from_gguf(
        _tokenizer_file(tmp_path / "g.gguf", "gpt2", "gpt-2", _with_specials)
    )
    assert gpt2.encode("<s>ab<eot>") == [3, 2, 5, 4]  # no bos by default; specials matched whole
    assert gpt2.decode([3, 2, 5, 4]) == "ab"


def _sentencepiece_file(path: Path, add_space_prefix: bool) -> Path:
    """A SentencePiece-style GGUF (Llama 2 / Mistral): special and byte tokens, then pieces with
    U+2581 for spaces and scores in merge order, taken from the tiny tokenizer's merges."""
    spec = json.loads(build_tokenizer().to_str())
    tokens = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<think>"]
    types = [2, 3, 3, 3, 3, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
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
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    save(writer)
    return path


@pytest.fixture(scope="module")
def sentencepiece_file(tmp_path_factory) -> Path:
    return _sentencepiece_file(tmp_path_factory.mktemp("spm") / "spm.gguf", True)


def test_sentencepiece_files_tokenize_as_transformers_does(sentencepiece_file):
    """Llama 2 / Mistral files store no merges: they follow from the scores. Text outside the
    pieces (accents, CJK, emoji) falls back to byte tokens. Only text that starts with no space
    and follows no special token here: see the next test for the rest."""
    corpus = (*(t.lstrip() for t in CORPUS), "hi</s>", "<unk>")
    _check_same(_pair(sentencepiece_file), corpus, chat=False)
    ours = Tokenizer.from_pretrained(sentencepiece_file)
    assert ours.encode("hi")[0] == 1  # bos added, SentencePiece's default
    assert ours.encode("<unk>", False) == [0]
    byte_ids = ours.encode("日", add_special_tokens=False)
    assert [ours.backend.id_to_token(i) for i in byte_ids][-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert ours.decode(byte_ids) == "日"


def test_sentencepiece_prefixes_a_space_as_llama_cpp_does(sentencepiece_file):
    """llama.cpp (and sentencepiece, and Llama 2's tokenizer.json) puts U+2581 before every
    stretch of text: at the start even when it begins with a space, and after each special
    token. transformers' GGUF reader uses Metaspace("first"), which does neither."""
    ours, theirs = _pair(sentencepiece_file)
    space = "\u2581"
    assert _pieces(ours, " hi") == [space * 2, "hi"]
    assert theirs.tokenize(" hi") == [space + "h", "i"]
    assert _pieces(ours, "</s>hi") == ["</s>", space + "h", "i"]
    assert theirs.tokenize("</s>hi") == ["</s>", "hi"]
    assert _pieces(ours, "<|user|>\nhi") == ["<|user|>", space, "<0x0A>", "hi"]
    assert _pieces(ours, "a <think> b") == [space + "a", space, "<think>", space * 2, "b"]
    for text in (*CORPUS, "</s>hi<s> there", "  two  spaces", "a <think> b"):
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    rendered = ours.apply_chat_template(CONVERSATION)
    assert rendered == theirs.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )


def test_sentencepiece_without_a_space_prefix_adds_none(tmp_path, sentencepiece_file):
    """`add_space_prefix: false` is honoured, as llama.cpp does (transformers' GGUF reader
    prepends the space regardless, so it is no oracle here)."""
    with_prefix = Tokenizer.from_pretrained(sentencepiece_file)
    without = Tokenizer.from_pretrained(_sentencepiece_file(tmp_path / "b.gguf", False))
    first = [_pieces(t, "Hello world")[0] for t in (with_prefix, without)]
    assert first[0].startswith("\u2581") and not first[1].startswith("\u2581")
    assert _pieces(without, "</s>hi") == ["</s>", "hi"]
    assert without.decode(without.encode(" Hello world", False)) == " Hello world"
    assert with_prefix.decode(with_prefix.encode("Hello world", False)) == "Hello world"
