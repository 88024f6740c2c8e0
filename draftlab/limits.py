"""Bounds of the decoding options, shared by the decoder's check, the recipe's schema, the CLIs
and the drafter configs that name a chain length (a layer-skip search's ``max_chain``, an
export's ``--num-speculative-tokens``).

Every decoding option is checked against these before any work, so that no value reaches an
allocation or a loop unbounded.
"""

MAX_K = 64  # chain and block: drafts per step
MAX_TREE_NODES = 1024  # trees: draft nodes per step; also bounds tree depth, top-k and static-tree ranks
MAX_NEW_TOKENS = 131072  # and, once the target is known, its positions less the longest prompt
MAX_BATCH_SIZE = 1024
TEMPERATURE_RANGE = (1e-4, 100.0)  # a sampling temperature; 0 = greedy
SEED_RANGE = (-(2**63), 2**63 - 1)
