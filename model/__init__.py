"""MiniNorm model package: importing it registers the "mininorm" type with transformers' Auto classes."""

from model.config import PRESETS, MiniNormConfig, NormImpl, NormPlacement, NormType
from model.model import MiniNormForCausalLM, MiniNormModel
from model.norms import build_norm

__all__ = ["PRESETS", "MiniNormConfig", "MiniNormForCausalLM", "MiniNormModel", "NormImpl", "NormPlacement",
           "NormType", "build_norm"]
