"""Tokenizer (encode/decode, special tokens, chat template) and IncrementalDetokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.models.default_model import make_default_model
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

BOS, EOS, SYSTEM, USER, ASSISTANT, THINK, END_THINK = range(7)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
]
UNICODE_TEXTS = [
    "Hello, world!",
    "naïve café — déjà vu",
    "日本語のテキストと中文字符",
    "emoji 🎉🚀 family 👩‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "Привет, мир! 안녕하세요 مرحبا שלום",
    "  spaces\ttabs\r\nnewlines\n\n\u00a0nbsp \u200bzero-width",
    "\x00\x01 control \x7f and \ufffd replacement char",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_default_model(tmp_path_factory.mktemp("default") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def tokenizer_dir(
    tmp_path: Path,
    model_dir: Path,
    tokenizer_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """A directory with the default tokenizer.json and the given configs only."""
    directory = tmp_path / "tok"
    directory.mkdir()
    shutil.copy(model_dir / "tokenizer.json", directory / "tokenizer.json")
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


def feed(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1, finish: bool = True
) -> list[str]:
    deltas = [detok.update(list(ids[i : i + chunk])) for i in range(0, len(ids), chunk)]
    if finish:
        deltas.append(detok.update([], finished=True))
    return deltas


# --- Tokenizer --------------------------------------------------------------------------------


def test_properties(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS, EOS)
    assert tokenizer.eos_token_ids == (EOS,)
    assert tokenizer.all_special_ids == [BOS, EOS, SYSTEM, USER, ASSISTANT]
    assert tokenizer.token_id("<think>") == THINK
    assert tokenizer.token_id("</think>") == END_THINK
    assert tokenizer.token_id("<|user|>") == USER
    assert tokenizer.token_id("no such token") is None


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=60))
def test_round_trip_any_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_bos_is_prepended_only_with_special_tokens(tokenizer: Tokenizer) -> None:
    plain = tokenizer.encode("Hello world", add_special_tokens=False)
    assert plain and plain[0] != BOS
    assert tokenizer.encode("Hello world") == [BOS, *plain]
    assert tokenizer.encode("") == [BOS]
    assert tokenizer.encode("", add_special_tokens=False) == []


def test_add_bos_and_eos_flags_follow_config(tmp_path: Path, model_dir: Path) -> None:
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": True,
    }
    tok = Tokenizer.from_pretrained(tokenizer_dir(tmp_path, model_dir, config))
    plain = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == [*plain, EOS]


def test_without_flags_the_post_processor_decides(tmp_path: Path, model_dir: Path) -> None:
    # As in transformers: no add_bos_token in the config -> tokenizer.json's post-processor.
    tok = Tokenizer.from_pretrained(tokenizer_dir(tmp_path, model_dir, {"bos_token": "<s>"}))
    assert tok.encode("hi")[0] == BOS
    assert tok.encode("hi", add_special_tokens=False)[0] != BOS


def test_token_objects_and_generation_config_eos(tmp_path: Path, model_dir: Path) -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
    }
    generation = {"eos_token_id": [EOS, END_THINK]}
    tok = Tokenizer.from_pretrained(tokenizer_dir(tmp_path, model_dir, config, generation))
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS, EOS)
    assert tok.eos_token_ids == (EOS, END_THINK)


def test_eos_from_generation_config_alone(tmp_path: Path, model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tokenizer_dir(tmp_path, model_dir, {}, {"eos_token_id": 1}))
    assert tok.eos_token_id == EOS
    assert tok.bos_token_id is None


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    text = "<s><|user|>\nHi</s>\n<|assistant|>\n<think>hmm</think>Hello"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for special in (BOS, USER, EOS, ASSISTANT, THINK, END_THINK):
        assert special in ids  # written special tokens are recognised, not split into bytes
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # <think> tokens are not special: a reasoning parser must still see them.
    assert tokenizer.decode(ids) == "\nHi\n\n<think>hmm</think>Hello"


def test_encode_rejects_non_text(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="str"):
        tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="surrogate"):
        tokenizer.encode(json.loads('"a\\ud800b"'))


# --- chat template ----------------------------------------------------------------------------


def test_chat_template_three_messages(tokenizer: Tokenizer) -> None:
    expected = (
        "<s><|system|>\nYou are terse.</s>\n<|user|>\nWhat is 2 + 2?</s>\n<|assistant|>\n4</s>\n"
    )
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False) == expected
    assert tokenizer.apply_chat_template(CONVERSATION) == expected + "<|assistant|>\n"


def test_chat_prompt_tokenizes_with_special_tokens(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(CONVERSATION[1:2])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [BOS, USER]
    assert ids[-2:] == [ASSISTANT, tokenizer.encode("\n", add_special_tokens=False)[0]]


def test_chat_template_rejects_unknown_role(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="role must be system, user or assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        {"role": "user", "content": "hi"},
        [("user", "hi")],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": ["part"]}],
        [{"role": 3, "content": "hi"}],
    ],
)
def test_chat_template_rejects_malformed_messages(tokenizer: Tokenizer, messages: Any) -> None:
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template(messages)


def test_no_chat_template(tmp_path: Path, model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tokenizer_dir(tmp_path, model_dir, {"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_named_templates_and_template_file(tmp_path: Path, model_dir: Path) -> None:
    templates = [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]
    directory = tokenizer_dir(tmp_path, model_dir, {"chat_template": templates})
    assert Tokenizer.from_pretrained(directory).apply_chat_template(CONVERSATION) == (
        "You are terse.!"
    )
    # chat_template.jinja beside the config wins, as in recent transformers.
    (directory / "chat_template.jinja").write_text("{{ extra }}-{{ messages | length }}")
    tok = Tokenizer.from_pretrained(directory)
    assert tok.apply_chat_template(CONVERSATION, extra="x") == "x-3"


def test_broken_template_is_a_value_error(tmp_path: Path, model_dir: Path) -> None:
    directory = tokenizer_dir(tmp_path, model_dir, {"chat_template": "{% for %}"})
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_pretrained(directory).apply_chat_template(CONVERSATION)


# --- loading errors ---------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=str(tmp_path)):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path / "does-not-exist")


def test_malformed_files(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path)
    directory = tokenizer_dir(tmp_path, model_dir)
    (directory / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        Tokenizer.from_pretrained(directory)


# --- IncrementalDetokenizer: streaming --------------------------------------------------------


@pytest.mark.parametrize("text", UNICODE_TEXTS[1:5])
def test_multibyte_characters_never_split(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # characters span tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"))
    deltas = feed(detok, ids, finish=False)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == detok.output_text == text
    assert detok.output_token_ids == ids


def test_special_tokens_in_output(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), EOS]
    skipping = IncrementalDetokenizer(tokenizer, [BOS])
    keeping = IncrementalDetokenizer(tokenizer, [BOS], skip_special_tokens=False)
    assert "".join(feed(skipping, ids)) == "Hi"
    assert "".join(feed(keeping, ids)) == "Hi</s>"


def test_prompt_cut_inside_a_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🎉b", add_special_tokens=False)
    cut = 2  # "a" and the first byte of the emoji
    assert tokenizer.decode(ids[:cut]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, ids[:cut])
    assert "".join(feed(detok, ids[cut:])) == tokenizer.decode(ids[cut:])


def test_decode_window_stays_small(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cost per token is O(1): no decode call sees more than a few tokens, however long."""
    ids = tokenizer.encode("日本 🎉 text " * 100, add_special_tokens=False)
    sizes: list[int] = []
    decode = tokenizer.decode

    def counting_decode(token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        sizes.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("a prompt of some length"))
    feed(detok, ids)
    assert len(ids) > 500
    assert max(sizes) <= 12
    assert detok.output_text == "日本 🎉 text " * 100


