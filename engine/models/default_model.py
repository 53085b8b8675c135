"""The built-in default model: a tiny Llama generated from a seed, written in Hugging Face format.

It lets `pdserve serve` and the tests run with no model hub: the same loader that reads real
checkpoints reads this one. Everything is a pure function of the seed and the corpus below, so two
machines that build it get the same tensors and the same tokenizer.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import shutil
import tempfile
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.cache_dir import exclusive_lock, pdserve_cache_dir
from engine.models.default_corpus import CORPUS as _CORPUS

DEFAULT_SEED = 0
# Bump the suffix whenever the generated files change, so old caches are not reused.
DEFAULT_MODEL_DIRNAME = "default-model-v1"
MARKER_FILE = "pdserve_default_model.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# Ids 0..4 in this order; skipped when decoding with skip_special_tokens.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
# Ids 5..6. Not special (as in Qwen3): a reasoning parser must still see them in decoded text.
THINK_TOKENS = ("<think>", "</think>")
TARGET_VOCAB_SIZE = 2048

HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 768
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = 32
INIT_STD = 0.02

# Renders system/user/assistant turns as `<|role|>\n{content}</s>\n`, after one bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def default_model_path() -> Path:
    """Where `ensure_default_model` keeps the default model: `$PDSERVE_CACHE_DIR` or ~/.cache."""
    return pdserve_cache_dir() / DEFAULT_MODEL_DIRNAME


def ensure_default_model() -> Path:
    """The default model's directory, built on first use (a cache hit only checks file sizes)."""
    path = default_model_path()
    if is_complete_default_model(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time: without the lock, a process repairing a broken cache could remove
    # the model another process has just published.
    with exclusive_lock(path.with_name(f".{path.name}.lock")):
        if is_complete_default_model(path):
            return path  # built by another process while we waited
        if path.exists():  # left incomplete (files deleted by hand); the cache is ours
            _discard(path)
        return make_default_model(path, seed=DEFAULT_SEED)


def make_default_model(path: str | Path, seed: int = DEFAULT_SEED) -> Path:
    """Write the default model for `seed` to `path` atomically and return `path`.

    The files are written to a temporary sibling directory that is renamed into place, so a
    concurrent builder (another process) either wins the rename or finds a complete model.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    target = Path(path).expanduser()
    if _existing_model_seed(target) == seed:
        return target
    if target.exists() and not _is_empty_dir(target):
        raise FileExistsError(_not_our_model(target, seed))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_model_files(tmp, seed)
        _publish(tmp, target, seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_complete_default_model(path: Path) -> bool:
    return _existing_model_seed(path) is not None


def _existing_model_seed(path: Path) -> int | None:
    """The seed recorded in `path`'s marker if every file it lists has its recorded size."""
    try:
        marker = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
        sizes = marker["file_sizes"]
        if set(sizes) != set(MODEL_FILES):
            return None
        if any((path / name).stat().st_size != size for name, size in sizes.items()):
            return None
        return int(marker["seed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _publish(tmp: Path, target: Path, seed: int) -> None:
    try:
        if _is_empty_dir(target):
            target.rmdir()  # rename() replaces an empty directory on POSIX only
        tmp.rename(target)
    except OSError as err:
        # Another process published first; its model is as good as ours if the seed matches.
        if _existing_model_seed(target) != seed:
            raise FileExistsError(_not_our_model(target, seed)) from err


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _not_our_model(target: Path, seed: int) -> str:
    return (
        f"{target} exists and is not the default model for seed {seed}; "
        "remove it or choose another path"
    )


def _discard(path: Path) -> None:
    """Remove `path`, first renaming it aside so a concurrent reader never sees half of it."""
    aside = path.with_name(f".{path.name}.discard-{uuid.uuid4().hex}")
    with contextlib.suppress(FileNotFoundError):
        path.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)


def _write_model_files(directory: Path, seed: int) -> None:
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id = _vocab_id(tokenizer, BOS_TOKEN), _vocab_id(tokenizer, EOS_TOKEN)
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(directory / "tokenizer_config.json", _tokenizer_config())
    _write_json(directory / "config.json", _model_config(vocab_size, bos_id, eos_id))
    _write_json(
        directory / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id}
    )
    _write_weights(directory / "model.safetensors", vocab_size, seed)
    sizes = {name: (directory / name).stat().st_size for name in MODEL_FILES}
    # The marker goes last: its presence with matching sizes means the set is complete.
    _write_json(directory / MARKER_FILE, {"seed": seed, "file_sizes": sizes})
    for name in (*MODEL_FILES, MARKER_FILE):
        _fsync(directory / name)
        (directory / name).chmod(0o644)
    # mkdtemp() makes the directory private (0700); the published model is a read-only cache
    # that other users and containers sharing it must be able to read.
    directory.chmod(0o755)


def _vocab_id(tokenizer: HFTokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"the default tokenizer lacks {token!r}")  # a bug here, not user input
    return int(token_id)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tokenizer_config() -> dict[str, Any]:
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    added = {
        str(i): {"content": token, **flags, "special": token in SPECIAL_TOKENS}
        for i, token in enumerate((*SPECIAL_TOKENS, *THINK_TOKENS))
    }
    return {
        # transformers lists these in all_special_ids only when named here.
        "additional_special_tokens": list(SPECIAL_TOKENS[2:]),
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _model_config(vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": INIT_STD,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def weight_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama parameter names and shapes, in the order they are drawn."""
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.self_attn.q_proj.weight"] = (q_size, HIDDEN_SIZE)
        shapes[f"{layer}.self_attn.k_proj.weight"] = (kv_size, HIDDEN_SIZE)
        shapes[f"{layer}.self_attn.v_proj.weight"] = (kv_size, HIDDEN_SIZE)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (HIDDEN_SIZE, q_size)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (INTERMEDIATE_SIZE, HIDDEN_SIZE)
        shapes[f"{layer}.mlp.up_proj.weight"] = (INTERMEDIATE_SIZE, HIDDEN_SIZE)
        shapes[f"{layer}.mlp.down_proj.weight"] = (HIDDEN_SIZE, INTERMEDIATE_SIZE)
        shapes[f"{layer}.input_layernorm.weight"] = (HIDDEN_SIZE,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (HIDDEN_SIZE,)
    shapes["model.norm.weight"] = (HIDDEN_SIZE,)
    shapes["lm_head.weight"] = (vocab_size, HIDDEN_SIZE)
    return shapes


def _write_weights(path: Path, vocab_size: int, seed: int) -> None:
    # Imported here so that a cache hit in ensure_default_model() never pays for importing torch.
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    for name, shape in weight_shapes(vocab_size).items():
        noise = _portable_normal(generator, shape)
        # Norm weights are 1 + noise rather than exactly 1, so a loader that skips them shows up.
        tensors[name] = (1.0 + noise) if len(shape) == 1 else noise
    save_file(tensors, str(path), metadata={"format": "pt"})


def _portable_normal(generator: Any, shape: tuple[int, ...]) -> Any:
    """Float32 samples of N(0, INIT_STD^2), bit-identical on every CPU.

    torch.randn is not: its AVX2 kernel uses approximate log/sin/cos, so x86 and ARM machines
    draw different bits. Uniform draws are exact, and the Irwin-Hall sum of 12 uniforms minus 6
    (mean 0, variance 1) needs only additions, which IEEE 754 rounds the same everywhere.
    """
    import torch

    numel = 1
    for dim in shape:
        numel *= dim
    uniforms = torch.rand((12, numel), generator=generator, dtype=torch.float64)
    total = uniforms[0].clone()
    for row in uniforms[1:]:  # a fixed left-to-right order; torch.sum may reorder
        total += row
    return ((total - 6.0) * INIT_STD).to(torch.float32).reshape(shape)


def build_tokenizer() -> HFTokenizer:
    """The byte-level BPE tokenizer, trained on the embedded corpus by `_train_bpe`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in byte_level.pre_tokenize_str(_CORPUS))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *THINK_TOKENS, *alphabet))}
    merges = _train_bpe(words, TARGET_VOCAB_SIZE - len(vocab))
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tokenizer


def _train_bpe(words: Counter[str], max_merges: int) -> list[tuple[str, str]]:
    """Byte-pair merges learnt from `words` (piece -> count).

    Our own loop rather than tokenizers' BpeTrainer so the result cannot change with the library
    version: the most frequent pair wins, ties go to the smallest pair, so the output is a pure
    function of the corpus.
    """
    symbols = [list(word) for word in words]
    counts = list(words.values())
    stats = _PairStats()
    for index, word in enumerate(symbols):
        stats.add(index, word, counts[index])
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges and (pair := stats.pop_best()) is not None:
        merges.append(pair)
        for index in sorted(stats.where.pop(pair)):
            merged = _merge_pair(symbols[index], pair)
            stats.add(index, symbols[index], -counts[index])
            stats.add(index, merged, counts[index])
            symbols[index] = merged
    return merges


@dataclass
class _PairStats:
    """Symbol-pair counts over all words, and a lazy max-heap to find the most frequent pair."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    # pair -> indices of words that may contain it (a superset: entries are never removed)
    where: defaultdict[tuple[str, str], set[int]] = field(default_factory=lambda: defaultdict(set))
    heap: list[tuple[int, tuple[str, str]]] = field(default_factory=list)

    def add(self, index: int, word: list[str], weight: int) -> None:
        """Count the pairs of word `index` `weight` times; a negative weight removes them."""
        for pair, occurrences in Counter(itertools.pairwise(word)).items():
            self.counts[pair] += occurrences * weight
            if self.counts[pair] <= 0:
                del self.counts[pair]
                continue
            heapq.heappush(self.heap, (-self.counts[pair], pair))
            if weight > 0:
                self.where[pair].add(index)

    def pop_best(self) -> tuple[str, str] | None:
        """The most frequent pair, the smallest one on a tie; None when no pair is left."""
        while self.heap:
            neg_count, pair = heapq.heappop(self.heap)
            if self.counts.get(pair, 0) == -neg_count:  # else stale: pushed before a change
                return pair
        return None


def _merge_pair(word: list[str], pair: tuple[str, str]) -> list[str]:
    """`word` with every occurrence of `pair` (left to right) joined into one symbol."""
    merged: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged
