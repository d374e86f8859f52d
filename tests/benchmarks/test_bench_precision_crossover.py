"""benchmarks/bench_precision_crossover.py runs end to end on small shapes and says what ``auto`` picks."""

from __future__ import annotations

from benchmarks import bench_precision_crossover


def test_the_crossover_benchmark_times_both_precisions_and_names_autos_choice(monkeypatch):
    monkeypatch.setattr(bench_precision_crossover, "SHAPES", [("small", 32, 1, 2, 2, 4, 3)])
    monkeypatch.setattr(bench_precision_crossover, "REPEATS", 1)
    records = {r["name"]: r for r in bench_precision_crossover.run()}
    for call in ("train", "generate"):
        record = records[f"crossover_{call}_small"]
        assert record["fp32_s"] > 0 and record["bf16_s"] > 0 and record["speedup"] > 0
        assert record["auto"] == "float32" and record["pass_work"] == (4 * 32 * 32 + 3 * 32 * 128) * 4 * 7