# --- IncrementalDetokenizer: stop strings -----------------------------------------------------

ANSWER = "The answer is 42. Done!"  # The| an|sw|er| is| 42|.| |D|one|!


def stream(
    tokenizer: Tokenizer, text: str, stop: Sequence[str], include: bool = False
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, [BOS], stop=stop, include_stop_str_in_output=include)
    deltas = feed(detok, tokenizer.encode(text, add_special_tokens=False))
    assert "".join(deltas) == detok.output_text
    return deltas, detok


def test_stop_string_single_token(tokenizer: Tokenizer) -> None:
    assert tokenizer.token_id("Ġ42") is not None  # " 42" is one token
    deltas, detok = stream(tokenizer, ANSWER, [" 42"])
    assert detok.output_text == "The answer is"
    assert detok.stop_reason == " 42"
    assert detok.finished
    assert detok.update(tokenizer.encode(" more", add_special_tokens=False)) == ""
    assert detok.output_text == "The answer is"


def test_stop_string_straddling_tokens(tokenizer: Tokenizer) -> None:
    _, detok = stream(tokenizer, ANSWER, ["swer is"])  # sw|er| is
    assert (detok.output_text, detok.stop_reason) == ("The an", "swer is")
    # Inside one multi-byte character and across characters: 🎉 is four byte tokens.
    _, detok = stream(tokenizer, "café 🎉 done", ["é 🎉"])
    assert (detok.output_text, detok.stop_reason) == ("caf", "é 🎉")


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    _, detok = stream(tokenizer, ANSWER, ["42."], include=True)
    assert (detok.output_text, detok.stop_reason) == ("The answer is 42.", "42.")


