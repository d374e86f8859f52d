"""The Hopper presets' decode dispatch and fp32 rate against what rlflow's built-in sampler
measured on an H200.

``benchmarks/measured/gpu_overheads_h200.jsonl`` holds the output of ``python -m
benchmarks.bench_gpu_overheads`` on four machines of the H200 kind lent to this project (``run``
1-4; docs/benchmarks.md, "GPU overheads"). The per-layer and per-step decode dispatch of the
``h100-80g`` and ``h200`` presets are the line through its narrow models' steps; the cost model's
price of a decode step of 7B-class layers on the ``h200`` preset (the sampler's fp32 copy) is held
to its measurements within the calibration's 25%; a rollout engine that replays its decode as a
CUDA graph (vLLM) is priced without dispatch. On a GPU host, the gpu-marked test measures one such
step again and holds the price to it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench_gpu_overheads import DECODE_PROMPT, GEN_LONG, GEN_SHORT
from rlflow.dataflow import algorithm_mfcs
from rlflow.planner.cluster import (
    HOPPER_DECODE_LAYER_DISPATCH_S,
    HOPPER_DECODE_STEP_DISPATCH_S,
    HOPPER_FP32_PEAK_FLOPS,
    cluster_preset,
)
from rlflow.planner.cost import Workload, call_cost
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec
from rlflow.strategy import ParallelStrategy

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "measured" / "gpu_overheads_h200.jsonl"
RECORDS = [json.loads(line) for line in MEASURED.read_text().splitlines()]
CHECKS = {f"run{r['run']}-{r['name']}": r for r in RECORDS if r["name"].startswith("gpu_decode_")}
MAX_ERROR = 0.25  # the calibration's bound against published points


def _priced_step_s(check: dict, cluster) -> float:
    """The cost model's seconds per decode step of ``check``'s model and rows, as the benchmark
    measures it: the call at the long generation minus the call at the short one, per extra step."""
    model = ModelSpec(
        num_layers=check["num_layers"], hidden_size=check["hidden_size"], intermediate_size=check["intermediate_size"],
        num_heads=check["num_heads"], num_kv_heads=check["num_heads"], vocab_size=check["vocab_size"],
    )  # fmt: skip
    gen = algorithm_mfcs("grpo")[0]
    assert gen.interface_type == "generate"
    seconds = [
        call_cost(
            gen, model, ParallelStrategy(), DeviceMesh(1, 1), cluster,
            Workload(batch_size=check["rows"], prompt_len=check["prompt_len"], gen_len=g),
        ).time_s
        for g in (GEN_SHORT, GEN_LONG)
    ]  # fmt: skip
    return (seconds[1] - seconds[0]) / (GEN_LONG - GEN_SHORT)


def _sampler_cluster():
    """One H200 as the built-in sampler runs on it: the fp32 copy it is given."""
    return cluster_preset("h200", 1, 1).with_precision(rollout_bytes=4)


def test_the_hopper_dispatch_is_the_line_through_every_measured_step():
    narrow = [r for r in RECORDS if r["name"].startswith("gpu_overheads_l")]
    assert {r["run"] for r in narrow} == {1, 2, 3, 4} and len(narrow) == 12
    slope, intercept = np.polyfit([r["layers"] for r in narrow], [r["decode_step_s"] for r in narrow], 1)
    assert HOPPER_DECODE_LAYER_DISPATCH_S == pytest.approx(slope, rel=0.01)
    assert HOPPER_DECODE_STEP_DISPATCH_S == pytest.approx(intercept, rel=0.01)
    for preset in ("h100-80g", "h200"):
        cluster = cluster_preset(preset)
        assert cluster.decode_layer_dispatch_s == HOPPER_DECODE_LAYER_DISPATCH_S
        assert cluster.decode_step_dispatch_s == HOPPER_DECODE_STEP_DISPATCH_S
        assert cluster.fp32_peak_flops == HOPPER_FP32_PEAK_FLOPS


def test_fp32_matmuls_sustain_the_share_of_their_peak_that_bf16_does():
    rates = [r for r in RECORDS if r["name"] == "gpu_matmul_rates"]
    assert rates and all(not r["tf32_allowed"] for r in rates)
    h200 = cluster_preset("h200")
    for r in rates:
        fp32, bf16 = r["fp32_square_flops"] / HOPPER_FP32_PEAK_FLOPS, r["bf16_square_flops"] / h200.peak_flops
        assert fp32 == pytest.approx(bf16, rel=0.1)
        assert fp32 == pytest.approx(h200.matmul_efficiency, rel=0.1)
    assert h200.fp32_flops == pytest.approx(HOPPER_FP32_PEAK_FLOPS * h200.matmul_efficiency)


@pytest.mark.parametrize("key", sorted(CHECKS))
def test_a_decode_step_of_7b_class_layers_is_priced_within_25pct_of_the_h200(key):
    check = CHECKS[key]
    priced = _priced_step_s(check, _sampler_cluster())
    assert priced == pytest.approx(check["decode_step_s"], rel=MAX_ERROR), (priced, check["decode_step_s"])


def test_without_the_measured_terms_those_steps_are_priced_far_too_fast():
    # The checks have teeth: without the dispatch, or at the bf16 rate, the model misses them.
    sampler = _sampler_cluster()
    for cluster in (
        replace(sampler, decode_layer_dispatch_s=0.0, decode_step_dispatch_s=0.0),
        replace(sampler, fp32_peak_flops=None),
    ):
        misses = [_priced_step_s(c, cluster) / c["decode_step_s"] - 1 for c in CHECKS.values()]
        assert min(misses) < -MAX_ERROR, misses


def test_a_graph_replaying_engine_is_priced_without_dispatch():
    from rlflow.trainer import load_config
    from rlflow.trainer.placement import planning_cluster

    repo = Path(__file__).resolve().parents[2]
    dispatch = {}
    for engine in ("hf", "vllm"):
        cfg = load_config(repo / "recipes" / "grpo_arithmetic.yaml", [f"rollout.engine={engine}"])
        cluster = planning_cluster(cfg, use_gpu=True, profile=None)
        dispatch[engine] = (cluster.decode_layer_dispatch_s, cluster.decode_step_dispatch_s)
    assert dispatch == {"hf": (HOPPER_DECODE_LAYER_DISPATCH_S, HOPPER_DECODE_STEP_DISPATCH_S), "vllm": (0.0, 0.0)}


@pytest.mark.gpu
def test_the_price_holds_on_this_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from benchmarks.bench_gpu_overheads import DECODE_CHECKS, _decode_check

    check = _decode_check(*DECODE_CHECKS[0], "cuda")
    assert check["prompt_len"] == DECODE_PROMPT
    priced = _priced_step_s(check, _sampler_cluster())
    # Another Hopper card or host shifts the figures; the bound is the calibration's.
    assert priced == pytest.approx(check["decode_step_s"], rel=MAX_ERROR), (priced, check["decode_step_s"])
