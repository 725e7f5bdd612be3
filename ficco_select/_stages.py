"""The stages in a checkout: ``data/``, ``features/`` and ``train/`` sit beside the package (the
design card's layout) and import as ``ficco_select.data``, ``ficco_select.features`` and
``ficco_select.train``, as they do from the wheel, where they are installed inside it.

The package's ``__path__`` gets one extra entry that stands for exactly these three folders, not
the checkout's root: nothing else of the checkout (``tests``, ``benchmarks``, the package itself)
becomes a submodule, and ``pkgutil.walk_packages`` lists the same names as from the wheel.
"""

import importlib.util
import os
import sys
from pathlib import Path

STAGES = ("data", "features", "train")


class StageFinder:
    """The path-entry finder of the stages' entry in ``ficco_select.__path__``."""

    def __init__(self, checkout: Path):
        self.checkout = checkout

    def find_spec(self, fullname: str, target=None):
        name = fullname.rpartition(".")[2]
        if name not in STAGES:
            return None
        folder = self.checkout / name
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])

    def iter_modules(self, prefix: str = ""):  # what pkgutil.iter_modules asks a finder
        for name in STAGES:
            yield prefix + name, True

    def invalidate_caches(self) -> None:
        pass


def stage_entry(checkout: Path) -> str:
    """The ``__path__`` entry that stands for `checkout`'s stages; its path hook is installed once."""
    entry = os.path.join(checkout, "<data, features, train>")  # no such folder: only the hook below reads it
    if not any(getattr(hook, "ficco_entry", None) == entry for hook in sys.path_hooks):
        def hook(path: str) -> StageFinder:
            if path != entry:
                raise ImportError  # any other entry: the next hook's
            return StageFinder(checkout)
        hook.ficco_entry = entry
        sys.path_hooks.insert(0, hook)
        sys.path_importer_cache.pop(entry, None)
    return entry

