"""A LoRA GRPO fit on two CPU workers: the adapter push (the default) samples what the merged push
samples and ends with the same weights, moving the adapters alone after the first push."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from test_e2e import GRPO, GRPO_TINY, fit, manual, step_metrics
from transformers import AutoConfig

from rlflow.planner.cluster import cluster_preset
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec, lora_param_count
from rlflow.planner.transfer import adapter_push_bytes
from rlflow.strategy import ParallelStrategy
from rlflow.trainer import ConfigError, load_config

pytest.importorskip("peft")

STEPS = 2
TARGETS = ("q_proj", "o_proj", "down_proj")  # column- and row-parallel linears of the tp = 2 rollout
RUN = [
    *GRPO_TINY, f"trainer.total_steps={STEPS}", "models.actor.dtype=float32",
    "models.actor.lora.r=4", f"models.actor.lora.target_modules=[{','.join(TARGETS)}]",
    # The adapters train over both workers (2 FSDP row shards), the rollout samples at tp = 2 over
    # both: each rollout rank takes half of every adapter from the other worker over gloo.
    "placement.mode=manual", *manual("actor_train", dp=2), *manual("actor_gen", tp=2),
    "placement.keep_copies=true", "logging.rollouts_every=1", "checkpoint.every_n_steps=0",
    "trainer.eval_before_train=false", "data.eval_size=2", "data.batch_size=2",
]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_adapter_push_samples_and_trains_as_the_merged_push_does(ray_session, tmp_path) -> None:
    runs = {mode: tmp_path / mode for mode in ("adapters", "merged")}
    for mode, run in runs.items():
        fit(GRPO, [*RUN, f"models.actor.lora.push={mode}"], run)
    for step in range(1, STEPS + 1):  # the same tokens sampled (and rewarded) at every step
        rollouts = {m: (run / "rollouts" / f"step_{step}.jsonl").read_text() for m, run in runs.items()}
        assert rollouts["adapters"] == rollouts["merged"] and rollouts["adapters"]
    final = {m: load_file(run / "final" / "actor" / "model.safetensors") for m, run in runs.items()}
    assert all(torch.equal(final["adapters"][k], final["merged"][k]) for k in final["merged"])
    base = load_file(runs["adapters"] / "models" / "actor" / "model.safetensors")
    adapted = [k for k in base if k.rsplit(".", 2)[-2] in TARGETS]
    assert any(not torch.equal(base[k], final["adapters"][k]) for k in adapted)  # the adapters moved

    # Bytes of the second push: every rollout rank gets the whole adapters (r * (in + out) fp32 of
    # each adapted weight), half from its own shard, half from the other worker; the merged push
    # sends each rank its tp half of every merged weight.
    adapters = 4 * sum(4 * sum(base[k].shape) for k in adapted)
    pushed = {}
    for mode, run in runs.items():
        record = step_metrics(run)[2]
        pushed[mode] = {k: record.get(f"realloc/actor_gen/bytes_{k}", 0.0) for k in ("local", "intra_host")}
    assert pushed["adapters"] == {"local": adapters, "intra_host": adapters}
    config = AutoConfig.from_pretrained(runs["adapters"] / "models" / "actor")  # the planner prices that
    spec = replace(ModelSpec.from_hf_config(config), push_params=lora_param_count(config, 4, TARGETS))
    mesh, cluster = DeviceMesh(1, 2, 0, 0, 2), cluster_preset("a100-80g", num_nodes=1, devices_per_node=2)
    planned = adapter_push_bytes(spec, (mesh, ParallelStrategy(dp=2)), (mesh, ParallelStrategy(tp=2)), cluster)
    assert planned == {"local_bytes": adapters, "intra_host_bytes": adapters, "inter_host_bytes": 0.0}
    assert sum(pushed["merged"].values()) == 4 * sum(base[k].numel() for k in adapted)
    mismatch = {m: step_metrics(run)[2].get("actor_inf/logp_mismatch_max") for m, run in runs.items()}
    assert mismatch["adapters"] == mismatch["merged"]


def test_a_push_mode_that_does_not_exist_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="adapters") as err:
        load_config(GRPO, ["models.actor.lora.push=deltas"])
    assert err.value.key == "models.actor.lora.push"
    assert load_config(GRPO, ["models.actor.lora.r=2"]).models["actor"].lora.push == "adapters"
