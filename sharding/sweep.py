"""``python -m sharding.sweep``: the old name of ``python -m kimi_jax.analysis.sweep`` (same arguments)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("kimi_jax.analysis.sweep", run_name="__main__", alter_sys=True)
