"""Llama-family models, their config and the safetensors loader.

Import the torch-heavy parts from their modules (`engine.models.llama`, `.loader`): this
package stays light so that `engine.models.default_model` lookups do not pay for torch.
"""

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelArchConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArchConfig"]
