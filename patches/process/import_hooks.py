"""Run a patch right after a module of the user's code is imported, before anyone binds its names.

`from megatron.arguments import parse_args` copies the function into the importer's namespace, so a
patch applied after that import would miss it. `after_import(name, patch)` calls `patch(module)` as soon
as `name` has executed (at once if it is already imported), which is before any importer reads it.
"""
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Callable, Dict, List

ModulePatch = Callable[[ModuleType], None]


class _PatchingLoader(importlib.abc.Loader):
    """Wraps the real loader: executes the module, then its patches."""

    def __init__(self, loader: importlib.abc.Loader, patches: List[ModulePatch]):
        self._loader = loader
        self._patches = patches

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for patch in self._patches:
            patch(module)

    def __getattr__(self, name: str):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: finds nothing itself, asks the finders after it and wraps their loader."""

    def __init__(self):
        self.pending: Dict[str, List[ModulePatch]] = {}

    def find_spec(self, fullname, path, target=None):
        patches = self.pending.pop(fullname, None)
        if patches is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patches)
                return spec
        return None


_finder = _AfterImportFinder()


def after_import(name: str, patch: ModulePatch) -> None:
    """Call patch(module) once `name` is imported: now if it is, else right after it executes."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.pending.setdefault(name, []).append(patch)
