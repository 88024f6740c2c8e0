"""A checkout's root on ``sys.path`` must not hide installed packages named like its folders.

Run from the root (pytest, ``python -m bench.*``, ``python -m draftlab...``), ``import kernels``
would find the repository's ``kernels/`` (``draftlab.kernels``) before Hugging Face's ``kernels``
package, which transformers imports when it is installed. A finder placed first resolves those
top-level names from the rest of ``sys.path``, and falls back to the folder where nothing else
provides them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

# the top-level folders pyproject.toml's package-dir maps into the namespace (draftlab/ aside)
FOLDERS = ("data", "models", "losses", "train", "inference", "kernels", "export")


class _InstalledFirst(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in FOLDERS:
            return None
        elsewhere = [p for p in sys.path if _resolved(p) != self.root]
        return importlib.machinery.PathFinder.find_spec(name, elsewhere)  # None: the folder it is


def _resolved(entry: str) -> Path | None:
    try:
        return Path(entry or ".").resolve()
    except OSError:
        return None


def yield_folder_names(root: Path) -> None:
    """Install the finder for the checkout at ``root`` (once per process)."""
    if not any(isinstance(f, _InstalledFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstalledFirst(root.resolve()))
