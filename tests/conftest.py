import os
import sys
from pathlib import Path

import pytest
import torch

import draftlab  # noqa: F401  first: the checkout's folders yield installed packages' names (draftlab/checkout.py)

sys.path.insert(0, str(Path(__file__).parent))
if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one thread each, their launches too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from tiny import make_tiny_target_dir  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip on a machine without a CUDA device (the markers: pyproject.toml)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_target_dirs(tmp_path_factory):
    """family -> directory of a tiny random model with a ChatML tokenizer (built once)."""
    root = tmp_path_factory.mktemp("targets")
    return {f: make_tiny_target_dir(root / f, f) for f in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_target_dirs):
    from draftlab.models.target import Target

    return Target.load(str(tiny_target_dirs["llama"]))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest single-threaded; on a loaded 2-core machine two threads spinning
    on microsecond-sized ops are 10-30x slower (modules opt in with ``pytestmark``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(request, tiny_llama):
    """The test module's ``TEXTS``, tokenised by the tiny Llama target."""
    return [tiny_llama.tokenizer(t)["input_ids"] for t in request.module.TEXTS]


@pytest.fixture(scope="module")
def alone(request, tiny_llama, prompts):
    """Each prompt's plain greedy continuation of the module's ``N_NEW`` tokens, decoded alone (batch 1)."""
    from draftlab.inference.decoder import generate_plain

    return [generate_plain(tiny_llama, p, request.module.N_NEW).tokens for p in prompts]
