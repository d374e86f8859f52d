"""A ``fit()`` on two simulated hosts: a plan whose calls span both, and whose reallocation crosses them.

``ray.cluster_utils.Cluster`` starts two raylets on this machine — two Ray nodes with their own
node ids and resources, and the same IP. rlflow tells hosts apart by the pool's node index,
each node's bundles pinned to one Ray node id (``ResourcePool``), never by IP; the workers
gather it into the reallocation manager's host map.

The plan: the actor trains with FSDP over all four workers (dp=4, two per host) and generates
data-parallel on the second host's two workers only (dp=2, a full copy each). Every rollout's
reallocation then takes, per generation worker, its own quarter of the weights in memory, the
other second-host worker's quarter within the host, and the first host's half across hosts.
The bytes each step logs for those links must be what the planner's transfer model prices for
that plan (``realloc_bytes``: the same receive-side accounting).

The run needs its own Ray (a two-node cluster), so it runs in a child process: this pytest
process may hold the session's one-node Ray (``ray_session``), and one process connects to
one cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoConfig

from rlflow.planner.cluster import CPU_PRECISION, cluster_preset
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.transfer import realloc_bytes
from rlflow.trainer.metrics import call_metrics
from rlflow.workers.records import CallRecord

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def manual(call: str, num_nodes: int, num_devices: int, node_start: int = 0, **strategy: int) -> list[str]:
    key = f"placement.manual.{call}"
    mesh = [f"{key}.mesh.num_nodes={num_nodes}", f"{key}.mesh.num_devices={num_devices}"]
    return [*mesh, f"{key}.mesh.node_start={node_start}"] + [f"{key}.strategy.{k}={v}" for k, v in strategy.items()]


# A 2-layer, 64-wide Llama with an untied head (the transfer model counts a tied head's embedding
# copy as the last pipeline stage holds it; the reshard sends a tied tensor once). Every first
# dimension (vocabulary 100, widths 64, 128, 32) divides by dp=4, so FSDP shards are equal.
OVERRIDES = [
    f"trainer.total_steps={STEPS}",
    "trainer.eval_every=0",
    "trainer.eval_before_train=false",
    "warmup.steps=0",
    "data.batch_size=4",
    "data.eval_size=4",
    "algorithm.n_samples=4",
    "algorithm.entropy_coef=0.1",  # rewards (so advantages) are all 0 untrained: the entropy term moves the weights
    "models.actor.lr=1e-2",
    "models.actor.hidden_size=64",
    "models.actor.intermediate_size=128",
    "models.actor.num_layers=2",
    "models.actor.num_heads=4",
    "models.actor.num_kv_heads=2",
    "models.actor.tie_word_embeddings=false",
    "placement.num_nodes=2",
    "placement.devices_per_node=2",
    "placement.cpus_per_worker=1",
    "placement.profile=false",
    "placement.mode=manual",
    *manual("actor_train", 2, 2, dp=4),
    *manual("actor_gen", 1, 2, node_start=1, dp=2),
    "checkpoint.save_final=false",
    "logging.console=false",
    "logging.tensorboard=false",
]

_DRIVER = textwrap.dedent(
    """
    import json, sys, ray
    from ray.cluster_utils import Cluster
    from rlflow.trainer import Trainer, load_config

    recipe, run_dir, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        trainer = Trainer(load_config(recipe, [*overrides, f"logging.dir={run_dir}"]), progress_bars=False)
        try:
            trainer.launch()
            nodes = trainer.workers.node_ids
            result = trainer.fit()
        finally:
            trainer.close()
        print("RESULT" + json.dumps({"steps": result.steps, "node_ids": nodes}))
    finally:
        ray.shutdown()
        cluster.shutdown()
    """
)


def step_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if any(k.startswith("time/") for k in r)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fit_on_two_hosts_reallocates_across_them_as_the_plan_prices(tmp_path):
    args = [str(REPO / "recipes" / "grpo_arithmetic.yaml"), str(tmp_path), json.dumps(OVERRIDES)]
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *args], capture_output=True, text=True, timeout=280, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT") :])
    assert result["steps"] == STEPS
    # Ranks 0, 1 on one Ray node and 2, 3 on the other: two hosts, with one IP between them.
    nodes = result["node_ids"]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]

    plan = ExecutionPlan.load(tmp_path / "plan.json")
    options = plan.placements()
    home, gen = options["actor_train"], options["actor_gen"]
    assert (home[0].num_nodes, home[1].dp) == (2, 4) and (gen[0].node_start, gen[0].num_nodes, gen[1].dp) == (1, 1, 2)
    config = AutoConfig.from_pretrained(tmp_path / "models" / "actor")
    model = ModelSpec.from_hf_config(config)
    # The planner's accounting for this plan; weights travel as fp32 master weights.
    cluster = replace(cluster_preset("a100-80g", num_nodes=2, devices_per_node=2), precision=CPU_PRECISION)
    planned = realloc_bytes(model, home, gen, cluster)
    full = model.num_params * 4
    # Each of the two generation workers receives its host's other quarter and the other host's half.
    assert planned["intra_host_bytes"] == 2 * full / 4 and planned["inter_host_bytes"] == 2 * full / 2

    metrics = step_metrics(tmp_path)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, record in metrics.items():
        # Every step trains on a rollout of the copy resharded after the previous update.
        assert record["actor_train/grad_norm"] > 0 and record["time/actor_gen/pre_call"] > 0
        assert record["realloc/actor_gen/bytes_intra_host"] == planned["intra_host_bytes"], step
        assert record["realloc/actor_gen/bytes_inter_host"] == planned["inter_host_bytes"], step
        assert "realloc/actor_train/bytes_intra_host" not in record  # the training call runs at home


def test_a_steps_realloc_bytes_are_summed_over_ranks_and_hooks():
    """The logged bytes per link are what every rank sent in the call's pre- and post-hooks."""

    def hook(kind: str, rank: int, intra: float, inter: float, reshards: float = 1.0) -> CallRecord:
        moved = {"realloc_reshards": reshards, "realloc_sent_intra_host_bytes": intra}
        return CallRecord(
            "gen", "actor", kind, "realloc", rank, 1, 0.0, 1.0, {**moved, "realloc_sent_inter_host_bytes": inter}
        )

    records = [hook("pre_call", 0, 10.0, 100.0), hook("pre_call", 2, 5.0, 0.0), hook("post_call", 2, 1.0, 2.0)]
    records += [hook("pre_call", r, 0.0, 0.0, reshards=0.0) for r in (0, 1)]  # a call that moved nothing
    records[-2:] = [replace(r, mfc="train") for r in records[-2:]]
    metrics = call_metrics(records)
    assert (metrics["realloc/gen/bytes_intra_host"], metrics["realloc/gen/bytes_inter_host"]) == (16.0, 102.0)
    assert "realloc/train/bytes_intra_host" not in metrics and metrics["time/train/pre_call"] == 1.0
