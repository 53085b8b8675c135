"""The set of processors one engine runs: built-ins plus custom classes named by the user."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence

import torch

from engine.request import SamplingParams
from engine.sample.logits_processor.builtin import (
    ForcedOutputLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from engine.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
)
from engine.sample.logits_processor.structured import StructuredOutputLogitsProcessor
from engine.sample.logits_processor.thinking_budget import ThinkingBudgetLogitsProcessor

# Order matters among the argmax-changing ones: thinking budget runs after logit_bias so a
# bias cannot undo a forced reasoning end; the grammar masks after both (a bias cannot bring
# back a token it forbids); forced output tokens come last and win over all.
BUILTIN_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    ThinkingBudgetLogitsProcessor,
    StructuredOutputLogitsProcessor,
    ForcedOutputLogitsProcessor,
    MinPLogitsProcessor,
)


class LogitsProcessors:
    """Processors split by whether they can change a greedy pick (the sampler needs both)."""

    def __init__(self, processors: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for processor in processors:
            if processor.is_argmax_invariant():
                self.argmax_invariant.append(processor)
            else:
                self.non_argmax_invariant.append(processor)

    @property
    def all(self) -> list[LogitsProcessor]:
        return self.non_argmax_invariant + self.argmax_invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Call every step, before sampling, even with None (processors read live outputs)."""
        for processor in self.all:
            processor.update_state(batch_update)

    def validate_params(self, params: SamplingParams) -> None:
        """Raise ValueError if any processor rejects `params` (call when a request arrives)."""
        for processor in self.all:
            processor.validate_params(params)


def build_logits_processors(
    config: LogitsProcessorConfig,
    device: torch.device,
    custom: Sequence[str | type] = (),
) -> LogitsProcessors:
    """Instantiate the built-ins, then each custom class (a class or its qualified name)."""
    classes = list(BUILTIN_LOGITS_PROCESSORS)
    for spec in custom:
        classes.append(load_custom_logits_processor(spec) if isinstance(spec, str) else spec)
    for cls in classes:
        _check_processor_class(cls, repr(cls))
    return LogitsProcessors(cls(config, device) for cls in classes)


def load_custom_logits_processor(fqcn: str) -> type[LogitsProcessor]:
    """Import the class named "pkg.mod.Class" or "pkg.mod:Class" (nested: "pkg.mod:A.B")."""
    module_name, qualname = _split_fqcn(fqcn)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"logits processor {fqcn!r}: cannot import module {module_name!r} ({e})"
        ) from e
    obj: object = module
    for attr in qualname.split("."):
        if not hasattr(obj, attr):
            raise ValueError(
                f"logits processor {fqcn!r}: module {module_name!r} has no class {qualname!r}"
            )
        obj = getattr(obj, attr)
    return _check_processor_class(obj, repr(fqcn))


def _split_fqcn(fqcn: str) -> tuple[str, str]:
    if ":" in fqcn:
        module_name, _, qualname = fqcn.partition(":")
    else:
        module_name, _, qualname = fqcn.rpartition(".")
    if not module_name or not qualname or ":" in qualname:
        raise ValueError(
            f"logits processor {fqcn!r}: expected 'package.module.Class' or 'package.module:Class'"
        )
    return module_name, qualname


def _check_processor_class(obj: object, name: str) -> type[LogitsProcessor]:
    if not isinstance(obj, type) or not issubclass(obj, LogitsProcessor):
        raise ValueError(f"logits processor {name} is not a subclass of LogitsProcessor")
    return obj
