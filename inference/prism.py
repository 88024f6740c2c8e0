"""PRISM's proposer (models/prism.py) is EAGLE-3's (inference/eagle.py), registered under its name.

Every drafter forward there passes the draft depth of its inputs (``draft_step(..., depth=)``,
``EagleBase.stack``): 0 for the committed tokens, j for the chain's j-th draft and for a tree's
nodes at depth j. PRISM's drafter picks the module of that step from it, so chains, EAGLE-2's
dynamic tree, EAGLE-1's static tree, batched chains and the device loop's chains and trees all run
one module per step with nothing of their own.
"""

from draftlab.inference.eagle import EagleProposer
from draftlab.inference.proposer import PROPOSERS

PROPOSERS.register("prism")(EagleProposer)
