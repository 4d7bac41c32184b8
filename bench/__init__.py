"""Benchmark scripts (``python -m bench.<name>``). Like the commands, they start on the CPU alone when no
accelerator is attached and the user chose no JAX platform: no CUDA plugin traceback before their output."""

from kimi_jax.cli.platform import choose_platforms

choose_platforms()
