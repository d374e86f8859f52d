"""Every ``>>>`` example in rlflow.data runs as written."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["tokenizer", "tiny_models", "datasets", "loader", "tasks"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"rlflow.data.{module}")
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
