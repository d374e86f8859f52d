"""A causal LM of a model type without a hand-written family record, trained through the public
``Trainer`` (GRPO, the built-in sampler, one worker in the driver); a model rlflow cannot run, a
model whose vLLM layout rlflow does not map and a manual strategy its model cannot split are
refused before any worker starts, naming the field."""

from __future__ import annotations

import json

import pytest
from tiny_fit import DRIVER_FIT, GRPO

from rlflow.data.tiny_models import save_tiny_model_and_tokenizer
from rlflow.dataflow import mfcs_of
from rlflow.parallel import vllm_layout
from rlflow.trainer import ConfigError, Trainer, build, load_config
from rlflow.trainer.placement import check_manual_strategies, model_specs

SHAPE = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)}
TINY = [*DRIVER_FIT, "rollout.max_new_tokens=4", "trainer.total_steps=2", "checkpoint.save_final=false"]


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(cfg, *args):
        raise AssertionError("started Ray")

    monkeypatch.setattr(build, "ensure_ray", refuse)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", ["olmo2", "qwen3_moe"])
def test_grpo_trains_a_model_type_of_the_generic_family(tmp_path, model_type):
    fields = MOE.get(model_type)
    model = save_tiny_model_and_tokenizer(tmp_path / model_type, family=model_type, config_fields=fields, **SHAPE)
    with Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'run'}"], model=model, progress_bars=False) as t:
        assert t.fit().steps == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["actor_train/loss"] for r in records if "actor_train/loss" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # trained, finite
    # A mixture-of-experts model trains with its router's load-balancing loss (the config's coefficient).
    router = [r["actor_train/router_aux_loss"] for r in records if "actor_train/router_aux_loss" in r]
    assert len(router) == (2 if fields else 0) and all(x > 0 for x in router)


def test_the_router_loss_coefficient_is_checked_against_the_model(tmp_path, no_ray):
    olmo = save_tiny_model_and_tokenizer(tmp_path / "olmo2", family="olmo2", **SHAPE)
    overrides = [*TINY, f"logging.dir={tmp_path / 'run'}", "models.actor.router_aux_loss_coef=0.01"]
    with pytest.raises(ConfigError, match="model_type='olmo2' has no router") as err:
        Trainer(GRPO, overrides=overrides, model=olmo)
    assert err.value.key == "models.actor.router_aux_loss_coef"


def test_a_model_whose_forward_rlflow_cannot_run_is_refused_before_the_workers(tmp_path, no_ray):
    granite = save_tiny_model_and_tokenizer(tmp_path / "granite", family="granite", **SHAPE)
    config = json.loads((tmp_path / "granite" / "config.json").read_text())
    (tmp_path / "granite" / "config.json").write_text(json.dumps({**config, "logits_scaling": 8.0}))  # Granite's own
    with pytest.raises(ConfigError) as err:
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'run'}"], model=granite)
    message = str(err.value)
    assert err.value.key == "models.actor.path" and "cannot train model_type='granite'" in message
    assert "computes other logits" in message and "'llama'" in message  # the reason, and what rlflow trains


def test_vllm_rollouts_of_a_generic_model_are_checked_against_vllms_model_class(tmp_path, monkeypatch):
    # vLLM 0.32's packed modules (the plain venv has no vLLM): Phi-3 packs q/k/v and gate/up in HF as in vLLM.
    packed = {"Phi3ForCausalLM": {"qkv_proj": ("qkv_proj",)}, "Qwen3MoeForCausalLM": {"qkv_proj": ("q_proj",)}}
    monkeypatch.setattr(vllm_layout, "vllm_packed_modules", packed.__getitem__)

    def materialize(model_type: str, **fields) -> None:
        model = save_tiny_model_and_tokenizer(tmp_path / model_type, family=model_type, config_fields=fields, **SHAPE)
        cfg = load_config(GRPO, ["models.actor.init=path", f"models.actor.path={model}", "rollout.engine=vllm"])
        build.materialize_models(cfg, tmp_path, model)

    materialize("phi3")
    with pytest.raises(
        ConfigError, match="rollout.engine: 'vllm' cannot generate models.actor \\('qwen3_moe'\\): .*3-D"
    ):
        materialize("qwen3_moe", **MOE["qwen3_moe"])


def test_a_manual_strategy_the_model_cannot_split_names_its_field(tmp_path):
    olmo = save_tiny_model_and_tokenizer(tmp_path / "olmo2", family="olmo2", **SHAPE)
    llama = save_tiny_model_and_tokenizer(tmp_path / "llama", family="llama", **SHAPE)

    def check(model: str, tp: int, pp: int = 1) -> None:
        actor = ["placement.devices_per_node=4", "models.actor.init=path", f"models.actor.path={model}"]
        mfcs = [m for m in mfcs_of(build.build_dataflow(load_config(GRPO, actor), True)) if not m.runs_on_host]
        manual = [f"placement.manual.{m.name}.{k}" for m in mfcs
                  for k in (f"mesh.num_devices={tp * pp}", f"strategy.tp={tp}", f"strategy.pp={pp}")]  # fmt: skip
        cfg = load_config(GRPO, [*actor, "placement.mode=manual", *manual])
        check_manual_strategies(cfg, mfcs, model_specs({"actor": model}, set()))

    with pytest.raises(ConfigError, match="placement.manual.actor_gen.strategy.tp: 2 for model 'actor': .*olmo2"):
        check(olmo, tp=2)
    check(olmo, tp=1, pp=2)  # OLMo 2 declares its pipeline plan
    stablelm = save_tiny_model_and_tokenizer(tmp_path / "stablelm", family="stablelm", **SHAPE)
    with pytest.raises(ConfigError, match="strategy.pp: 2 for model 'actor': .*declares no base_model_pp_plan"):
        check(stablelm, tp=1, pp=2)
    with pytest.raises(ConfigError, match="strategy.tp: 4 does not divide .*num_key_value_heads=1; tp may be \\[1\\]"):
        check(llama, tp=4)
    check(llama, tp=1, pp=2)  # what the model allows passes


def test_a_manual_pipeline_for_a_moe_actor_with_its_router_loss_names_the_field(tmp_path):
    from types import SimpleNamespace

    from rlflow.strategy import ParallelStrategy

    moe = save_tiny_model_and_tokenizer(tmp_path / "moe", family="qwen3_moe", config_fields=MOE["qwen3_moe"], **SHAPE)
    mfc = SimpleNamespace(name="actor_train", model_name="actor", is_train=True)
    calls = {"actor_train": SimpleNamespace(mfc=mfc, strategy=ParallelStrategy(pp=2))}
    actor = ["models.actor.init=path", f"models.actor.path={moe}"]
    with pytest.raises(
        ConfigError, match="0.001: the router auxiliary loss runs with pp=1; place 'actor_train'"
    ) as err:
        build._router_aux_loss_coef(load_config(GRPO, actor), "actor", moe, calls)
    assert err.value.key == "models.actor.router_aux_loss_coef"
    off = load_config(GRPO, [*actor, "models.actor.router_aux_loss_coef=0"])
    assert build._router_aux_loss_coef(off, "actor", moe, calls) == 0.0
