"""Timeline pictures from simulated and measured intervals."""

from __future__ import annotations

import pytest
from plan_cases import ppo_problem

from rlflow.planner.search import search
from rlflow.planner.timeline import Interval, draw_timeline


def test_simulated_schedule_draws_to_png_and_svg(tmp_path):
    problem = ppo_problem(num_nodes=1)
    found = search(problem, max_steps=300, num_chains=1, progress=False)
    intervals = found.result.intervals(problem.mfc_names)
    assert {iv.label for iv in intervals} == set(problem.mfc_names)
    assert {iv.device for iv in intervals} <= set(range(8)) and all(iv.end >= iv.start for iv in intervals)
    for suffix in ("png", "svg"):
        path = draw_timeline(
            intervals, tmp_path / f"plan.{suffix}", title="PPO", boundaries=found.result.iteration_end_s
        )
        assert (tmp_path / f"plan.{suffix}").stat().st_size > 1000
    assert open(path).read().lstrip().startswith("<?xml")
    with open(tmp_path / "plan.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_measured_intervals_with_transfers_are_drawn_hatched(tmp_path):
    intervals = [
        Interval(0, 0.0, 1.0, "actor_gen"),
        Interval(1, 0.0, 1.0, "actor_gen"),
        Interval(0, 1.0, 1.2, "actor_train", kind="realloc"),
        Interval(1, 1.2, 3.0, "actor_train", kind="call", iteration=0),
    ]
    draw_timeline(intervals, tmp_path / "measured.svg", num_devices=2)
    svg = (tmp_path / "measured.svg").read_text()
    assert "weight reallocation" in svg and "actor_train" in svg  # legend entries
    with pytest.raises(ValueError, match="kind='compute'"):
        Interval(0, 0.0, 1.0, "x", kind="compute")
    with pytest.raises(ValueError, match="ends"):
        Interval(0, 2.0, 1.0, "x")
