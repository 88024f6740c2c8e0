#!/usr/bin/env bash
# The README's test command and what CI runs: install (with test extras) and run the suite
# without the tests marked slow (pyproject.toml's addopts); arguments go to pytest (-m slow).
# Two workers, one file each at a time (a file's module fixtures are built once; its fixed
# ports are its own): tiny models leave a core mostly idle, so two files share the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec .venv/bin/python -m pytest -n "${DRAFTLAB_TEST_WORKERS:-2}" --dist loadfile "$@"
