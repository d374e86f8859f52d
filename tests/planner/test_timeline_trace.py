"""Timelines as Chrome trace-event files (Perfetto, ``chrome://tracing``): simulated by ``rlflow plan``, or given."""

from __future__ import annotations

import json

from rlflow.cli import main
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.timeline import Interval, save_timeline
from rlflow.strategy import ParallelStrategy

PLAN = "plan --algo grpo --actor llama2-7b --nodes 1 --devices-per-node 4 --batch 64 --prompt-len 128 --gen-len 128"


def complete_events(path) -> list[dict]:
    """The trace's complete events, after checking the file's shape and every event's fields."""
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["pid"], int)
    named = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {e["pid"] for e in events} == named  # every device's process is named
    return events


def test_intervals_become_one_event_each_on_their_devices_process(tmp_path):
    intervals = [
        Interval(0, 0.0, 1.0, "actor_gen", iteration=1),
        Interval(1, 0.0, 1.0, "actor_gen", iteration=1),
        Interval(0, 1.0, 1.25, "actor_train", kind="realloc", iteration=1),
        Interval(0, 1.25, 3.0, "actor_train", iteration=1),
        Interval(1, 1.25, 3.0, "actor_train", iteration=1),
    ]
    strategies = {"actor_gen": ParallelStrategy(dp=1, tp=2, pp=1), "actor_train": ParallelStrategy(dp=2, tp=1, pp=1)}
    save_timeline(intervals, tmp_path / "t.json", "measured", strategies=strategies)
    events = complete_events(tmp_path / "t.json")
    assert len(events) == len(intervals)
    assert [(e["pid"], e["ts"], e["dur"]) for e in events] == [
        (iv.device, iv.start * 1e6, (iv.end - iv.start) * 1e6) for iv in intervals
    ]
    realloc = events[2]
    assert realloc["name"] == "actor_train realloc" and realloc["tid"] != events[3]["tid"]
    assert realloc["args"] == {"mfc": "actor_train", "kind": "realloc", "step": 1, "dp": 2, "tp": 1, "pp": 1}
    assert events[0]["args"]["tp"] == 2


def test_plan_writes_its_simulated_timeline_as_a_trace(tmp_path, capsys):
    out, trace = tmp_path / "plan.json", tmp_path / "plan.trace.json"
    argv = [*PLAN.split(), "--search-steps", "200", "--chains", "1", "--no-progress", "--out", str(out)]
    assert main([*argv, "--timeline", str(trace)]) == 0
    assert f"timeline written to {trace}" in capsys.readouterr().out
    plan = ExecutionPlan.load(out)
    events = complete_events(trace)
    calls = [e for e in events if e["args"]["kind"] == "call"]
    assert {e["name"] for e in calls} == {c.name for c in plan.calls}
    assert {e["pid"] for e in events} <= set(range(4))
    for e in calls:  # one event per device the call runs on, with its strategy
        strategy = plan.call(e["name"]).strategy
        assert (e["args"]["dp"], e["args"]["tp"], e["args"]["pp"]) == (strategy.dp, strategy.tp, strategy.pp)
    steps = {e["args"]["step"] for e in calls}
    for c in plan.calls:  # each iteration simulated runs each call once on every device of its mesh
        assert (
            len([e for e in calls if e["name"] == c.name]) == len(steps) * c.strategy.dp * c.strategy.tp * c.strategy.pp
        )
