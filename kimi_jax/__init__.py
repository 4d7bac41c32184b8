"""kimi_jax: Kimi K2.6 inference in JAX with DDTree speculative decoding."""

from kimi_jax.api import Generation, Model, load
from kimi_jax.config import ModelConfig, Runtime, param_count, preset

__all__ = ["Generation", "Model", "ModelConfig", "Runtime", "load", "param_count", "preset"]
