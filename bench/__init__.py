"""Benchmarks on the embedded target, each run from the repository root as ``python -m bench.<name>``
and each rewriting its own section of BENCHMARKS.md (the section it replaces moves to
bench/HISTORY.md). Beside the scripts: ``sections`` (that writer), ``machine`` (CPU name, fp32
matmul peak, load of other processes) and ``runs`` (what a training run directory holds).
Finished studies live in ``bench/archive/``."""

import draftlab  # noqa: F401,E402  first: the checkout's folders yield installed packages' names (draftlab/checkout.py)
