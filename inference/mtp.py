"""Proposer for MTP module drafters (models/mtp.py): EAGLE's (inference/eagle.py), unchanged.

An MTP module drafts as EAGLE-1 does: its cache holds the committed positions run on the target's
states, and each draft feeds the module's own output state back with the token just drafted, which
is the FastMTP recursion at inference. So EAGLE's chains (host loop, batched, device loop) and its
dynamic and static trees draft it as they are.
"""

from __future__ import annotations

from draftlab.inference.eagle import EagleProposer
from draftlab.inference.proposer import PROPOSERS


@PROPOSERS.register("mtp")
class MtpProposer(EagleProposer):
    """EAGLE's proposer over an MTP module (``drafter.algorithm`` names it in reports)."""
