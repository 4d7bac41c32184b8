"""kimi_jax: Kimi K2.6 inference in JAX with DDTree speculative decoding."""

import importlib

_EXPORTS = {"Generation": "kimi_jax.api", "Model": "kimi_jax.api", "load": "kimi_jax.api",
            "Request": "kimi_jax.decoding.programs",
            "ModelConfig": "kimi_jax.config", "Runtime": "kimi_jax.config", "param_count": "kimi_jax.config",
            "preset": "kimi_jax.config"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    # Imported on first use, so the commands own Ctrl-C from their first line (JAX takes seconds to import).
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kimi_jax' has no attribute {name!r}")
