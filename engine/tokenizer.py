"""Tokenizer: a Hugging Face `tokenizers` wrapper, chat templates, and streaming detokenization.

Only the `tokenizers` library and jinja2 are used (transformers is a test-only dependency), but
the behaviour follows transformers' fast tokenizers so that token ids agree with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.models.catalog import is_gguf_path
from engine.stop_strings import StopStrings

# How many prompt tokens the detokenizer decodes before the first output token. Tokenizers such as
# sentencepiece's Metaspace drop a leading space at the start of a decode, so the first output
# token needs some left context to come out as it would inside the full text.
INITIAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class TokenizerConfig:
    """What `tokenizer_config.json` (and the model's eos ids) say about special tokens."""

    bos_token: str | None = None
    eos_token: str | None = None
    # None: not set, so the post-processor in tokenizer.json decides (as in transformers).
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None
    # From generation_config.json, else config.json; a model may stop on several ids.
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(self, backend: HFTokenizer, config: TokenizerConfig, name: str = "") -> None:
        self._backend = backend
        self._config = config
        self._name = name or "tokenizer"

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and the configs beside it from a model directory, or the
        tokenizer in a GGUF file's metadata."""
        if is_gguf_path(path):
            from engine.gguf_tokenizer import tokenizer_from_gguf

            return tokenizer_from_gguf(path)
        directory = Path(path).expanduser()
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json in {directory} (looked for {tokenizer_file})")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the library raises a bare Exception on a malformed file
            raise ValueError(f"cannot load {tokenizer_file}: {err}") from err
        # The directory's name, not its path: messages may reach clients.
        return cls(backend, _read_config(directory), name=directory.name)

    @property
    def backend(self) -> HFTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's vocab may be padded beyond)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        if self._config.bos_token is not None:
            token_id = self.token_id(self._config.bos_token)
            if token_id is not None:
                return token_id
        return self._config.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        if self._config.eos_token is not None:
            token_id = self.token_id(self._config.eos_token)
            if token_id is not None:
                return token_id
        return self._config.eos_token_ids[0] if self._config.eos_token_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the eos token plus the generation config's ids."""
        primary = self.eos_token_id
        ids = ([primary] if primary is not None else []) + list(self._config.eos_token_ids)
        return tuple(dict.fromkeys(ids))

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids that `decode(skip_special_tokens=True)` drops, plus bos and eos."""
        added = self._backend.get_added_tokens_decoder()
        ids = {token_id for token_id, token in added.items() if token.special}
        ids.update(i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        return sorted(ids)

    def token_id(self, token: str) -> int | None:
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised.

        With `add_special_tokens`, bos/eos are added as transformers does: by the
        `add_bos_token`/`add_eos_token` flags when the config sets either, else by the
        post-processor in tokenizer.json.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        config = self._config
        if config.add_bos_token is None and config.add_eos_token is None:
            return self._encode(text, add_special_tokens)
        ids = self._encode(text, add_special_tokens=False)
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if config.add_bos_token and bos is not None:
                ids.insert(0, bos)
            if config.add_eos_token and eos is not None:
                ids.append(eos)
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            # encode_batch, not encode: it releases the GIL while it works, so a long prompt
            # tokenized in a worker thread does not stall the caller's event loop.
            (encoding,) = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(encoding.ids)
        except TypeError as err:
            # A lone surrogate (JSON "\ud800" decodes to one) has no UTF-8 form; tokenizers then
            # raises "TextInputSequence must be str".
            raise ValueError("text is not valid Unicode (it contains a lone surrogate)") from err

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` ({role, content} dicts) with the model's jinja chat template.

        The result usually starts with the bos token already, so encode it with
        `add_special_tokens=False`. Extra keyword arguments become template variables
        (e.g. `enable_thinking` for Qwen3 templates).
        """
        _check_messages(messages)
        template = self._compiled_chat_template
        context = {
            **template_kwargs,
            "messages": [dict(message) for message in messages],
            "bos_token": self._config.bos_token or "",
            "eos_token": self._config.eos_token or "",
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except (jinja2.TemplateError, TypeError) as err:  # TypeError: e.g. str + int in there
            raise ValueError(f"chat template of {self._name} failed: {err}") from err

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        source = self._config.chat_template
        if not source:
            raise ValueError(f"{self._name} has no chat template")
        # The settings transformers uses, so templates written for it render the same here.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = _strftime_now  # Llama 3.x templates print today's date
        env.filters["tojson"] = _tojson
        try:
            return env.from_string(source)
        except jinja2.TemplateError as err:
            raise ValueError(f"chat template of {self._name} does not compile: {err}") from err


def _raise_template_error(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    # transformers' tojson keeps non-ASCII text as is; jinja's default escapes it.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}] needs a str {key!r}, got {message.get(key)!r}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(value: object) -> str | None:
    """A special token written as a string or as an AddedToken object ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _int_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def _chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    # Recent transformers save the template beside the config; it then takes precedence.
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _optional_bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _read_config(directory: Path) -> TokenizerConfig:
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    generation_config = _read_json(directory / "generation_config.json")
    model_config = _read_json(directory / "config.json")
    eos_ids = _int_ids(generation_config.get("eos_token_id")) or _int_ids(
        model_config.get("eos_token_id")
    )
    bos_ids = _int_ids(generation_config.get("bos_token_id")) or _int_ids(
        model_config.get("bos_token_id")
    )
    return TokenizerConfig(
        bos_token=_token_content(tokenizer_config.get("bos_token")),
        eos_token=_token_content(tokenizer_config.get("eos_token")),
        add_bos_token=_optional_bool(tokenizer_config.get("add_bos_token")),
        add_eos_token=_optional_bool(tokenizer_config.get("add_eos_token")),
        chat_template=_chat_template(directory, tokenizer_config),
        eos_token_ids=eos_ids,
        bos_token_id=bos_ids[0] if bos_ids else None,
    )


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas as they arrive; applies stop strings.

    Tokens: a multi-byte character may span several byte-level tokens, so text is decoded over a
    small window `ids[prefix_offset:]` of recent tokens, and only what follows the text of
    `ids[prefix_offset:read_offset]` is new. A window whose text ends in U+FFFD (an incomplete
    character) waits for the next token. Each update decodes a few tokens, however long the
    output is:

        prefix_offset = 7, read_offset = 9, len(ids) = 11
        delta = decode(ids[7:11])[len(decode(ids[7:9])):]  ->  prefix_offset, read_offset = 9, 11

    Text: without `include_stop_str_in_output`, a suffix that could begin a stop string is held
    back until the next delta shows whether it does (at most len(longest stop) - 1 characters).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = StopStrings(stop)
        self._include_stop = include_stop_str_in_output
        self._tail_len = max(self._stops.max_len, 1) - 1
        context = self._prompt_context(prompt_token_ids)
        self._token_ids = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        # The last `_tail_len` characters of text, of which the last `_num_pending` are held back.
        self._tail = ""
        self._num_pending = 0
        self._chunks: list[str] = []
        self._done = False
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context :]

    @property
    def finished(self) -> bool:
        return self._done or self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Append sampled ids; return the text they finalize ("" once a stop string matched).

        Pass `finished=True` with the last ids (or none) when the request ends for another
        reason (eos, length): it releases held-back text and a trailing incomplete character.
        """
        if self.finished:
            return ""
        self._token_ids.extend(new_token_ids)
        new_text = self._decode_new_text(flush=finished)
        delta = self._apply_stop_strings(new_text, flush=finished) if self._stops else new_text
        self._done = finished
        if delta:
            self._chunks.append(delta)
        return delta

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context = list(prompt_token_ids[-INITIAL_DETOKENIZATION_OFFSET:])
        # A prompt cut inside a character would glue its dangling bytes to the first output
        # character; the output must decode on its own, so drop such a context.
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self, flush: bool) -> str:
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""  # an incomplete character: the next token may complete it
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full_text[len(prefix_text) :]

    def _apply_stop_strings(self, new_text: str, flush: bool) -> str:
        window = self._tail + new_text
        emitted_end = len(self._tail) - self._num_pending
        match = self._stops.find(window, new_from=len(self._tail))
        if match is not None:
            stop, start = match
            self.stop_reason = stop
            return window[emitted_end : start + len(stop) if self._include_stop else start]
        held = 0
        if not (flush or self._include_stop):
            held = self._stops.prefix_len(window, self._tail_len)
        release_end = max(emitted_end, len(window) - held)
        self._num_pending = len(window) - release_end
        self._tail = window[-self._tail_len :] if self._tail_len else ""
        return window[emitted_end:release_end]
