"""The built-in default model: deterministic build, files, transformers compatibility, cache."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.models import default_model
from engine.models.default_model import (
    DEFAULT_MODEL_DIRNAME,
    MARKER_FILE,
    MODEL_FILES,
    default_model_path,
    ensure_default_model,
    make_default_model,
    weight_shapes,
)
from engine.tokenizer import Tokenizer

VOCAB_SIZE = 2048
# Pinned digests of the seed-0 build. They change only if the generator changes (then bump
# DEFAULT_MODEL_DIRNAME), or if torch's CPU generator or the corpus do: either way, a test
# failure here means machines would no longer agree on the default model.
TENSORS_SHA256 = "64b2a43d60a84f1a3baadc6bb9e411a7c3375b5e0d304a8df86a1bd38aabf7cc"
VOCAB_SHA256 = "69e7f5805b974e5c0d0e28d367603781f846547e5ac15ce2a71146b975933de6"

SAMPLE_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "naïve café — 日本語のテキスト, 中文, Привет 🎉🚀👩‍👩‍👧",
    "def f(x: int) -> int:\n    return x ** 2  # 12345.678",
    "<s><|user|>\nHi</s>\n<|assistant|>\n<think>hmm</think>Hello",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_default_model(tmp_path_factory.mktemp("default") / "model")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.int32).numpy().tobytes())
    return digest.hexdigest()


def vocab_digest(path: Path) -> str:
    """Digest of the vocabulary and merges, independent of how tokenizers formats its JSON."""
    model = json.loads((path / "tokenizer.json").read_text())["model"]
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    payload = json.dumps([model["vocab"], merges], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def run_in_threads(fn: Callable[[], Path], num_threads: int) -> list[Path]:
    """Call `fn` from `num_threads` threads at once; re-raise the first error."""
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def call() -> None:
        barrier.wait()
        try:
            results.append(fn())
        except BaseException as err:  # a thread would swallow it
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# --- files and config -----------------------------------------------------------------------


def test_file_set(model_dir: Path) -> None:
    assert sorted(p.name for p in model_dir.iterdir()) == sorted([*MODEL_FILES, MARKER_FILE])
    assert default_model.is_complete_default_model(model_dir)


def test_config_fields(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    assert {key: config[key] for key in expected} == expected
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 1}
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<s>"
    assert tokenizer_config["eos_token"] == "</s>"
    assert "add_generation_prompt" in tokenizer_config["chat_template"]


def test_weights_have_llama_names_shapes_and_scale(model_dir: Path) -> None:
    tensors = read_tensors(model_dir)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == weight_shapes(VOCAB_SIZE)
    assert "model.layers.3.self_attn.k_proj.weight" in tensors
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (128, 256)
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32
        if name.endswith("norm.weight"):
            # 1 + noise: close to 1 but not trivially 1.
            assert not torch.all(tensor == 1.0)
            assert abs(tensor.mean().item() - 1.0) < 0.01
        else:
            assert abs(tensor.std().item() - 0.02) < 0.002
            assert abs(tensor.mean().item()) < 0.002


# --- determinism ----------------------------------------------------------------------------


def test_build_is_bit_exact_and_seeded(model_dir: Path, tmp_path: Path) -> None:
    again = make_default_model(tmp_path / "again", seed=0)
    first, second = read_tensors(model_dir), read_tensors(again)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name].view(torch.int32), second[name].view(torch.int32)), name
    for name in MODEL_FILES:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name

    other = read_tensors(make_default_model(tmp_path / "other", seed=1))
    assert not torch.equal(other["lm_head.weight"], first["lm_head.weight"])
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() == (
        model_dir / "tokenizer.json"
    ).read_bytes()


def test_build_matches_pinned_digests(model_dir: Path) -> None:
    assert tensors_digest(read_tensors(model_dir)) == TENSORS_SHA256
    assert vocab_digest(model_dir) == VOCAB_SHA256


def test_tokenizer_json_is_stable_in_process() -> None:
    assert default_model.build_tokenizer().to_str() == default_model.build_tokenizer().to_str()


# --- transformers compatibility -------------------------------------------------------------


def test_transformers_loads_model_and_runs_forward(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    ours = read_tensors(model_dir)
    state = model.state_dict()
    assert torch.equal(state["lm_head.weight"], ours["lm_head.weight"])
    assert torch.equal(state["model.norm.weight"], ours["model.norm.weight"])
    input_ids = torch.tensor([[0, 10, 20, 30, 40]])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, 5, VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_transformers_tokenizer_agrees_with_ours(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    ours = Tokenizer.from_pretrained(model_dir)
    assert len(theirs) == ours.vocab_size == VOCAB_SIZE
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    for text in SAMPLE_TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert theirs(text, add_special_tokens=add_special).input_ids == ids, text
        plain = ours.encode(text, add_special_tokens=False)
        assert fast(text, add_special_tokens=False).input_ids == plain
        for skip in (True, False):
            assert theirs.decode(plain, skip_special_tokens=skip) == ours.decode(plain, skip)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello."},
    ]
    for add_prompt in (True, False):
        rendered = theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_prompt
        )
        assert rendered == ours.apply_chat_template(messages, add_generation_prompt=add_prompt)


# --- cache ----------------------------------------------------------------------------------


def test_ensure_default_model_builds_once_in_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    expected = tmp_path / "cache" / DEFAULT_MODEL_DIRNAME
    assert default_model_path() == expected
    assert ensure_default_model() == expected
    assert default_model.is_complete_default_model(expected)
    mtimes = {name: (expected / name).stat().st_mtime_ns for name in MODEL_FILES}

    assert ensure_default_model() == expected
    assert {name: (expected / name).stat().st_mtime_ns for name in MODEL_FILES} == mtimes

    # A file deleted by hand makes the cache incomplete: the next call rebuilds it.
    (expected / "tokenizer.json").unlink()
    assert ensure_default_model() == expected
    assert default_model.is_complete_default_model(expected)
    leftovers = [p.name for p in expected.parent.iterdir() if p.is_dir() and p != expected]
    assert not leftovers  # no temporary or discarded directories


def test_concurrent_ensure_builds_once_and_repairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    broken = default_model_path()
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # an incomplete cache: no marker
    builds: list[Path] = []
    real_make = default_model.make_default_model

    def counting_make(path: Path, seed: int = 0) -> Path:
        builds.append(path)
        return real_make(path, seed)

    monkeypatch.setattr(default_model, "make_default_model", counting_make)
    results = run_in_threads(ensure_default_model, 3)
    assert results == [broken] * 3
    assert builds == [broken]
    assert tensors_digest(read_tensors(broken)) == TENSORS_SHA256


def test_default_model_path_falls_back_to_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    assert default_model_path() == Path.home() / ".cache" / "pdserve" / DEFAULT_MODEL_DIRNAME


def test_make_default_model_keeps_existing_model(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert make_default_model(model_dir) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_make_default_model_refuses_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not the default model"):
        make_default_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_make_default_model_into_empty_directory(tmp_path: Path) -> None:
    target = tmp_path / "empty"
    target.mkdir()
    assert default_model.is_complete_default_model(make_default_model(target))


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_make_default_model_rejects_bad_seed(tmp_path: Path, seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        make_default_model(tmp_path / "m", seed=seed)  # type: ignore[arg-type]


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    target = tmp_path / "shared"
    assert run_in_threads(lambda: make_default_model(target), 2) == [target, target]
    assert default_model.is_complete_default_model(target)
    assert tensors_digest(read_tensors(target)) == TENSORS_SHA256
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]
