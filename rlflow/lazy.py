"""Modules imported on first use: a light module can name heavy ones without importing them yet.

``Trainer`` begins a local Ray before the driver imports tensordict, torch's distributed stack and
the engines (:mod:`rlflow.trainer.local_ray`), so :mod:`rlflow.trainer.trainer` names the modules
it runs on with :class:`LazyModule`. A stand-in, not an entry of ``sys.modules`` as
:class:`importlib.util.LazyLoader` makes: torch walks ``sys.modules`` as it loads (its custom
ops look up their source's module), which would load every such entry at that moment, and
packages that replace themselves in ``sys.modules`` (``transformers``) refuse LazyLoader.
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule:
    """Stands for the module ``name``, imported on the first attribute read through it.

    Every read goes to the module itself, so what a test patches there is what callers see.

    >>> tool = LazyModule("json.tool")
    >>> callable(tool.main)
    True
    """

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: types.ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<LazyModule {self._name!r} ({state})>"
