"""Pallas kernels (Triton-lowering subset, runnable in interpret mode on CPU), each with a jnp reference beside it."""
