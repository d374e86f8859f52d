"""Drawing dataflow graphs to PNG and SVG."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from rlflow.dataflow import algorithm_graph, draw, unroll_graph


def test_draw_writes_a_png_and_an_svg(tmp_path):
    g = algorithm_graph("ppo")
    png = draw(g, tmp_path / "ppo.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    svg = draw(unroll_graph(g, 2), tmp_path / "sub" / "ppo.svg", title="PPO, 2 iterations")
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg") and svg.stat().st_size > 20_000
    # one drawn path per node and edge at least
    assert sum(1 for el in root.iter() if el.tag.endswith("path")) > 12 + 2 * 11


def test_draw_rejects_unknown_formats(tmp_path):
    with pytest.raises(ValueError, match=r"'g.gif'.*\.png"):
        draw(algorithm_graph("sft"), tmp_path / "g.gif")


def test_drawing_leaves_the_matplotlib_backend_alone(tmp_path):
    """A notebook's inline backend must survive rlflow's drawings (they use no pyplot state)."""
    import matplotlib

    from rlflow.planner.timeline import Interval, draw_timeline

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        draw(algorithm_graph("grpo"), tmp_path / "g.png")
        draw_timeline([Interval(device=0, start=0.0, end=1.0, label="actor_gen")], tmp_path / "t.png")
        assert matplotlib.get_backend() == "svg"
        assert (tmp_path / "g.png").stat().st_size > 0 and (tmp_path / "t.png").stat().st_size > 0
    finally:
        matplotlib.use(before)
