"""Logits processors: the contract, the built-ins, and the per-engine set."""

from engine.sample.logits_processor.builtin import (
    ForcedOutputLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from engine.sample.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitsProcessor,
    LogitsProcessorConfig,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from engine.sample.logits_processor.registry import (
    BUILTIN_LOGITS_PROCESSORS,
    LogitsProcessors,
    build_logits_processors,
    load_custom_logits_processor,
)
from engine.sample.logits_processor.state import process_dict_updates
from engine.sample.logits_processor.thinking_budget import ThinkingBudgetLogitsProcessor

__all__ = [
    "BUILTIN_LOGITS_PROCESSORS",
    "AddedRequest",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "ForcedOutputLogitsProcessor",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessorConfig",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
    "ThinkingBudgetLogitsProcessor",
    "build_logits_processors",
    "load_custom_logits_processor",
    "process_dict_updates",
]
