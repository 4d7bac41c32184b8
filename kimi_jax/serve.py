"""``python -m kimi_jax.serve``: the OpenAI-compatible server, kimi_jax.cli.serve."""

import importlib

from kimi_jax.cli.exits import exit_with, run_command

if __name__ == "__main__":
    # The CLI (and JAX) is imported inside run_command: Ctrl-C while it loads is one line and status 130 too.
    exit_with(run_command("kimi_jax.serve", lambda: importlib.import_module("kimi_jax.cli.serve").main()))
