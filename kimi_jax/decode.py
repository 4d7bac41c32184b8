"""``python -m kimi_jax.decode``: the decoding CLI, kimi_jax.cli.decode."""

import sys

from kimi_jax.cli.decode import main

if __name__ == "__main__":
    sys.exit(main())
