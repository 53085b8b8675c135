"""Llama-family models, their config and the safetensors loader."""

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelArchConfig", "load_model"]
