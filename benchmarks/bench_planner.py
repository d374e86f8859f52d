"""Planner benchmarks: simulator speed, plan quality on the ReaLHF grid, and distance to the best plan.

(a) ``simulate``: one candidate plan of PPO (6 MFCs, 3 unrolled iterations) on 8x8 A100s
    (70B actor and reference, 7B critic and reward), in C++ and in the Python twin. Plans are a
    random walk of one-MFC changes from the greedy plan (what the search evaluates) and, for
    C++, also uniformly random plans.
(b) ``quality``: the paper's "scale actor" grid — actor and reference 7B/13B/34B/70B on
    8/16/32/64 devices with a 7B critic and reward, generation 128/384/896 with batch
    512/256/128, prompt 128, 4 PPO mini-batches. The search is seeded with the baselines, so
    by construction it is never slower than a feasible baseline; the figure of interest is how
    much faster it is than the heuristic (the paper reports +26% throughput on average).
(c) ``near_optimal``: on the 8-device settings, the plan after ``search_seconds`` against the
    best of a much longer search (``reference_seconds``, other seeds); the gap must stay
    within 2%.

The paper's engine pipelines generation, so these problems allow ``pp > 1`` for generation
(``RuntimeCapabilities(pipeline_generate=True)``, the default since rlflow's built-in sampler
pipelines too).

    python -m benchmarks.run planner
    python -m benchmarks.bench_planner --search-seconds 3 --check-seconds 10 --reference-seconds 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rlflow.dataflow import algorithm_graph
from rlflow.planner.baselines import baseline_plans
from rlflow.planner.build import Workload, build_problem
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.model_spec import model_preset
from rlflow.planner.search import greedy_choice, search
from rlflow.planner.simulate import Simulator, simulate_py
from rlflow.planner.space import RuntimeCapabilities

ACTOR_BY_DEVICES = {8: "llama2-7b", 16: "llama2-13b", 32: "llama2-34b", 64: "llama2-70b"}
GEN_SETTINGS = ((128, 512), (384, 256), (896, 128))  # (generation length, batch): 2^17 tokens per iteration
PROMPT_LEN, MINIBATCHES, DEVICE = 128, 4, "a100-80g"


def ppo_problem(actor: str, critic: str, num_devices: int, gen_len: int, batch: int):
    """The planning problem of PPO with the paper's settings (ref = actor size, reward = critic size)."""
    models = {
        "actor": model_preset(actor),
        "ref": model_preset(actor),
        "critic": model_preset(critic, value_head=True),
        "reward": model_preset(critic, value_head=True),
    }
    cluster = cluster_preset(DEVICE, num_devices // 8, 8)
    workload = Workload(batch, PROMPT_LEN, gen_len, n_ppo_minibatches=MINIBATCHES)
    caps = RuntimeCapabilities(pipeline_generate=True)
    return build_problem(algorithm_graph("ppo"), models, cluster, workload, capabilities=caps)


def _walk(problem, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` plans, each one MFC away from the previous, from the greedy plan."""
    cur, plans = np.array(greedy_choice(problem)), []
    for _ in range(n):
        cur = cur.copy()
        i = int(rng.integers(problem.num_mfcs))
        cur[i] = int(rng.integers(len(problem.options[i])))
        plans.append(cur)
    return np.array(plans)


def bench_simulate(
    num_devices: int = 64, num_plans: int = 2000, repeats: int = 15, python_plans: int = 100
) -> list[dict]:
    problem = ppo_problem(ACTOR_BY_DEVICES[num_devices], "llama2-7b", num_devices, 896, 128)
    sim = Simulator(problem)
    rng = np.random.default_rng(0)
    walk = _walk(problem, num_plans, rng)
    uniform = np.array([[rng.integers(len(o)) for o in problem.options] for _ in range(num_plans)])

    def cpp_us(plans: np.ndarray) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sim.native.costs(plans)
            times.append((time.perf_counter() - t0) / len(plans) * 1e6)
        return statistics.median(times)

    py_times = []
    for plan in walk[:python_plans]:
        t0 = time.perf_counter()
        simulate_py(sim.compiled, plan, detailed=False)
        py_times.append((time.perf_counter() - t0) * 1e6)
    cpp_walk, cpp_uniform, py = cpp_us(walk), cpp_us(uniform), statistics.median(py_times)
    setting = {"mfcs": problem.num_mfcs, "iterations": problem.num_iterations, "devices": problem.num_devices}
    return [
        {
            "name": "planner_simulate_cpp",
            "us_per_plan": round(cpp_walk, 2),
            "us_per_plan_uniform_random": round(cpp_uniform, 2),
            "unit": "us",
            **setting,
        },  # fmt: skip
        {"name": "planner_simulate_python", "us_per_plan": round(py, 1), "unit": "us", **setting},
        {"name": "planner_simulate_speedup", "cpp_over_python": round(py / cpp_walk, 1), "unit": "x", **setting},
    ]


def bench_quality(search_seconds: float = 3.0, num_chains: int | None = None, devices=(8, 16, 32, 64)) -> list[dict]:
    records, gains = [], []
    for n in devices:
        for gen_len, batch in GEN_SETTINGS:
            problem = ppo_problem(ACTOR_BY_DEVICES[n], "llama2-7b", n, gen_len, batch)
            sim = Simulator(problem)
            baselines = baseline_plans(problem, ["actor_gen"], sim)
            seeds = [b.choice for b in baselines if b.choice is not None]
            found = search(
                sim, seconds=search_seconds, num_chains=num_chains, seed=0, initial_plans=seeds, progress=False
            )
            rec = {
                "name": "planner_quality", "actor": ACTOR_BY_DEVICES[n], "critic": "llama2-7b", "devices": n,
                "gen_len": gen_len, "batch": batch, "search_s_per_iter": round(found.result.iteration_time_s, 3),
                "search_fits": found.result.fits, "search_steps": found.steps, "search_seconds": search_seconds,
            }  # fmt: skip
            for b in baselines:
                rec[f"{b.name}_s_per_iter"] = round(b.iteration_time_s, 3) if b.feasible else None
                if not b.feasible:
                    rec[f"{b.name}_infeasible"] = b.reason
                else:
                    assert found.cost <= b.result.cost, f"search slower than {b.name}"  # seeded: cannot happen
            heuristic = baselines[0]
            if heuristic.feasible:
                rec["speedup_over_heuristic"] = round(heuristic.iteration_time_s / found.result.iteration_time_s, 3)
                gains.append(rec["speedup_over_heuristic"] - 1.0)
            records.append(rec)
    records.append({
        "name": "planner_quality_summary", "settings": len(records), "heuristic_feasible": len(gains),
        "mean_throughput_gain_over_heuristic_pct": round(100 * statistics.mean(gains), 1) if gains else None,
        "max_throughput_gain_over_heuristic_pct": round(100 * max(gains), 1) if gains else None,
        "paper_mean_gain_pct": 26.0,
    })  # fmt: skip
    return records


def bench_near_optimal(
    search_seconds: float = 10.0, reference_seconds: float = 60.0, reference_seeds=(1, 2)
) -> list[dict]:
    records = []
    for gen_len, batch in GEN_SETTINGS:
        problem = ppo_problem("llama2-7b", "llama2-7b", 8, gen_len, batch)
        sim = Simulator(problem)
        seeds = [b.choice for b in baseline_plans(problem, ["actor_gen"], sim) if b.choice is not None]
        found = search(sim, seconds=search_seconds, seed=0, initial_plans=seeds, progress=False)
        ref = min(
            (
                search(sim, seconds=reference_seconds, seed=s, initial_plans=seeds, progress=False)
                for s in reference_seeds
            ),
            key=lambda r: r.cost,
        )
        best = min(found.cost, ref.cost)
        gap = found.cost / best - 1.0
        records.append({
            "name": "planner_near_optimal", "devices": 8, "gen_len": gen_len, "batch": batch,
            "search_seconds": search_seconds, "search_s_per_iter": round(found.cost, 4),
            "reference": f"{len(reference_seeds)} searches of {reference_seconds:g} s", "reference_s_per_iter": round(best, 4),
            "gap_pct": round(100 * gap, 3), "within_2pct": gap <= 0.02,
        })  # fmt: skip
    return records


def run(search_seconds: float = 3.0, check_seconds: float = 10.0, reference_seconds: float = 60.0) -> list[dict]:
    return bench_simulate() + bench_quality(search_seconds) + bench_near_optimal(check_seconds, reference_seconds)


if __name__ == "__main__":
    import json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--search-seconds", type=float, default=3.0, help="search budget per grid setting (b)")
    parser.add_argument(
        "--check-seconds", type=float, default=10.0, help="search budget checked against the reference (c)"
    )
    parser.add_argument("--reference-seconds", type=float, default=60.0, help="budget of each reference search (c)")
    args = parser.parse_args()
    for record in run(args.search_seconds, args.check_seconds, args.reference_seconds):
        print(json.dumps(record), flush=True)
