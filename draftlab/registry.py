"""Registries by name: drafter families, proposers, export formats and import formats.

Each plug-in registers itself where it is defined (``@DRAFTERS.register`` on the drafter
class, ``@PROPOSERS.register("eagle1", "eagle3")`` on its proposer, a trainer variant with
``@TRAINERS.register("layerskip")`` in ``train/``, ...), so no shared module names a family. A
lookup that misses imports the modules that may define plug-ins of its kind once: every module
of the registry's packages (``draftlab.models``, ``draftlab.inference`` and ``draftlab.export``
by default; ``draftlab.train`` for trainer variants), then the ``draftlab.plugins`` entry points
of installed packages (a third-party family ships its own modules and lists them there). A
plug-in defined elsewhere, a test file for instance, is registered as soon as its module is
imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
from typing import Callable, Generic, TypeVar

from draftlab.errors import DraftlabError

T = TypeVar("T")
PLUGIN_PACKAGES = ("draftlab.models", "draftlab.inference", "draftlab.export")
ENTRY_POINT_GROUP = "draftlab.plugins"
_discovered: set[str] = set()  # packages imported whole, and ENTRY_POINT_GROUP once its entry points are


def discover(packages: tuple[str, ...] = PLUGIN_PACKAGES) -> None:
    """Import every module of ``packages`` and the entry points' modules (each once per process)."""
    for package in packages:
        if package in _discovered:
            continue
        _discovered.add(package)
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{package}.{info.name}")
    if ENTRY_POINT_GROUP not in _discovered:
        _discovered.add(ENTRY_POINT_GROUP)
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            importlib.import_module(ep.value)


class Registry(Generic[T]):
    """Named objects of one kind; ``kind`` names them in errors ("drafter family", ...);
    ``key`` is the attribute that names an object registered without explicit names;
    ``packages``: the packages whose modules register objects of this kind."""

    def __init__(self, kind: str, key: str = "name", packages: tuple[str, ...] = PLUGIN_PACKAGES):
        self.kind, self.key, self.packages = kind, key, packages
        self._items: dict[str, T] = {}

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator (or call) registering an object under ``names``, by default under its
        ``key`` attribute."""

        def add(obj: T) -> T:
            for name in names or (getattr(obj, self.key),):
                if name in self._items and self._items[name] is not obj:
                    raise RuntimeError(f"{self.kind} '{name}' is registered twice")
                self._items[name] = obj
            return obj

        return add

    def get(self, name: str, where: str = "") -> T:
        """The object registered as ``name``; a DraftlabError naming ``where`` (a field or flag)
        and the known names otherwise."""
        if name not in self._items:
            discover(self.packages)
        if name not in self._items:
            prefix = f"{where}: " if where else ""
            raise DraftlabError(f"{prefix}unknown {self.kind} '{name}' (known: {', '.join(self.names()) or 'none'})")
        return self._items[name]

    def names(self) -> list[str]:
        discover(self.packages)
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        discover(self.packages)
        return sorted(self._items.items())
