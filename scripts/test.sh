#!/usr/bin/env bash
# The README's test command: install (with test extras) and run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec .venv/bin/python -m pytest "$@"
