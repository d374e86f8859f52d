"""benchmarks/bench_multi_turn.py runs end to end at a tiny size and its record holds every mode's figures."""

from __future__ import annotations

import pytest

from benchmarks import bench_multi_turn


def test_multi_turn_benchmark_record_has_every_mode_and_every_episode_made_its_calls():
    (record,) = bench_multi_turn.run(repeats=1, episodes=3, calls=2, new_tokens=3, cases={"tiny": (0.0, 0.01)})
    assert record["name"] == "multi_turn_tiny" and record["tool_latency"] == "uniform 0-10 ms"
    assert record["episodes"] == 3 and record["tool_calls_per_episode"] == 2
    assert 0.0 < record["tool_seconds_total"] < 0.06
    for mode in bench_multi_turn.MODES:
        assert record[f"seconds_{mode}"] > 0
        assert record["turns_per_episode"][mode] == 3.0  # two calls, then the answer
        assert record["tool_calls_per_episode_done"][mode] == 2.0
    for mode in bench_multi_turn.MODES[1:]:
        added = record[f"seconds_{mode}"] - record["seconds_decode_only"]
        assert record[f"added_seconds_{mode}"] == pytest.approx(added, abs=1.5e-3)  # each rounded to 1 ms
    assert set(record["units"]) == {"seconds", "added_seconds"}
