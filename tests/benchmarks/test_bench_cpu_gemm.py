"""benchmarks/bench_cpu_gemm.py runs end to end on a small model and reports both BLASes' figures."""

from __future__ import annotations

import pytest

from benchmarks import bench_cpu_gemm
from rlflow.engine.cpu_gemm import openblas_blocker


@pytest.mark.skipif(openblas_blocker() is not None, reason=str(openblas_blocker()))
def test_cpu_gemm_benchmark_reports_every_product_and_the_step(monkeypatch):
    for name, value in dict(
        HIDDEN=32, LAYERS=1, HEADS=2, MLP=64, VOCAB=32, ROWS=2, SEQ=8, ROUNDS=2, STEP_ROUNDS=2
    ).items():
        monkeypatch.setattr(bench_cpu_gemm, name, value)
    records = {r["name"]: r for r in bench_cpu_gemm.run()}
    assert records["cpu_gemm_auto"]["resolves_to"] in ("openblas", "torch")
    for threads in (1, 2):
        for kind in ("forward", "input_grad", "weight_grad"):
            for shape in ("32_32", "32_64", "64_32"):
                record = records[f"{kind}_{shape}_{threads}t"]
                assert record["torch_gflop_per_s"] > 0 and record["openblas_gflop_per_s"] > 0 and record["speedup"] > 0
    assert records["forward_32_64_1t"]["m_k_n"] == [16, 32, 64]  # 2 rows of 8 tokens, 32 -> 64
    assert records["weight_grad_32_64_1t"]["m_k_n"] == [64, 16, 32]
    assert records["forward_backward_2t"]["torch_s"] > 0 and records["forward_backward_2t"]["openblas_s"] > 0
