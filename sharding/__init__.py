"""Sharding-strategy sweeps for kimi_jax: ``python -m sharding.sweep`` (see sharding/README.md)."""
