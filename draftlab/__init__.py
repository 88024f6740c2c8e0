"""draftlab: train, evaluate and export speculative-decoding drafters.

The top-level folders of the repository are subpackages of this namespace
(``data/`` is ``draftlab.data``, ``models/`` is ``draftlab.models``, ...).
"""

__version__ = "0.1.0"