def test_first_stop_to_complete_wins(tokenizer: Tokenizer) -> None:
    for stops in (["Done", "is 4", "answer"], ["answer", "is 4", "Done"]):
        _, detok = stream(tokenizer, ANSWER, stops)
        assert (detok.output_text, detok.stop_reason) == ("The ", "answer")
    # "is" completes before "answer is 42" does, though the latter starts earlier.
    _, detok = stream(tokenizer, ANSWER, ["answer is 42", " is"])
    assert (detok.output_text, detok.stop_reason) == ("The answer", " is")
    # Same end: the one starting first (the longer one) wins.
    _, detok = stream(tokenizer, ANSWER, ["s 42", "is 42"])
    assert (detok.output_text, detok.stop_reason) == ("The answer ", "is 42")


def test_stop_at_the_very_first_token(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], stop=["The"])
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert detok.update(ids[:1]) == ""
    assert (detok.output_text, detok.stop_reason) == ("", "The")
    assert detok.update(ids[1:], finished=True) == ""


def test_possible_stop_prefix_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    deltas, detok = stream(tokenizer, ANSWER, ["42!"])
    # " 42" could begin "42!": "42" waits for "." to show it does not.
    assert deltas[:7] == ["The", " an", "sw", "er", " is", " ", "42."]
    assert detok.output_text == ANSWER and detok.stop_reason is None


def test_finishing_releases_held_text(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [BOS], stop=["Done!!"])
    deltas = feed(detok, tokenizer.encode(ANSWER, add_special_tokens=False), finish=False)
    assert "".join(deltas) == "The answer is 42. "
    assert detok.update([], finished=True) == "Done!"
    assert detok.output_text == ANSWER and detok.finished
    assert detok.update([EOS]) == ""


@pytest.mark.parametrize("stop", ["STOP", [""], [None], ["ok", 3]])
def test_bad_stop_strings(tokenizer: Tokenizer, stop: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [], stop=stop)


# --- IncrementalDetokenizer: properties -------------------------------------------------------

MULTIBYTE = st.sampled_from("世界你好日本語🎉🚀👩‍👧🇫🇷éß—€\n \t<s>|")
TEXT = st.text(alphabet=st.one_of(st.characters(codec="utf-8"), MULTIBYTE), max_size=40)


def draw_output_ids(data: st.DataObject, tokenizer: Tokenizer) -> list[int]:
    """Random ids (any byte soup, specials included) or the ids of random unicode text."""
    if data.draw(st.booleans(), label="random ids"):
        return data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    return tokenizer.encode(data.draw(TEXT), add_special_tokens=False)


def draw_chunks(data: st.DataObject, ids: list[int]) -> list[list[int]]:
    """`ids` split into consecutive chunks of 1 to 5 ids (several tokens per step)."""
    out: list[list[int]] = []
    i = 0
    while i < len(ids):
        size = data.draw(st.integers(1, 5))
        out.append(ids[i : i + size])
        i += size
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_deltas_concatenate_to_full_decode(tokenizer: Tokenizer, data: st.DataObject) -> None:
    ids = draw_output_ids(data, tokenizer)
    prompt = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=8))
    skip = data.draw(st.booleans())
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas: list[str] = []
    for chunk in draw_chunks(data, ids):
        deltas.append(detok.update(chunk))
        assert expected.startswith("".join(deltas))
        if "\ufffd" not in expected:
            assert "\ufffd" not in deltas[-1]
    deltas.append(detok.update([], finished=True))
    assert "".join(deltas) == detok.output_text == expected
    assert detok.stop_reason is None


def reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Where a stop string cuts the whole text: the match that completes first."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    end, start, stop = min(matches)
    return text[: end if include else start], stop


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=TEXT, include=st.booleans())
def test_streamed_stops_match_one_shot(
    tokenizer: Tokenizer, data: st.DataObject, text: str, include: bool
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    stop = TEXT.filter(bool)
    if full:  # mostly stops that do occur, some of them straddling tokens
        starts = st.integers(0, len(full) - 1)
        stop = starts.flatmap(lambda i: st.integers(1, 6).map(lambda n: full[i : i + n])) | stop
    stops = data.draw(st.lists(stop, max_size=3))
    detok = IncrementalDetokenizer(tokenizer, [BOS], stop=stops, include_stop_str_in_output=include)
    deltas = [detok.update(chunk) for chunk in draw_chunks(data, ids)]
    deltas.append(detok.update([], finished=True))
    assert "".join(deltas) == detok.output_text
    assert (detok.output_text, detok.stop_reason) == reference_stop(full, stops, include)
