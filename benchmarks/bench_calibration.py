"""Calibration of the cost model against the ReaLHF paper's measured throughput (Mei et al., 2024).

The published points (../shared/reference/planner-and-realloc.md): PPO with LLaMA-2, prompt 128,
generation 128 / 384 / 896 with batch 512 / 256 / 128 (2^17 tokens per iteration), 4 PPO
mini-batches, A100-80GB hosts of 8; the searched plan's and ReaLHF-Heuristic's throughput in
PFLOP/s at 8 GPUs ("scale actor": 7B actor, reference, critic and reward) and at 64 GPUs ("scale
critic": 7B actor and reference, 70B critic and reward); Table 4's GPUs per call of the searched
plans, and Table 6's plan (7B actor, 34B critic, 32 GPUs, generation 896).

**FLOP count.** The paper's PFLOP/s are ReaLHF's own count (``realhf/base/monitor.py``, as its
figure script applies it): a forward is ``2L(4 s h^2 + 2 s^2 h + 3 s h i) + 4 s V h`` per sequence
of ``s`` tokens (attention projections counted as h x h, attention scores over the full s^2, the
LM head included), a generation the prompts' forward plus one such step per generated token over
the growing prefix, a training call 4 forwards (backward with recompute). Generation of the
actor, forwards of critic, reference and reward, training of actor and critic. Paper seconds per
iteration are that count over the published PFLOP/s; this count is 1.2-1.4x the plain 2N/6N one.

**What is priced.** ``rlflow``'s cost model on the ``a100-80g`` preset (its A100 efficiencies and
eager-decode latencies, rlflow/planner/cluster.py), pipelined generation allowed (the paper's
engine pipelines), and two properties of the paper's engine, read in the ReaLHF repository: its
generation appends to a preallocated KV cache in place (``decode_kv_passes=1``) where HF's
``DynamicCache`` copies it, and its pipeline stages advance in lock-step
(``pipeline_lockstep=True``: DeepSpeed's schedules, ``realhf/impl/model/parallelism/
pipeline_parallel/static_schedule.py``, run with blocking sends, ``realhf/impl/model/backend/
pipe_runner.py``). The search is held to the layouts that engine has: no FSDP over a dp group
that spans hosts (:func:`paper_engine_options`). Searched plans come from seeded
Metropolis-Hastings chains of a fixed number of proposals (reproducible), started from the greedy
plan and the baselines.

    python -m benchmarks.run calibration
    python -m benchmarks.bench_calibration --markdown       # the table of docs/benchmarks.md, "Calibration"
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from rlflow.dataflow import algorithm_graph
from rlflow.planner.baselines import baseline_plans, manual_plan
from rlflow.planner.build import Workload, build_problem
from rlflow.planner.cluster import ClusterSpec, cluster_preset
from rlflow.planner.model_spec import ModelSpec, model_preset
from rlflow.planner.passes import dp_group_crosses_hosts
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.problem import PlanProblem
from rlflow.planner.search import search
from rlflow.planner.simulate import Simulator
from rlflow.planner.space import RuntimeCapabilities

PROMPT_LEN, MINIBATCHES, DEVICES_PER_NODE = 128, 4, 8
# The paper's engine appends each decode step's keys and values to a preallocated cache in place.
PAPER_DECODE_KV_PASSES = 1
# Call order of the paper's Table 4.
MFC_ORDER = ("actor_gen", "critic_inf", "ref_inf", "reward_inf", "actor_train", "critic_train")
SEARCH_STEPS, SEARCH_CHAINS, SEARCH_SEED = 20_000, 2, 0
MAX_ERROR, MAX_RATIO_POINTS = 0.25, 10.0  # the goal


@dataclass(frozen=True)
class PublishedPoint:
    """One published setting: models, GPUs, lengths, and the searched / heuristic PFLOP/s."""

    gpus: int
    actor: str  # actor and reference
    critic: str  # critic and reward
    gen_len: int
    batch: int
    searched_pflops: float
    heuristic_pflops: float

    @property
    def key(self) -> str:
        return f"{self.gpus}gpu-{self.actor.split('-')[1]}+{self.critic.split('-')[1]}-gen{self.gen_len}"


# Read off the ReaLHF repository's throughput figure (scale actor at 8 GPUs, scale critic at 64).
PUBLISHED = (
    PublishedPoint(8, "llama2-7b", "llama2-7b", 128, 512, 0.92, 0.68),
    PublishedPoint(8, "llama2-7b", "llama2-7b", 384, 256, 0.77, 0.51),
    PublishedPoint(8, "llama2-7b", "llama2-7b", 896, 128, 0.59, 0.35),
    PublishedPoint(64, "llama2-7b", "llama2-70b", 128, 512, 4.52, 4.07),
    PublishedPoint(64, "llama2-7b", "llama2-70b", 384, 256, 3.58, 2.71),
    PublishedPoint(64, "llama2-7b", "llama2-70b", 896, 128, 3.14, 1.75),
)
# Table 4: GPUs per call of the searched plan, in MFC_ORDER.
TABLE4_GPUS = {8: (8, 8, 8, 8, 4, 4), 64: (8, 56, 16, 56, 8, 56)}
# Table 6: 7B actor + 34B critic on 32 GPUs, generation 896: (devices, (dp, tp, pp)) per call.
TABLE6_PLAN = {
    "actor_gen": ("0-15", (8, 1, 2)),
    "actor_train": ("0-15", (2, 1, 8)),
    "critic_train": ("16-31", (1, 4, 4)),
    "critic_inf": ("16-31", (2, 2, 4)),
    "reward_inf": ("0-15", (1, 2, 8)),
    "ref_inf": ("0-15", (4, 4, 1)),
}


# ----------------------------------------------------------------------------- ReaLHF's FLOP count


def realhf_forward_flops(model: ModelSpec, seqs: int, seq_len: int) -> float:
    """FLOPs of a forward over ``seqs`` sequences of ``seq_len`` tokens, as ReaLHF's monitor counts them.

    >>> m = model_preset("llama2-7b")
    >>> round(realhf_forward_flops(m, 1, 256) / 256 / 1e9, 2)  # GFLOPs per token
    13.61
    """
    h, i, v, layers = model.hidden_size, model.intermediate_size, model.vocab_size, model.num_layers
    tokens = seqs * seq_len
    attn = seqs * seq_len**2 * h
    return 2 * layers * (4 * tokens * h**2 + 2 * attn + 3 * tokens * h * i) + 4 * tokens * v * h


def realhf_generate_flops(model: ModelSpec, batch: int, prompt_len: int, gen_len: int) -> float:
    """The prompts' forward plus one step per generated token over the prefix (ReaLHF's count)."""
    h, i, v, layers = model.hidden_size, model.intermediate_size, model.vocab_size, model.num_layers
    prefix_tokens = batch * (gen_len * prompt_len + gen_len * (gen_len - 1) // 2)  # sum over steps of the prefixes
    per_step = 2 * layers * (4 * batch * h**2 + 3 * batch * h * i) + 4 * batch * v * h
    attention = 2 * layers * 2 * (prefix_tokens + gen_len * batch) * h
    return realhf_forward_flops(model, batch, prompt_len) + gen_len * per_step + attention


def realhf_iteration_flops(point: PublishedPoint) -> float:
    """FLOPs of one PPO iteration as the paper's throughput counts them (see the module docstring)."""
    actor, critic = model_preset(point.actor), model_preset(point.critic)
    seq = PROMPT_LEN + point.gen_len
    flops = realhf_generate_flops(actor, point.batch, PROMPT_LEN, point.gen_len)
    flops += sum(realhf_forward_flops(m, point.batch, seq) for m in (critic, actor, critic))  # critic, ref, reward
    flops += sum(4 * realhf_forward_flops(m, point.batch, seq) for m in (actor, critic))  # trained, with recompute
    return flops


