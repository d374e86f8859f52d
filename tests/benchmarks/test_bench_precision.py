"""benchmarks/bench_precision.py runs end to end on a small model and reports every figure it names."""

from __future__ import annotations

from benchmarks import bench_precision


def test_precision_benchmark_reports_limits_and_both_precisions(monkeypatch):
    for name, value in dict(HIDDEN=64, LAYERS=1, HEADS=2, MLP=128, VOCAB=64, ROWS=2, PROMPT=4, NEW=3).items():
        monkeypatch.setattr(bench_precision, name, value)
    monkeypatch.setattr(bench_precision, "_copy_bytes_per_s", lambda nbytes=1 << 20: 1e9)
    monkeypatch.setattr(bench_precision, "_matmul_flops", lambda dtype, threads, n=64: 1e9 * threads)
    records = {r["name"]: r for r in bench_precision.run()}
    for precision in ("fp32", "bf16"):
        assert records[f"train_step_21m_{precision}"]["seconds"] > 0
        assert records[f"train_step_21m_{precision}"]["gflop_per_s"] > 0
        assert records[f"generate_21m_{precision}"]["tokens_per_s"] > 0
        assert records[f"matmul_2048_{precision}_2t"]["gflop_per_s"] == 2.0
    assert records["attention_fwd_bwd_bf16"]["seconds"] > 0 and records["attention_fwd_bwd_fp32"]["seconds"] > 0
    assert records["decode_projection_bf16"]["plain_us"] > 0
    assert records["train_step_21m_bf16_speedup"]["ratio"] > 0
    assert records["generate_21m_bf16_speedup"]["ratio"] > 0
