"""Declared dataclass fields: a default with its one-line help, allowed values and bounds.

The config sections of :mod:`rlflow.trainer.config` and the algorithm's hyper-parameters
(:class:`rlflow.algos.params.AlgorithmParams`, which the config's ``algorithm`` section extends)
declare every field with :func:`declared_field`; the config checks the metadata on construction
and renders it into ``docs/configuration.md``, so checks and reference cannot drift apart. It
sits at the bottom of the layers so that both can use it.

>>> from dataclasses import dataclass, fields
>>> @dataclass
... class Example:
...     lr: float = declared_field(1e-3, "learning rate", gt=0.0)
>>> fields(Example)[0].metadata["gt"]
0.0
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

__all__ = ["declared_field"]


def declared_field(
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A dataclass field with its documentation and constraints in ``metadata``.

    Args:
        default: the default value; a list, dict or dataclass is deep-copied per instance.
        help: one line for the configuration reference.
        choices: allowed values, or a callable returning them so that registries users extend
            (algorithms, advantage estimators, policy losses) are read when a value is checked,
            not when the declaring module is imported.
        ge, gt, le, lt: numeric bounds.
    """
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)
