"""The module paths of the flat layout before the package was arranged by pipeline stage
(autoflash.defaults is now autoflash.kernels.defaults, ...). Importing an old path gives the module at
its new place, with a DeprecationWarning, so scripts written against the old layout keep working."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    **{f"autoflash.{m}": f"autoflash.kernels.{m}" for m in
       ("config", "gpus", "defaults", "codegen", "compiler", "launch", "checks", "resources", "function")},
    "autoflash.reference_bwd": "autoflash.reference.backward",
    "autoflash.problem": "autoflash.tuning.problem",
    "autoflash.timing": "autoflash.bench.timing",
    **{f"autoflash.{m}": f"autoflash.dispatch.{m}" for m in ("ops", "selection", "explain")},
    **{f"autoflash.bench_{m}": f"autoflash.bench.{m}" for m in ("dispatch", "train", "report")},
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)  # replaced in sys.modules by exec_module

    def exec_module(self, module):
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} is now {new}", DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)  # what the import statement returns


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
