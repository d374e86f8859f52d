"""The cost model against the ReaLHF paper's measured throughput (benchmarks/bench_calibration.py).

Each published point is priced as the benchmark prices it (seeded searches of a fixed number of
proposals, so the table is reproducible) and held to the issue's goal: searched and heuristic
seconds per iteration within 25% of the paper's, the searched/heuristic ratio within 10 points
of the published one. Points the model does not reach are strict xfails that name why: the day
the model reaches them, the test says so and the table must be updated.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from benchmarks.bench_calibration import (
    MAX_ERROR,
    MAX_RATIO_POINTS,
    PROMPT_LEN,
    PUBLISHED,
    calibrate,
    realhf_forward_flops,
    realhf_generate_flops,
    realhf_iteration_flops,
    table6,
)
from rlflow.dataflow import algorithm_mfcs
from rlflow.planner.cluster import (
    A100_DECODE_LAYER_DISPATCH_S,
    METASEQ_EAGER_TOKEN_S,
    METASEQ_GRAPH_TOKEN_S,
    cluster_preset,
)
from rlflow.planner.cost import Workload, call_cost
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec, model_preset
from rlflow.planner.passes import Rates, StagePass, stage_pass_s
from rlflow.strategy import ParallelStrategy

POINTS = {p.key: p for p in PUBLISHED}
_TP8_DECODE_WHY = (
    "tp=8 decode: rlflow prices a step of the heuristic's tp=8 generation at ~24 ms (metaseq's eager latencies), "
    "the paper's slope is ~40 ms at 8 GPUs and 55-66 ms per token pipelined over 8 hosts"
)
TIMES_MISSED = {
    "64gpu-7b+70b-gen896": "heuristic 34% too fast: " + _TP8_DECODE_WHY,
}
RATIOS_MISSED = {
    "8gpu-7b+7b-gen896": _TP8_DECODE_WHY,
    "64gpu-7b+70b-gen128": (
        "+16 points: rlflow's searched plan (generation dp=32 x tp=2 on all 64 GPUs, the 70B critic at pp=8 "
        "with dp inside hosts) is 10% faster than the paper's while its heuristic is 3% slower"
    ),
    "64gpu-7b+70b-gen896": _TP8_DECODE_WHY,
}


@functools.cache
def _row(key: str) -> dict:
    return calibrate(POINTS[key])


def _marked(missed: dict[str, str]):
    return [
        pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=missed[k])) if k in missed else k for k in POINTS
    ]


def test_realhf_flop_count_is_the_monitors_loop_and_above_the_plain_count():
    m = model_preset("llama2-7b")
    h, i, v, layers = m.hidden_size, m.intermediate_size, m.vocab_size, m.num_layers
    batch, prompt, gen = 3, 5, 4
    loop = realhf_forward_flops(m, batch, prompt)
    for step in range(gen):  # ReaLHF's calculate_llama_gen_flops, step by step
        prefix = batch * (prompt + step)
        loop += 2 * layers * (4 * batch * h**2 + 2 * (prefix + batch) * h + 3 * batch * h * i) + 4 * batch * v * h
    assert realhf_generate_flops(m, batch, prompt, gen) == loop
    for point in PUBLISHED:  # the issue: 1.2-1.4x the plain 2N (forward, generation) / 6N (training) count
        actor, critic = model_preset(point.actor), model_preset(point.critic)
        tokens = point.batch * (PROMPT_LEN + point.gen_len)
        plain = tokens * (
            2 * actor.num_params * 2 + 2 * critic.num_params * 2 + 6 * (actor.num_params + critic.num_params)
        )
        assert 1.2 <= realhf_iteration_flops(point) / plain <= 1.45


def test_a100_decode_latencies_reproduce_their_source():
    # metaseq's OPT-175B on 8 A100-40GB, tp=8, one row: ~95 ms per token eager, ~66 ms as a CUDA graph.
    # A Llama-shaped layer with intermediate 8h/3 has OPT's 12 h^2 matmul parameters.
    opt = ModelSpec(num_layers=96, hidden_size=12288, intermediate_size=32768, num_heads=96, num_kv_heads=96,
                    vocab_size=50272)  # fmt: skip
    eager = replace(cluster_preset("a100-80g"), mem_bandwidth=1.555e12, decode_kv_passes=1)
    graph = replace(eager, decode_layer_dispatch_s=0.0)
    gen, steps = algorithm_mfcs("ppo")[0], 64
    work = Workload(batch_size=1, prompt_len=8, gen_len=steps + 1)
    per_token = {
        name: call_cost(gen, opt, ParallelStrategy(tp=8), DeviceMesh(1, 8), c, work).breakdown["decode_s"] / steps
        for name, c in (("eager", eager), ("graph", graph))
    }
    assert per_token["eager"] == pytest.approx(METASEQ_EAGER_TOKEN_S, rel=0.1)
    assert per_token["graph"] == pytest.approx(METASEQ_GRAPH_TOKEN_S, rel=0.1)
    assert per_token["eager"] - per_token["graph"] == pytest.approx(96 * A100_DECODE_LAYER_DISPATCH_S)


@pytest.mark.parametrize("key", _marked(TIMES_MISSED))
def test_iteration_times_within_25pct_of_the_paper(key):
    row = _row(key)
    assert abs(row["error_searched_pct"]) <= 100 * MAX_ERROR, row
    assert abs(row["error_heuristic_pct"]) <= 100 * MAX_ERROR, row


@pytest.mark.parametrize("key", _marked(RATIOS_MISSED))
def test_searched_over_heuristic_within_10_points_of_the_paper(key):
    row = _row(key)
    assert abs(row["ratio_diff_points"]) <= MAX_RATIO_POINTS, row


def test_the_gain_grows_with_generation_length_at_8_gpus():
    # The symptom: rlflow's gain over the heuristic fell from +61% at gen 128 to +36% at gen 896
    # while the paper's rose; with the decode latencies it no longer falls by more than a few points.
    ratios = [_row(p.key)["rlflow_ratio"] for p in PUBLISHED if p.gpus == 8]
    assert ratios[-1] >= ratios[0] - 0.03, ratios


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(
            "64gpu-7b+70b-gen128",
            marks=pytest.mark.xfail(
                strict=True,
                reason="at gen 128 the searched plan runs every call on all 64 GPUs (generation dp=32 x tp=2)",
            ),
        ),
        "64gpu-7b+70b-gen384",
        "64gpu-7b+70b-gen896",
    ],
)
def test_generation_shares_few_gpus_with_the_70b_critic_as_in_table4(key):
    # Table 4 (64 GPUs): actor generation and training on 8 GPUs, the 70B critic's training on 56.
    gpus = _row(key)["gpus_per_call"]
    assert gpus[0] < gpus[5] and gpus[4] < gpus[5], (key, gpus)


def test_lockstep_pipeline_prices_realhfs_schedule():
    # ReaLHF's TrainSchedule with blocking sends: every micro-batch's forward waits as long as a
    # neighbour's backward; its pipelined generation runs pp - 1 tokens more.
    a100 = cluster_preset("a100-80g", num_nodes=2)
    lockstep = replace(a100, pipeline_lockstep=True)
    model, mesh, strategy = model_preset("llama2-7b"), DeviceMesh(2, 8), ParallelStrategy(dp=1, tp=8, pp=2)
    gen, train = algorithm_mfcs("ppo")[0], algorithm_mfcs("ppo")[4]
    work = Workload(batch_size=64, prompt_len=128, gen_len=128)
    free, locked = (call_cost(train, model, strategy, mesh, c, work) for c in (a100, lockstep))
    assert train.interface_type == "train_step" and locked.time_s > free.time_s
    n_mbs, mb, s = 4, 4, 256  # 2 x pp micro-batches of the mini-batch's 16 sequences of 256 tokens
    one = StagePass(mb, s, s * (s + 1) / 2, 2, 0, mb * s)
    fwd = float(stage_pass_s(model, strategy, a100, Rates(a100), one))
    bwd = float(stage_pass_s(model, strategy, a100, Rates(a100), one, backward=True)) + fwd  # with recompute
    extra = (locked.breakdown["compute_s"] - free.breakdown["compute_s"]) / work.n_ppo_minibatches
    assert extra == pytest.approx(n_mbs * (bwd - fwd))
    steps = {
        c.pipeline_lockstep: call_cost(gen, model, strategy, mesh, c, work).breakdown["decode_s"]
        for c in (a100, lockstep)
    }
    assert steps[True] / steps[False] == pytest.approx((128 - 1 + 1) / (128 - 1), rel=0.02)
    flat = ParallelStrategy(dp=1, tp=8, pp=1)  # no pipeline, nothing changes
    assert call_cost(train, model, flat, DeviceMesh(1, 8), lockstep.with_shape(1), work).time_s == pytest.approx(
        call_cost(train, model, flat, DeviceMesh(1, 8), a100.with_shape(1), work).time_s
    )


def test_table6_plan_is_an_option_and_the_search_beats_it():
    row = table6()
    assert row["paper_plan_infeasible"] is None, row
    assert row["rlflow_s_searched"] <= row["rlflow_s_paper_plan"] <= row["rlflow_s_heuristic"], row
