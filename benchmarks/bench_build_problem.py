"""``build_problem`` on the ReaLHF paper's PPO grid: how long pricing every placement takes.

Each record builds the planning problem of PPO (6 MFCs) for LLaMA-2 actor/critic sizes on
A100 clusters of 1 to 8 nodes (batch 512, prompt 128, generation 128) and reports wall and
CPU seconds, options per MFC and the number of transfer-table cells.
"""

from __future__ import annotations

import time

from rlflow.dataflow import algorithm_graph
from rlflow.planner.build import Workload, build_problem
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.model_spec import model_preset

# (actor and reference, critic and reward model, nodes of 8 GPUs): "scale actor" / "scale critic" / both
CASES = [
    ("llama2-7b", "llama2-7b", 1),
    ("llama2-34b", "llama2-7b", 4),
    ("llama2-70b", "llama2-7b", 8),
    ("llama2-7b", "llama2-70b", 8),
    ("llama2-70b", "llama2-70b", 8),
]


def run() -> list[dict]:
    graph = algorithm_graph("ppo")
    workload = Workload(batch_size=512, prompt_len=128, gen_len=128)
    records = []
    for actor, critic, nodes in CASES:
        models = {
            "actor": model_preset(actor),
            "ref": model_preset(actor),
            "critic": model_preset(critic, value_head=True),
            "reward": model_preset(critic, value_head=True),
        }
        cluster = cluster_preset("a100-80g", num_nodes=nodes)
        wall, cpu = time.perf_counter(), time.process_time()
        problem = build_problem(graph, models, cluster, workload)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        cells = sum(t.size for t in problem.data_time) + sum(t.size for t in problem.realloc_time.values())
        records.append(
            {
                "name": f"build_problem/ppo/{actor}+{critic}/{nodes}x8",
                "wall_seconds": round(wall, 3),
                "cpu_seconds": round(cpu, 3),
                "options_per_mfc": dict(zip(problem.mfc_names, map(len, problem.options))),
                "table_cells": cells,
            }
        )
    return records


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
