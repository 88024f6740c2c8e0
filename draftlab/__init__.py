"""draftlab: train, evaluate and export speculative-decoding drafters.

The top-level folders of the repository are subpackages of this namespace
(``data/`` is ``draftlab.data``, ``models/`` is ``draftlab.models``, ...).
"""

__version__ = "0.1.0"

from pathlib import Path as _Path

from draftlab.checkout import yield_folder_names as _yield_folder_names

# Run from a checkout's root (``python -m pytest``, ``python -c ...``), Python imports this folder
# before any installed copy, and it holds none of the subpackages: pyproject.toml maps them from
# the top-level folders, so search those here too (an installed copy has them beside this file).
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "kernels" / "__init__.py").is_file():
    __path__.append(str(_checkout))
    _yield_folder_names(_checkout)
del _Path, _checkout, _yield_folder_names
