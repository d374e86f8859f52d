"""Call costs: hand checks against FLOP and byte counts, and monotonicity."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.dataflow import MFCDef, algorithm_mfcs
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.cost import Workload, call_cost, collective_s, estimate_call
from rlflow.planner.mesh import DeviceMesh, ParallelStrategy
from rlflow.planner.model_spec import ModelSpec, model_preset

S = ParallelStrategy
GEN, CRITIC_INF, REF, _, TRAIN, _ = algorithm_mfcs("ppo")
A100 = cluster_preset("a100-80g", num_nodes=2)
LLAMA7B = model_preset("llama2-7b")
PAPER = Workload(batch_size=512, prompt_len=128, gen_len=128)  # 2^17 tokens per iteration


def test_training_time_is_eight_flops_per_parameter_and_token():
    # forward 2, backward 4, recomputation 2 FLOPs per parameter and token, at 80.7 % of 312 TFLOP/s
    c = call_cost(TRAIN, LLAMA7B, S(dp=8), DeviceMesh(1, 8), A100, PAPER)
    tokens = 512 * 256
    ideal = 8 * LLAMA7B.num_params * tokens / (8 * A100.flops)
    assert ideal < c.time_s < 1.15 * ideal  # attention, head, optimizer and FSDP on top
    no_ckpt = call_cost(
        TRAIN, LLAMA7B, S(dp=8), DeviceMesh(1, 8), A100, dataclasses.replace(PAPER, gradient_checkpointing=False)
    )
    assert no_ckpt.time_s == pytest.approx(c.time_s * 6 / 8, rel=0.05)
    assert no_ckpt.act_bytes > c.act_bytes


def test_small_batch_decoding_is_bound_by_reading_the_weights():
    one = Workload(batch_size=1, prompt_len=16, gen_len=100)
    c = call_cost(GEN, LLAMA7B, S(), DeviceMesh(1, 1), A100, one)
    per_step = 2 * LLAMA7B.num_params / A100.bandwidth
    assert c.breakdown["decode_s"] == pytest.approx(100 * per_step, rel=0.02)


@pytest.mark.parametrize("mfc", [GEN, REF, TRAIN], ids=["generate", "inference", "train"])
def test_more_devices_take_less_time(mfc):
    times = [call_cost(mfc, LLAMA7B, S(dp=n), DeviceMesh(1, n), A100, PAPER).time_s for n in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 4


def test_tensor_parallelism_pays_all_reduces():
    slow_links = dataclasses.replace(A100, intra_host_bandwidth=A100.intra_host_bandwidth / 100)
    for mfc in (GEN, REF, TRAIN):
        tp = [call_cost(mfc, LLAMA7B, S(tp=2), DeviceMesh(1, 2), c, PAPER).time_s for c in (A100, slow_links)]
        assert tp[1] > tp[0]
    for mfc in (GEN, REF):  # data parallelism without training communicates nothing
        dp = [call_cost(mfc, LLAMA7B, S(dp=2), DeviceMesh(1, 2), c, PAPER).time_s for c in (A100, slow_links)]
        assert dp[1] == dp[0]
    # FSDP's gathers hide under compute on NVLink, not on a link 100x slower
    fsdp = [call_cost(TRAIN, LLAMA7B, S(dp=2), DeviceMesh(1, 2), c, PAPER) for c in (A100, slow_links)]
    assert fsdp[0].breakdown["fsdp_exposed_s"] < 0.01 * fsdp[0].time_s < fsdp[1].breakdown["fsdp_exposed_s"]
    # ring all-reduce: 2(n-1)/n * bytes / bw plus NCCL latencies
    assert collective_s(A100, 1e9, 4, False) == pytest.approx(
        A100.collective_latency_s + 6 * A100.intra_host_latency_s + 1.5 * 1e9 / A100.intra_host_bandwidth
    )
    assert collective_s(A100, 1e9, 1, False) == 0


def test_pipeline_bubble_is_pp_minus_one_over_microbatches():
    # a model without heavy embedding/head and a cluster with free communication: pure compute
    m = ModelSpec(
        num_layers=8,
        hidden_size=1024,
        intermediate_size=4096,
        num_heads=8,
        num_kv_heads=8,
        vocab_size=8,
        value_head=True,
    )
    free = dataclasses.replace(A100, intra_host_bandwidth=1e30, collective_latency_s=0, intra_host_latency_s=0)
    w = Workload(batch_size=64, prompt_len=256, gen_len=0, max_tokens_per_mb=None)
    for n_mbs in (2, 8):
        mfc = MFCDef("ref", "ref", "inference", n_mbs=n_mbs)
        one = call_cost(mfc, m, S(), DeviceMesh(1, 1), free, w).time_s
        four = call_cost(mfc, m, S(pp=4), DeviceMesh(1, 4), free, w).time_s
        # ideal one/4 stretched by (n_mbs + pp - 1) / n_mbs
        assert four == pytest.approx(one / 4 * (n_mbs + 3) / n_mbs, rel=0.03)


def test_estimate_call_matches_call_cost_and_checks_the_mesh():
    t, act = estimate_call(CRITIC_INF, LLAMA7B.as_value_model(), S(dp=2, tp=2), DeviceMesh(1, 4), A100, PAPER)
    c = call_cost(CRITIC_INF, LLAMA7B.as_value_model(), S(dp=2, tp=2), DeviceMesh(1, 4), A100, PAPER)
    assert (t, act) == (c.time_s, c.act_bytes) and t > 0 and act > 0
    with pytest.raises(ValueError, match="does not fill mesh"):
        call_cost(REF, LLAMA7B, S(dp=2), DeviceMesh(1, 4), A100, PAPER)


def test_workload_resolves_sequences_and_minibatches():
    w = Workload(batch_size=8, prompt_len=4, gen_len=4, n_samples_per_prompt=4, n_ppo_minibatches=2)
    assert w.n_seqs(GEN) == 32 and w.n_seqs(MFCDef("x", "a", "inference", n_seqs=5)) == 5
    assert w.n_minibatches(TRAIN) == 2 and w.n_minibatches(REF) == 1
    with pytest.raises(ValueError, match="batch_size=0"):
        Workload(batch_size=0, prompt_len=1, gen_len=1)
