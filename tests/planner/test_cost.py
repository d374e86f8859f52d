"""Call costs: hand checks against FLOP and byte counts, and monotonicity."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.dataflow import MFCDef, algorithm_mfcs
from rlflow.planner.cluster import GPU_PRECISION, cluster_preset
from rlflow.planner.cost import Workload, call_cost, collective_s, estimate_call
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec, model_preset
from rlflow.planner.passes import Rates, head_s
from rlflow.planner.profile import HardwareProfile
from rlflow.strategy import ParallelStrategy

S = ParallelStrategy
GEN, CRITIC_INF, REF, _, TRAIN, _ = algorithm_mfcs("ppo")
A100 = cluster_preset("a100-80g", num_nodes=2)
LLAMA7B = model_preset("llama2-7b")
PAPER = Workload(batch_size=512, prompt_len=128, gen_len=128)  # 2^17 tokens per iteration
CPU_HW = {"matmul_flops": 2e10, "memcpy_bandwidth": 1e10, "loopback_bandwidth": 5e8, "loopback_latency_s": 4e-5,
          "host_memory_bytes": 16e9}  # fmt: skip


def test_training_time_is_eight_flops_per_parameter_and_token():
    # forward 2, backward 4, recomputation 2 FLOPs per parameter and token, at 80.7 % of 312 TFLOP/s
    c = call_cost(TRAIN, LLAMA7B, S(dp=8), DeviceMesh(1, 8), A100, PAPER)
    tokens = 512 * 256
    ideal = 8 * LLAMA7B.num_params * tokens / (8 * A100.flops)
    # attention, the element-wise kernels at memory bandwidth, head, optimizer and FSDP on top
    assert ideal < c.time_s < 1.2 * ideal
    no_ckpt = call_cost(
        TRAIN, LLAMA7B, S(dp=8), DeviceMesh(1, 8), A100, dataclasses.replace(PAPER, gradient_checkpointing=False)
    )
    assert no_ckpt.time_s == pytest.approx(c.time_s * 6 / 8, rel=0.05)
    assert no_ckpt.act_bytes > c.act_bytes


def test_small_batch_decoding_is_bound_by_reading_the_weights():
    one = Workload(batch_size=1, prompt_len=16, gen_len=100)
    graph = dataclasses.replace(A100, decode_layer_dispatch_s=0.0)  # no host launch per layer
    c = call_cost(GEN, LLAMA7B, S(), DeviceMesh(1, 1), graph, one)
    # bf16 generation on a GPU preset; the prefill's logits give the first of the 100 tokens, so
    # 99 decode steps each read every weight but the embedding table once
    per_step = 2 * (LLAMA7B.num_params - LLAMA7B.embedding_params) / A100.bandwidth
    assert c.breakdown["decode_s"] == pytest.approx(99 * per_step, rel=0.02)
    # the HF sampler runs the fp32 copy it is given: twice the bytes
    hf = call_cost(GEN, LLAMA7B, S(), DeviceMesh(1, 1), graph.with_precision(rollout_bytes=4), one)
    assert hf.breakdown["decode_s"] == pytest.approx(99 * 2 * per_step, rel=0.02)
    # eager: the host launches every layer's kernels at every step
    eager = call_cost(GEN, LLAMA7B, S(), DeviceMesh(1, 1), A100, one).breakdown["decode_s"]
    assert eager - c.breakdown["decode_s"] == pytest.approx(99 * 32 * A100.decode_layer_dispatch_s)


@pytest.mark.parametrize("mfc", [GEN, REF, TRAIN], ids=["generate", "inference", "train"])
def test_more_devices_take_less_time(mfc):
    times = [call_cost(mfc, LLAMA7B, S(dp=n), DeviceMesh(1, n), A100, PAPER).time_s for n in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 4


def test_tensor_parallelism_pays_all_reduces():
    slow_links = dataclasses.replace(A100, intra_host_bandwidth=A100.intra_host_bandwidth / 100)
    for mfc in (GEN, REF, TRAIN):
        tp = [call_cost(mfc, LLAMA7B, S(tp=2), DeviceMesh(1, 2), c, PAPER).time_s for c in (A100, slow_links)]
        assert tp[1] > tp[0]
    # a dp-replicated generation communicates nothing; a forward call runs on FSDP and gathers weights
    gen = [call_cost(GEN, LLAMA7B, S(dp=2), DeviceMesh(1, 2), c, PAPER).time_s for c in (A100, slow_links)]
    assert gen[1] == gen[0]
    ref = [call_cost(REF, LLAMA7B, S(dp=2), DeviceMesh(1, 2), c, PAPER) for c in (A100, slow_links)]
    assert ref[1].time_s > ref[0].time_s and ref[1].breakdown["fsdp_exposed_s"] > ref[0].breakdown["fsdp_exposed_s"]
    # FSDP's gathers hide under compute on NVLink, not on a link 100x slower
    fsdp = [call_cost(TRAIN, LLAMA7B, S(dp=2), DeviceMesh(1, 2), c, PAPER) for c in (A100, slow_links)]
    assert fsdp[0].breakdown["fsdp_exposed_s"] < 0.01 * fsdp[0].time_s < fsdp[1].breakdown["fsdp_exposed_s"]
    # ring all-reduce: 2(n-1)/n * bytes / bw plus NCCL latencies
    assert collective_s(A100, 1e9, 4, False) == pytest.approx(
        A100.collective_latency_s + 6 * A100.intra_host_latency_s + 1.5 * 1e9 / A100.intra_host_bandwidth
    )
    assert collective_s(A100, 1e9, 1, False) == 0


def test_fsdp_on_cpu_workers_runs_one_exposed_collective_per_unit():
    """Gloo's threads share the cores the CPU workers compute on: FSDP's collectives are not
    hidden, and each FSDP unit (every decoder layer and the root) pays its own latency. Measured
    on the 2-core sandbox: the main job's dp=2 training step (4 layers, 128 rows per rank) spent
    35-75 ms in gloo all-gathers and all-reduces (torch.profiler); priced as one collective for
    the whole stage hidden under compute, it was 0.75 ms, and is 31 ms now."""
    cpu = dataclasses.replace(
        cluster_preset("cpu", 1, 2, profile=HardwareProfile(**CPU_HW)),
        intra_host_bandwidth=1e30,
        collective_latency_s=2e-3,
    )
    assert cpu.comm_overlaps_compute is False and A100.comm_overlaps_compute is True
    per_collective = cpu.collective_latency_s + cpu.intra_host_latency_s  # a ring of two: one step
    w = Workload(batch_size=64, prompt_len=16, gen_len=8, n_ppo_minibatches=2)
    for layers in (2, 4):
        m = ModelSpec(num_layers=layers, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4,
                      vocab_size=256)  # fmt: skip
        c = call_cost(TRAIN, m, S(dp=2), DeviceMesh(1, 2), cpu, w)
        # per mini-batch: a gather in forward, again in backward, a reduce-scatter; per unit
        assert c.breakdown["fsdp_exposed_s"] == pytest.approx(2 * 3 * (layers + 1) * per_collective)
        # and three scalar all-reduces per optimizer step (ring of two: two steps each)
        sync = 3 * (cpu.collective_latency_s + 2 * cpu.intra_host_latency_s)
        assert c.breakdown["sync_s"] == pytest.approx(2 * sync)
        ref = call_cost(REF, m, S(dp=2), DeviceMesh(1, 2), cpu, w)
        assert ref.breakdown["fsdp_exposed_s"] == pytest.approx((layers + 1) * per_collective)
        one = call_cost(TRAIN, m, S(), DeviceMesh(1, 1, devices_per_node=2), cpu, w)
        assert one.breakdown["fsdp_exposed_s"] == one.breakdown["sync_s"] == 0


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


def test_generate_micro_batches_decode_in_turn_at_most_one_per_prompt():
    # An MFC's n_mbs at pp = 1: the sampler decodes groups of whole prompts one after another,
    # so each group's steps read the weights again; more groups than prompts is one per prompt.
    w = Workload(batch_size=8, prompt_len=128, gen_len=64, n_samples_per_prompt=4)
    decode = {
        n: call_cost(dataclasses.replace(GEN, n_mbs=n), LLAMA7B, S(), DeviceMesh(1, 1), A100, w).breakdown["decode_s"]
        for n in (None, 1, 2, 8, 64)
    }
    assert decode[None] == decode[1]
    assert 1.5 * decode[1] < decode[2] < 2 * decode[1]  # weight-bound steps: twice the reads, half the rows each
    assert decode[64] == decode[8]  # 8 prompts on the rank


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


def test_the_lm_head_all_gathers_its_logits_and_every_rank_runs_the_full_softmax():
    m = ModelSpec(num_layers=1, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=1000)
    rates, tokens = Rates(A100), 32
    # tp=2, bf16: each rank multiplies by its 500-row shard, then gathers the (32, 1000) bf16 logits
    flops, weights, io = 2 * 64 * 500 * tokens, 64 * 500 * 2, tokens * (64 + 500) * 2
    matmul = max(flops / A100.flops, (weights + io) / A100.bandwidth)
    gather_bytes = tokens * 1000 * 2
    gather = A100.collective_latency_s + A100.intra_host_latency_s + gather_bytes / 2 / A100.intra_host_bandwidth
    softmax = 6 * tokens * 1000 * 4 / A100.bandwidth  # fp32 log-softmax and entropy over the full vocabulary
    assert head_s(m, 2, tokens, 2, A100, rates) == pytest.approx(matmul + gather + softmax, rel=1e-12)
    # the softmax is not split by tp: however large tp, the head costs at least the full-vocabulary softmax
    assert head_s(m, 8, tokens, 2, A100, rates) > softmax


def test_generation_prefills_the_prompts_once_and_decodes_gen_len_minus_one_steps():
    model = model_preset("llama2-7b")
    grouped = Workload(batch_size=16, prompt_len=128, gen_len=64, n_samples_per_prompt=8)
    single = Workload(batch_size=128, prompt_len=128, gen_len=64)
    a = call_cost(GEN, model, S(dp=8), DeviceMesh(1, 8), A100, grouped).breakdown
    b = call_cost(GEN, model, S(dp=8), DeviceMesh(1, 8), A100, single).breakdown
    # 2 prompts per rank instead of 16: the prefill is close to 8x cheaper; the decode is the same
    assert a["decode_s"] == b["decode_s"] and 6 < b["prefill_s"] / a["prefill_s"] < 8.5
    assert a["kv_repeat_s"] > 0 == b["kv_repeat_s"]
    one_token = call_cost(GEN, model, S(dp=8), DeviceMesh(1, 8), A100, dataclasses.replace(single, gen_len=1))
    assert one_token.breakdown["decode_s"] == 0  # the prefill's logits give the only token


def test_a_multi_turn_generation_prefills_each_turns_context_and_waits_for_its_tools():
    model = model_preset("llama2-7b")
    # 8 prompts x 2 episodes on 2 ranks: 8 episodes per rank, 3 turns of 16 tokens, 2 observations of 8
    w = Workload(batch_size=8, prompt_len=32, gen_len=3 * 16 + 2 * 8, n_samples_per_prompt=2, turns=3,
                 observation_len=8, tool_s=0.1, tool_threads=4)  # fmt: skip
    assert w.turn_len == 16 and w.seq_len == 32 + 64
    multi = call_cost(GEN, model, S(dp=2), DeviceMesh(1, 2), A100, w)
    # each turn: every episode its own prompt, the context so far, then the turn's 16 tokens
    turns = [
        call_cost(
            GEN, model, S(dp=2), DeviceMesh(1, 2), A100, Workload(batch_size=16, prompt_len=32 + t * 24, gen_len=16)
        )
        for t in range(3)
    ]
    for key in ("prefill_s", "decode_s"):
        assert multi.breakdown[key] == pytest.approx(sum(c.breakdown[key] for c in turns), rel=1e-12)
    assert multi.breakdown["kv_repeat_s"] == 0
    # two waits (not after the last turn) of two rounds of 4 episodes' steps at 0.1 s
    assert multi.breakdown["tool_s"] == pytest.approx(2 * 2 * 0.1)
    assert multi.time_s == pytest.approx(sum(multi.breakdown.values()))
    eight = call_cost(GEN, model, S(dp=2), DeviceMesh(1, 2), A100, dataclasses.replace(w, tool_threads=8))
    assert eight.breakdown["tool_s"] == pytest.approx(0.2)
    one_rank = call_cost(GEN, model, S(), DeviceMesh(1, 1), A100, w)
    assert one_rank.breakdown["tool_s"] == pytest.approx(2 * 4 * 0.1)  # 16 episodes on one rank
    assert "tool_s" not in call_cost(GEN, model, S(dp=2), DeviceMesh(1, 2), A100, PAPER).breakdown
    with pytest.raises(ValueError, match="leaves no token to sample"):
        Workload(batch_size=1, prompt_len=4, gen_len=10, turns=3, observation_len=5)


def test_ppo_epochs_repeat_the_rl_train_step_only():
    two = dataclasses.replace(PAPER, ppo_epochs=2)
    once = call_cost(TRAIN, LLAMA7B, S(dp=8), DeviceMesh(1, 8), A100, PAPER).time_s
    assert call_cost(TRAIN, LLAMA7B, S(dp=8), DeviceMesh(1, 8), A100, two).time_s == pytest.approx(2 * once)
    sft = MFCDef(
        "sft", "actor", "train_step", ("input_ids", "attention_mask", "loss_mask"), n_minibatches=1, objective="sft"
    )
    assert two.n_epochs(sft) == 1 and two.n_epochs(TRAIN) == 2


def test_cpu_workers_are_priced_in_fp32():
    cpu = cluster_preset("cpu", 1, 2, profile=HardwareProfile(**CPU_HW))
    m = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=100)
    w = Workload(batch_size=8, prompt_len=8, gen_len=4)
    c = call_cost(TRAIN, m, S(dp=2), DeviceMesh(1, 2, devices_per_node=2), cpu, w)
    assert (c.weight_bytes, c.train_state_bytes) == (4 * m.num_params / 2, 12 * m.num_params / 2)
    bf16 = dataclasses.replace(cpu, precision=GPU_PRECISION)
    assert call_cost(TRAIN, m, S(dp=2), DeviceMesh(1, 2, devices_per_node=2), bf16, w).time_s < c.time_s


def test_shared_prompts_price_the_samples_of_a_prompt_as_one_sequence_where_that_is_cheaper():
    """GRPO's 8 samples of a 7-token prompt with 5-token answers: the layers run 32 x (7 + 8 x 5) tokens
    instead of 256 x 12; with 128-token answers the dense masks cost more, and the padded rows are priced."""
    from rlflow.planner.cost import layout_cost, shares_prompts

    grpo = algorithm_mfcs("grpo", rule_based_reward=True)
    train = next(m for m in grpo if m.interface_type == "train_step")
    small = ModelSpec(num_layers=4, hidden_size=128, intermediate_size=512, num_heads=4, num_kv_heads=4, vocab_size=100)
    cpu = cluster_preset("cpu", 1, 1, profile=HardwareProfile(**CPU_HW))
    short = Workload(batch_size=32, prompt_len=7, gen_len=5, n_samples_per_prompt=8, n_ppo_minibatches=1,
                     gradient_checkpointing=False, max_tokens_per_mb=None)  # fmt: skip
    padded = call_cost(train, small, S(), DeviceMesh(1, 1), cpu, short)
    shared = call_cost(train, small, S(), DeviceMesh(1, 1), cpu, dataclasses.replace(short, shared_prompts=True))
    tokens_ratio = (32 * (7 + 8 * 5)) / (256 * 12)
    assert tokens_ratio < shared.time_s / padded.time_s < 0.8
    long = dataclasses.replace(short, gen_len=128, shared_prompts=True)
    assert call_cost(train, small, S(), DeviceMesh(1, 1), cpu, long).time_s == pytest.approx(
        call_cost(train, small, S(), DeviceMesh(1, 1), cpu, dataclasses.replace(long, shared_prompts=False)).time_s
    )
    assert not shares_prompts(256, 135, 32, 7 + 8 * 128, small.layer_matmul_params, 2 * 128)
    assert layout_cost(4, 10, 100, 2, causal=True) == 4 * 10 * 100 + 4 * 100 * 0.5 * 2
