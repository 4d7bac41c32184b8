"""``python -m kimi_jax.convert``: the conversion CLI, kimi_jax.cli.convert."""

import sys

from kimi_jax.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
