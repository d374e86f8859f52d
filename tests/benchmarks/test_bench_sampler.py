"""benchmarks/bench_sampler.py runs end to end on a small case and its contenders agree."""

from __future__ import annotations

import os

from benchmarks import bench_sampler


def test_sampler_benchmark_records_agree():
    case = {**bench_sampler.CASES["issue12_task_h64_l2"], "prompts": 2, "samples": 2, "new_tokens": 6}
    records = bench_sampler.run(
        repeats=1, cases={"small": case}, step_widths=((64, 8),), step_repeats=1, step_threads=(1, 2), decode=False
    )  # the decode records: tests/benchmarks/test_decode_sides.py
    records, steps = records[:2], records[2:]
    assert [r["decoding"] for r in records] == ["sampled, temperature 1", "greedy"]
    assert [step["threads"] for step in steps] == [n for n in (1, 2) if n <= (os.cpu_count() or 1)]
    for step in steps:
        assert step["rows"] == 8 and step["seconds_native"] > 0 and step["seconds_torch_twin"] > 0
        assert step["decoded_natively_by_default"] and step["kernels"] in (0, 1, 2)
    for record in records:
        assert record["rows"] == 4 and record["new_tokens_per_row"] == 6
        assert all(record[f"seconds_{name}"] > 0 for name in bench_sampler.CONTENDERS)
        assert all(record[f"cpu_seconds_{name}"] > 0 for name in bench_sampler.CONTENDERS)
        assert (
            record["same_tokens_as_hf_modules"] and record["same_tokens_as_torch_twin"]
        )  # the same draws on all paths
        assert record["max_logp_diff_vs_hf_modules"] < 1e-4
    assert records[1]["same_tokens_as_generate"]
