"""Sharding-strategy sweeps for kimi_jax: ``python -m kimi_jax.analysis.sweep`` (see sharding/README.md)."""
