"""Imports point down only: every import inside rlflow — at module level, inside a function, under
``TYPE_CHECKING`` — names a module of its own layer or of a layer below it (docs/architecture.md).

Layers, bottom to top; a module may import its own layer and the layers before it:

* ``protocol`` (DataProto), ``strategy`` (ParallelStrategy, RankCoords), ``rendezvous``
  (free_port), ``families`` (model-family records), ``sandbox`` (isolated runs of untrusted code) —
  import nothing of rlflow above them;
* ``controller`` — the single controller, which knows nothing of models;
* ``dataflow``, ``planner`` (pure: prices and searches plans), ``parallel`` (process groups,
  layouts, resharding), ``engine`` (training and rollout engines), ``algos`` (pure torch losses
  and estimators), ``data`` (datasets, tokenizer, tiny models; it imports no other rlflow layer
  and is read by the workers' reward model and the trainer);
* ``workers`` (the Ray actor hosting the models, and the profiler that runs the engines as a
  worker does), ``trainer`` (the driver), ``cli``.

The compiled kernels (``rlflow._C_*``) import nothing of rlflow and sit below every layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlflow

LAYERS = (
    "files",
    "lazy",
    "protocol",
    "fields",
    "strategy",
    "rendezvous",
    "families",
    "sandbox",
    "controller",
    "dataflow",
    "planner",
    "parallel",
    "engine",
    "algos",
    "data",
    "workers",
    "trainer",
    "cli",
)
ROOT = Path(rlflow.__file__).parent


def layer_of(module: str) -> int:
    """Position in :data:`LAYERS` of a dotted ``rlflow.*`` module; compiled kernels are -1.

    Raises:
        ValueError: a module of no layer (add its package to ``LAYERS`` where it belongs).
    """
    parts = module.split(".")
    if len(parts) < 2:
        raise ValueError(f"{module!r}: import a module of rlflow, not the package root")
    if parts[1].startswith("_C_"):
        return -1
    if parts[1] not in LAYERS:
        raise ValueError(f"{module!r} belongs to no layer; add {parts[1]!r} to LAYERS in {Path(__file__).name}")
    return LAYERS.index(parts[1])


def module_name(path: Path, root: Path) -> str:
    """``rlflow.planner.cost`` for ``<root>/planner/cost.py``; a package's ``__init__`` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("rlflow", *parts))


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, dotted module)``, by line, of every rlflow import anywhere in ``tree`` (``ast.walk`` enters
    functions, classes and ``if TYPE_CHECKING:`` blocks; a ``LazyModule("rlflow.x")`` counts too). ``from rlflow.x import y`` counts as
    ``rlflow.x.y`` (a submodule or a name of ``rlflow.x``: same layer either way); relative
    imports are resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LazyModule" and node.args:
            name = node.args[0]  # rlflow.lazy.LazyModule("rlflow.x"): an import on first use
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.append((node.lineno, name.value))
    return sorted((line, name) for line, name in found if name == "rlflow" or name.startswith("rlflow."))


def upward_imports(root: Path) -> list[str]:
    """``file:line: importer -> target`` for every import under ``root`` (the rlflow package
    directory) that points up the layer order or names a module of no layer."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        if module == "rlflow":
            continue  # the package root: its __init__ is empty
        own = layer_of(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in imported_modules(tree, module, path.name == "__init__.py"):
            where = f"{path.relative_to(root.parent)}:{line}"
            try:
                theirs = layer_of(target)
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
                continue
            if theirs > own:
                problems.append(
                    f"{where}: {module} ({LAYERS[own]}) imports {target} ({LAYERS[theirs]}), a layer above it"
                )
    return problems


def test_every_import_of_rlflow_points_down_the_layers():
    problems = upward_imports(ROOT)
    assert not problems, "imports pointing up the layers:\n" + "\n".join(problems)


def test_every_top_level_module_of_rlflow_has_a_layer():
    names = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert sorted(names - set(LAYERS)) == []


def test_the_check_finds_upward_imports_in_functions_under_type_checking_and_relative(tmp_path):
    root = tmp_path / "rlflow"
    (root / "planner").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "planner" / "__init__.py").write_text("")
    (root / "planner" / "cost.py").write_text(
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from rlflow.strategy import ParallelStrategy\n"  # down: fine
        "from . import mesh\n"  # same layer: fine
        "from rlflow import _C_planner\n"  # the compiled kernel: fine
        "if TYPE_CHECKING:\n"
        "    from rlflow.engine.train_engine import TrainEngine\n"
        "def measure():\n"
        "    import rlflow.workers.model_worker\n"
        "    from ..trainer import placement\n"
        "    from rlflow.nowhere import x\n"
    )
    assert upward_imports(root) == [
        "rlflow/planner/cost.py:7: rlflow.planner.cost (planner) imports rlflow.engine.train_engine.TrainEngine"
        " (engine), a layer above it",
        "rlflow/planner/cost.py:9: rlflow.planner.cost (planner) imports rlflow.workers.model_worker (workers),"
        " a layer above it",
        "rlflow/planner/cost.py:10: rlflow.planner.cost (planner) imports rlflow.trainer.placement (trainer),"
        " a layer above it",
        "rlflow/planner/cost.py:11: 'rlflow.nowhere.x' belongs to no layer; add 'nowhere' to LAYERS in"
        " test_import_layers.py",
    ]


@pytest.mark.parametrize("module", ["rlflow", "rlflow.nowhere"])
def test_a_module_of_no_layer_is_refused(module):
    with pytest.raises(ValueError, match="rlflow"):
        layer_of(module)
