"""Config loading and validation: recipes load, bad input names its full key and its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.dataflow import list_algorithms
from rlflow.dataflow.algorithms import DEFAULT_REF_EMA_ETA
from rlflow.planner.mesh import DeviceMesh
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.build import build_dataflow
from rlflow.trainer.config import (
    AlgorithmConfig,
    ConfigError,
    ModelConfig,
    RLFlowConfig,
    load_config,
    parse_cli,
    render_config_reference,
    to_yaml,
)

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_recipes_exist_for_every_algorithm_of_the_brief():
    names = {p.stem for p in RECIPES}
    assert {f"{a}_arithmetic" for a in list_algorithms()} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_and_round_trips_through_yaml(path, tmp_path):
    cfg = load_config(path)
    assert cfg.experiment_name == path.stem
    assert path.stem.startswith(f"{cfg.algorithm.name}_")
    (tmp_path / "saved.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "saved.yaml") == cfg


def test_main_recipe_is_sft_warmup_then_grpo_on_two_workers():
    cfg = load_config(REPO / "recipes" / "grpo_arithmetic.yaml")
    assert cfg.warmup.steps > 0 and cfg.algorithm.name == "grpo"
    assert cfg.required_models() == ("actor",) and cfg.reward_fn == "numeric_match"
    assert cfg.placement.num_nodes * cfg.placement.devices_per_node == 2
    assert cfg.max_new_tokens == cfg.data.max_response_len


def test_ppo_recipe_needs_and_trains_the_right_models():
    cfg = load_config(REPO / "recipes" / "ppo_arithmetic.yaml")
    assert cfg.required_models() == ("actor", "ref", "critic", "reward") and cfg.reward_fn is None
    assert [cfg.is_trainable(r) for r in ("actor", "ref", "critic", "reward")] == [True, False, True, False]
    assert cfg.algorithm.resolved_adv_estimator == "gae"


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "remax"])
def test_the_graph_has_a_reference_call_exactly_when_a_kl_term_reads_it(name):
    recipe = REPO / "recipes" / f"{name}_arithmetic.yaml"
    no_kl = load_config(recipe, ["algorithm.kl_coef=0"])  # a reference the recipe lists is then not built
    kl = load_config(recipe, ["algorithm.kl_coef=0.05", "models.ref={init: copy, init_from: actor}"])
    assert "ref" not in no_kl.required_models() and "ref_inf" not in build_dataflow(no_kl, rule_reward=True)
    assert "ref_inf" in build_dataflow(kl, rule_reward=True)


def test_defaults_are_a_valid_grpo_run():
    cfg = load_config()
    assert cfg == RLFlowConfig()
    assert cfg.algorithm.resolved_adv_estimator == "grpo"
    assert cfg.run_dir == Path("runs/rlflow") and cfg.checkpoint_dir == Path("runs/rlflow/checkpoints")


def test_overrides_apply_in_order_and_parse_yaml_values():
    cfg = load_config(
        None, ["trainer.total_steps=7", "trainer.total_steps=9", "data.ops=[+,-]", "models.actor.betas=[0.8,0.9]"]
    )
    assert cfg.trainer.total_steps == 9
    assert cfg.data.ops == ["+", "-"]
    assert cfg.models["actor"].betas == (0.8, 0.9)


def test_models_section_of_a_file_replaces_the_default_models(tmp_path):
    path = tmp_path / "rm.yaml"
    path.write_text("algorithm: {name: rm}\nmodels:\n  reward: {init: tiny, lr: 1.0e-3}\n")
    cfg = load_config(path)
    assert sorted(cfg.models) == ["reward"] and cfg.is_trainable("reward")


def test_unknown_key_names_the_full_key_the_valid_keys_and_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("models:\n  actor:\n    hiden_size: 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "models.actor.hiden_size"
    assert "hidden_size" in str(err.value) and str(path) in str(err.value)


def test_value_outside_its_set_lists_the_allowed_values_and_the_override():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=ppp"])
    assert err.value.key == "algorithm.name"
    assert "'grpo'" in str(err.value) and "'ppo_ema'" in str(err.value)
    assert "algorithm.name=ppp" in err.value.source


def test_value_error_from_a_file_names_the_file(tmp_path):
    path = tmp_path / "lr.yaml"
    path.write_text("models:\n  actor:\n    lr: -1.0e-3\n")
    with pytest.raises(ConfigError, match=r"models\.actor\.lr: .*> 0") as err:
        load_config(path)
    assert str(path) in err.value.source


def test_wrong_type_names_the_key_and_the_declared_type():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.total_steps=many"])
    assert err.value.key == "trainer.total_steps" and "int" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.name=ppo"], "models.critic"),  # GAE needs a critic
        (["algorithm.kl_coef=0.1"], "models.ref"),
        (["algorithm.n_samples=1"], "algorithm.n_samples"),  # GRPO compares responses
        (["algorithm.reward_fn=nope"], "algorithm.reward_fn"),
        (["algorithm.adv_estimator=reinforce_pp"], "algorithm.adv_estimator"),
        (["rollout.max_new_tokens=100", "data.max_response_len=8"], "rollout.max_new_tokens"),
        (["models.actor.init=path"], "models.actor.path"),
        (["models.actor.num_heads=3"], "models.actor.num_heads"),
        (["models.actor.betas=[0.9,1.5]"], "models.actor.betas"),
        (["models.ref.init=copy", "models.ref.init_from=critic"], "models.ref.init_from"),
        (["models.ref.init=copy", "models.ref.init_from=actor", "models.ref.trainable=true"], "models.ref.trainable"),
        (["models.critc.init=tiny"], "models.critc"),
        (["data.task=null"], "data.task"),
        (["data.ops=[+,/]"], "data.ops"),
        (["data.task=null", "data.train_file=t.jsonl", "data.split_seed=0"], "data.split_seed"),
        (["placement.mode=manual"], "placement.manual"),
        (["warmup.steps=10", "algorithm.name=sft"], "warmup.steps"),
        (["experiment_name=a b"], "experiment_name"),
        (["data.batch_size=2", "algorithm.n_samples=2", "algorithm.n_minibatches=5"], "algorithm.n_minibatches"),
        (["rollout.max_new_tokens=8", "algorithm.overlong_buffer=9"], "algorithm.overlong_buffer"),
        (["algorithm.name=sft", "algorithm.mask_truncated=true"], "algorithm.mask_truncated"),
    ],
)
def test_inconsistent_settings_name_the_full_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key, str(err.value)


def test_manual_placement_gives_planner_meshes_and_strategies():
    mfc = "placement.manual.actor_gen"
    cfg = load_config(
        None,
        ["placement.mode=manual", "placement.devices_per_node=4", f"{mfc}.mesh.device_start=2",
         f"{mfc}.mesh.num_devices=2", f"{mfc}.strategy.tp=2"],
    )  # fmt: skip
    manual = cfg.placement.manual["actor_gen"]
    assert manual.mesh.to_device_mesh(4) == DeviceMesh(1, 2, 0, 2, devices_per_node=4)
    assert manual.strategy.to_strategy() == ParallelStrategy(dp=1, tp=2, pp=1)


@pytest.mark.parametrize(
    ("mesh", "strategy", "key"),
    [
        ("{num_devices: 2}", "{dp: 3}", "placement.manual.gen.strategy"),  # 3 != mesh size 2
        ("{num_devices: 2, device_start: 1}", "{dp: 2}", "placement.manual.gen.mesh"),  # not aligned
        ("{node_start: 1}", "{dp: 1}", "placement.manual.gen.mesh"),  # outside the one node
        ("{num_devices: 4}", "{dp: 4}", "placement.manual.gen.mesh"),  # 4 devices on a 2-device node
    ],
)
def test_manual_placement_rejects_meshes_outside_the_cluster(tmp_path, mesh, strategy, key):
    path = tmp_path / "manual.yaml"
    path.write_text(
        f"placement:\n  mode: manual\n  devices_per_node: 2\n  manual:\n    gen: {{mesh: {mesh}, strategy: {strategy}}}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key, str(err.value)


def test_sections_built_in_python_validate_too():
    with pytest.raises(ConfigError, match="name: 'x' is not allowed"):
        AlgorithmConfig(name="x")
    with pytest.raises(ConfigError, match="lr: 'fast' has type str"):
        ModelConfig(lr="fast")


def test_optim_config_follows_the_schedule():
    cosine = ModelConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1, grad_clip=None)
    optim = cosine.optim_config(total_steps=50)
    assert (optim.lr, optim.total_steps, optim.warmup_steps, optim.max_grad_norm) == (1e-3, 50, 2, None)
    assert ModelConfig().optim_config(total_steps=50).total_steps is None  # constant after warm-up


def test_parse_cli_reads_a_recipe_and_overrides():
    cfg = parse_cli([str(REPO / "recipes" / "grpo_arithmetic.yaml"), "trainer.total_steps=3"])
    assert cfg.trainer.total_steps == 3
    with pytest.raises(ConfigError, match="expected: <recipe.yaml>"):
        parse_cli(["trainer.total_steps=3"])
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        parse_cli(["missing.yaml"])


def test_configuration_reference_is_up_to_date():
    doc = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == render_config_reference(), "regenerate: python -m rlflow.trainer.config > docs/configuration.md"
    for key in ("algorithm.clip_ratio_high", "models.<role>.lr", "placement.manual.<mfc>.strategy.tp", "warmup.steps"):
        assert f"`{key}`" in doc


def test_the_algorithm_record_decides_models_grouping_and_kl_placement():
    rpp = load_config(
        None,
        ["algorithm.name=reinforce_pp", "algorithm.kl_coef=0.01"]
        + ["models.ref.init=copy", "models.ref.init_from=actor"],
    )
    assert rpp.algorithm.resolved_adv_estimator == "reinforce_plus_plus" and rpp.algorithm.resolved_kl_in_reward
    assert rpp.required_models() == ("actor", "ref") and rpp.row_group_size() == 1  # no critic, no groups
    assert rpp.algorithm.resolved().kl_in_reward is True  # what the workers receive
    explicit = load_config(None, ["algorithm.name=reinforce_pp", "algorithm.kl_in_reward=false"])
    assert not explicit.algorithm.resolved_kl_in_reward
    grpo = load_config(None, ["algorithm.n_samples=4"])
    assert grpo.row_group_size() == 4 and not grpo.algorithm.resolved_kl_in_reward
    assert (
        load_config(None, ["algorithm.name=rloo", "algorithm.adv_estimator=reinforce_plus_plus"]).row_group_size() == 1
    )


def test_the_ema_factor_has_one_default_that_reaches_the_graph():
    cfg = load_config(
        None,
        ["algorithm.name=ppo_ema"]
        + [f"models.{m}.init=copy" for m in ("ref", "critic")]
        + [f"models.{m}.init_from=actor" for m in ("ref", "critic")],
    )
    assert cfg.algorithm.ema_eta == DEFAULT_REF_EMA_ETA == 0.008
    (hook,) = build_dataflow(cfg, rule_reward=True).nodes["ref_inf"]["mfc"].pre_hooks
    assert hook.eta == cfg.algorithm.ema_eta
