#!/usr/bin/env bash
# The README's test command and what CI runs: install (with test extras) and run the suite
# without the tests marked slow (pyproject.toml's addopts); arguments go to pytest (-m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec .venv/bin/python -m pytest "$@"
