"""Random-weight HF checkpoints built once per session, with their greedy references."""

from __future__ import annotations

import pytest

from tests.model.hf_models import ARCHITECTURES, hf_greedy, make_hf_model


class HFReference:
    """A saved checkpoint plus memoised transformers greedy outputs."""

    def __init__(self, name: str, path) -> None:
        self.name = name
        self.path = str(path)
        self.model = make_hf_model(name, path)
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._cache:
            self._cache[key] = hf_greedy(self.model, prompt, max_new_tokens)
        return self._cache[key]


@pytest.fixture(scope="session")
def hf_refs(tmp_path_factory) -> dict[str, HFReference]:
    return {name: HFReference(name, tmp_path_factory.mktemp(name)) for name in ARCHITECTURES}
