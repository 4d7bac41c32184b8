"""``python -m kimi_jax.train``: the training CLI, kimi_jax.cli.train."""

import sys

from kimi_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
