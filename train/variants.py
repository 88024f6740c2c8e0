"""Trainer variants: the run of a family whose recipe trains no weights by gradient steps
(``Drafter.trains_weights`` False, e.g. the layer-skip search), by algorithm name.

A variant registers its ``run(recipe) -> final metrics`` in its own module of ``train/``
(``@TRAINERS.register("layerskip")``), and ``draftlab train`` finds it the way it finds drafter
families (:mod:`draftlab.registry`): so ``models/`` names no training code.
"""

from __future__ import annotations

from typing import Callable

from draftlab.registry import Registry

TRAINERS: Registry[Callable[..., dict]] = Registry("trainer variant", packages=("draftlab.train",))
