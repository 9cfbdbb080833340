"""Model definition and checkpoint loading."""

from .config import ModelConfig, ModelLoadError
from .loader import ModelSpec, default_model_path, load_model, resolve_model_path
from .transformer import Transformer

__all__ = ["ModelConfig", "ModelLoadError", "ModelSpec", "Transformer", "default_model_path", "load_model", "resolve_model_path"]
