"""The plan search's progress bar: shown when stderr is a terminal unless told (``progress``)."""

from __future__ import annotations

import io
import sys

import pytest
from plan_cases import frozen_problem, opt

from rlflow.planner.search import search


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("progress", "terminal", "shown"),
    [(None, True, True), (None, False, False), (True, False, True), (False, True, False)],
)
def test_the_search_bar_follows_the_terminal_unless_told(monkeypatch, progress, terminal, shown):
    err = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    problem = frozen_problem([[opt(0, 8, 1.0), opt(0, 4, 1.6), opt(4, 4, 1.6)]] * 2)
    search(problem, max_steps=200, num_chains=1, seed=0, progress=progress)
    assert ("plan search" in err.getvalue()) is shown
