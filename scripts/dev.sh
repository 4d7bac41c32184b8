#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv (Python >= 3.12), installs kimi_jax, then
#   bash scripts/dev.sh decode [args...]   runs `python -m kimi_jax.decode` (the embedded default)
#   bash scripts/dev.sh serve [args...]    runs `python -m kimi_jax.serve` (the OpenAI-compatible server)
#   bash scripts/dev.sh test [pytest args] runs the whole test suite on the CPU (pytest args select, e.g. -m "not slow")
set -euo pipefail
cd "$(dirname "$0")/.."
cmd="${1:-decode}"; shift || true

find_python() {
  for py in "${KIMI_PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$py" ] || continue
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  # pyenv keeps 3.12 next to an older default on these machines
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -rV); do
      if PYENV_VERSION="$v" pyenv which python >/dev/null 2>&1; then echo "$(PYENV_VERSION=$v pyenv which python)"; return 0; fi
    done
  fi
  return 1
}

extras="test"
[ "$cmd" = "decode" ] && extras=""
[ "$cmd" = "serve" ] && extras="serve"
stamp=".venv/.kimi_jax_installed${extras:+_$extras}"
if [ ! -x .venv/bin/python ] || [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ ! -x .venv/bin/python ]; then
    py="$(find_python)" || { echo "kimi_jax needs Python >= 3.12 (current JAX). Install it, e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv', or set KIMI_PYTHON=/path/to/python3.12" >&2; exit 1; }
    "$py" -m venv .venv
  fi
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
  touch "$stamp"
fi

export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
case "$cmd" in
  decode) exec .venv/bin/python -m kimi_jax.decode "$@" ;;
  serve)  exec .venv/bin/python -m kimi_jax.serve "$@" ;;
  test)
    # Two pytest-xdist workers (one per core here), whole modules each so module fixtures build once, handed out
    # in collection order (tests/conftest.py puts the slowest modules first; xdist's own reorder, by test count,
    # would undo that); a later -n in the arguments wins (-n 0: one process, e.g. for -x or a debugger).
    exec .venv/bin/python -m pytest -n "${KIMI_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" ;;
  *)      echo "usage: bash scripts/dev.sh decode|serve|test [args...]" >&2; exit 2 ;;
esac
