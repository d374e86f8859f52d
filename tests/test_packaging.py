"""pyproject.toml's lower bounds are the versions the min-versions job tests (``make test-min-versions``
installs constraints/min-versions.txt into .venv-min)."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# Not pinned by the job: it runs the main venv's CPU build of torch (older CPU wheels are not on PyPI).
UNPINNED = {"torch"}


def declared_floors() -> dict[str, Version]:
    """The ``>=`` bound of each runtime dependency and of the wandb, mlflow, math and lora extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    floors = {}
    for line in [*project["dependencies"], *extras["wandb"], *extras["mlflow"], *extras["math"], *extras["lora"]]:
        req = Requirement(line)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"pyproject.toml: {line!r} needs one lower bound (>=) for the min-versions job"
        floors[canonicalize_name(req.name)] = Version(lower[0])
    return floors


def pinned_versions() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints" / "min-versions.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints/min-versions.txt: {line!r} should pin one version (==)"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def test_every_lower_bound_is_the_version_the_min_versions_job_pins():
    floors = {name: v for name, v in declared_floors().items() if name not in UNPINNED}
    assert pinned_versions() == floors
