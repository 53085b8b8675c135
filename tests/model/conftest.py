"""Random-weight HF checkpoints built once per session, with their greedy references."""

from __future__ import annotations

import pytest

from tests.model.hf_models import ARCHITECTURES, hf_greedy, make_hf_model


class HFReference:
    """A saved checkpoint plus memoised transformers greedy outputs."""

    def __init__(self, name: str, path, engine_args: dict[str, str]) -> None:
        self.name = name
        self.path = str(path)
        # Where engines built on this checkpoint run (see `engine_device`).
        self.engine_args = engine_args
        self.model = make_hf_model(name, path)
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            self._cache[key] = hf_greedy(self.model, prompt, max_new_tokens)
        return self._cache[key]


@pytest.fixture(scope="session")
def engine_device(pytestconfig) -> dict[str, str]:
    """The model tests' engines run on the CPU, or with `pytest --device cuda` on the GPU; in
    float32 on both, since the oracle is float32 transformers (on the CPU)."""
    return {"device": pytestconfig.getoption("--device"), "dtype": "float32"}


@pytest.fixture(scope="session")
def hf_refs(tmp_path_factory, engine_device) -> dict[str, HFReference]:
    return {
        name: HFReference(name, tmp_path_factory.mktemp(name), engine_device)
        for name in ARCHITECTURES
    }


@pytest.fixture(scope="session")
def float_weights(engine_device) -> dict[str, str]:
    """Engine arguments for a GGUF file's float32 path (dequantized at load): on CPUs `auto`
    would compute on its quantized blocks, which transformers' dequantizing oracle does not."""
    return {"linear_backend": "blocked"} if engine_device["device"] == "cpu" else {}