# ----------------------------------------------------------------------------- rlflow's estimates


def paper_cluster(gpus: int) -> ClusterSpec:
    """The ``a100-80g`` preset with the paper's engine: KV cache appended in place, lock-step pipelines."""
    cluster = cluster_preset("a100-80g", gpus // DEVICES_PER_NODE, DEVICES_PER_NODE)
    return replace(cluster, decode_kv_passes=PAPER_DECODE_KV_PASSES, pipeline_lockstep=True)


def paper_problem(gpus: int, actor: str, critic: str, gen_len: int, batch: int) -> PlanProblem:
    """PPO with the paper's settings (reference the actor's size, reward the critic's)."""
    models = {
        "actor": model_preset(actor),
        "ref": model_preset(actor),
        "critic": model_preset(critic, value_head=True),
        "reward": model_preset(critic, value_head=True),
    }
    workload = Workload(batch, PROMPT_LEN, gen_len, n_ppo_minibatches=MINIBATCHES)
    caps = RuntimeCapabilities(pipeline_generate=True)
    return build_problem(algorithm_graph("ppo"), models, paper_cluster(gpus), workload, capabilities=caps)


def searched_and_heuristic(problem: PlanProblem, steps: int = SEARCH_STEPS):
    """``(searched ExecutionPlan, heuristic BaselinePlan)``: seeded chains started from the baselines."""
    sim = Simulator(problem)
    baselines = baseline_plans(problem, ["actor_gen"], sim)
    starts = [b.choice for b in baselines if b.choice is not None]
    found = search(
        sim, max_steps=steps, num_chains=SEARCH_CHAINS, seed=SEARCH_SEED, initial_plans=starts, progress=False
    )
    return ExecutionPlan.from_choice(problem, found.choice), baselines[0]


def gpus_per_call(plan: ExecutionPlan) -> tuple[int, ...]:
    """Devices of each call in Table 4's order."""
    calls = {c.name: c for c in plan.calls}
    return tuple(calls[name].mesh.size for name in MFC_ORDER)


def calibrate(point: PublishedPoint, steps: int = SEARCH_STEPS) -> dict:
    """One row of the table: paper and rlflow seconds per iteration, errors, searched/heuristic ratios."""
    flops = realhf_iteration_flops(point)
    paper_s, paper_h = flops / (point.searched_pflops * 1e15), flops / (point.heuristic_pflops * 1e15)
    problem = paper_problem(point.gpus, point.actor, point.critic, point.gen_len, point.batch)
    plan, heuristic = searched_and_heuristic(paper_engine_options(problem), steps)
    if not heuristic.feasible:
        raise RuntimeError(f"{point.key}: the heuristic plan is infeasible: {heuristic.reason}")
    ours_s, ours_h = plan.iteration_time_s, heuristic.iteration_time_s
    err_s, err_h = ours_s / paper_s - 1, ours_h / paper_h - 1
    paper_ratio, ours_ratio = point.searched_pflops / point.heuristic_pflops, ours_h / ours_s
    ratio_points = 100 * (ours_ratio - paper_ratio)
    return {
        "name": "calibration_point", "point": point.key, "gpus": point.gpus, "actor": point.actor,
        "critic": point.critic, "gen_len": point.gen_len, "batch": point.batch,
        "realhf_pflop_per_iter": round(flops / 1e15, 3),
        "paper_s_searched": round(paper_s, 2), "rlflow_s_searched": round(ours_s, 2),
        "error_searched_pct": round(100 * err_s, 1),
        "paper_s_heuristic": round(paper_h, 2), "rlflow_s_heuristic": round(ours_h, 2),
        "error_heuristic_pct": round(100 * err_h, 1),
        "paper_ratio": round(paper_ratio, 3), "rlflow_ratio": round(ours_ratio, 3),
        "ratio_diff_points": round(ratio_points, 1),
        "times_within_25pct": abs(err_s) <= MAX_ERROR and abs(err_h) <= MAX_ERROR,
        "ratio_within_10pt": abs(ratio_points) <= MAX_RATIO_POINTS,
        "gpus_per_call": list(gpus_per_call(plan)), "paper_table4_gpus": list(TABLE4_GPUS[point.gpus]),
        "search_steps_per_chain": steps, "search_chains": SEARCH_CHAINS, "seed": SEARCH_SEED,
    }  # fmt: skip


def paper_engine_options(problem: PlanProblem) -> PlanProblem:
    """The problem without the options the paper's engine does not have: FSDP (every dp of a call
    that is not a generation, in rlflow's engines) over a dp group that spans hosts.

    ReaLHF trains and runs forwards on Megatron-LM's data parallelism (weights replicated over dp,
    a distributed optimizer), never FSDP. Inside a host rlflow's FSDP stands for it (NVLink hides
    the gathers either way); across hosts FSDP all-gathers every layer over the network for every
    micro-batch, a layout ReaLHF never runs, and Megatron's cross-host dp is not priced by rlflow.
    So the search keeps a subset of the paper's space: dp inside a host, tp inside a host, pp
    anywhere. The heuristic (dp inside a host) and every 8-GPU option are kept."""
    keep = {
        i: [
            j
            for j, o in enumerate(opts)
            if o.strategy.dp == 1 or o.replicated or not dp_group_crosses_hosts(o.mesh, o.strategy)
        ]
        for i, opts in enumerate(problem.options)
    }
    return problem.restricted(keep)


def diagnose_64gpu(point: PublishedPoint, steps: int = SEARCH_STEPS) -> dict:
    """What rlflow's own engines could do at 64 GPUs: the search with FSDP across hosts."""
    flops = realhf_iteration_flops(point)
    problem = paper_problem(point.gpus, point.actor, point.critic, point.gen_len, point.batch)
    plan, _ = searched_and_heuristic(problem, steps)
    paper_s = flops / (point.searched_pflops * 1e15)
    return {
        "name": "calibration_with_cross_host_fsdp", "point": point.key, "paper_s_searched": round(paper_s, 2),
        "rlflow_s_searched": round(plan.iteration_time_s, 2),
        "error_searched_pct": round(100 * (plan.iteration_time_s / paper_s - 1), 1),
        "gpus_per_call": list(gpus_per_call(plan)),
    }  # fmt: skip


def table6(steps: int = SEARCH_STEPS) -> dict:
    """The paper's Table 6 plan priced by rlflow, against rlflow's searched and heuristic plans."""
    problem = paper_problem(32, "llama2-7b", "llama2-34b", 896, 128)
    config = {n: {"mesh": devices, "strategy": dps} for n, (devices, dps) in TABLE6_PLAN.items()}
    published = manual_plan(problem, config, name="paper_table6")
    plan, heuristic = searched_and_heuristic(problem, steps)
    return {
        "name": "calibration_table6", "gpus": 32, "actor": "llama2-7b", "critic": "llama2-34b", "gen_len": 896,
        "rlflow_s_paper_plan": round(published.iteration_time_s, 2) if published.feasible else None,
        "paper_plan_infeasible": None if published.feasible else published.reason or "does not fit memory",
        "rlflow_s_searched": round(plan.iteration_time_s, 2),
        "rlflow_s_heuristic": round(heuristic.iteration_time_s, 2) if heuristic.feasible else None,
        "searched_plan": {c.name: f"{c.mesh.size} GPUs @{c.mesh.device_start} {c.strategy}" for c in plan.calls},
    }  # fmt: skip


def run(steps: int = SEARCH_STEPS) -> list[dict]:
    diagnostics = [diagnose_64gpu(p, steps) for p in PUBLISHED if p.gpus == 64]
    return [calibrate(p, steps) for p in PUBLISHED] + diagnostics + [table6(steps)]


def markdown(records: list[dict]) -> str:
    """The calibration table as docs/benchmarks.md, section "Calibration", shows it."""
    rows = [
        "| point | ReaLHF PFLOP/iter | searched: paper / rlflow (err) | heuristic: paper / rlflow (err) "
        "| ratio paper / rlflow (diff) | GPUs per call rlflow / Table 4 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        if r["name"] != "calibration_point":
            continue
        rows.append(
            f"| {r['point']} | {r['realhf_pflop_per_iter']:.2f} "
            f"| {r['paper_s_searched']:.1f} s / {r['rlflow_s_searched']:.1f} s ({r['error_searched_pct']:+.1f}%) "
            f"| {r['paper_s_heuristic']:.1f} s / {r['rlflow_s_heuristic']:.1f} s ({r['error_heuristic_pct']:+.1f}%) "
            f"| {r['paper_ratio']:.2f} / {r['rlflow_ratio']:.2f} ({r['ratio_diff_points']:+.0f} pt) "
            f"| {','.join(map(str, r['gpus_per_call']))} / {','.join(map(str, r['paper_table4_gpus']))} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--search-steps", type=int, default=SEARCH_STEPS, help="proposals per chain")
    parser.add_argument("--markdown", action="store_true", help="print the markdown table after the records")
    args = parser.parse_args()
    records = run(args.search_steps)
    for record in records:
        print(json.dumps(record), flush=True)
    if args.markdown:
        print(markdown(records))
