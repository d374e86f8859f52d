"""The recipes: every YAML validates and lists exactly the models its algorithm uses, the pipeline's
paths line up (SFT policy → reward model → PPO), and the PPO recipe trains a missing reward model
first and then runs PPO scored by it, with held-out accuracy still scored by the task's rule.

The PPO run is a smoke run of tiny models (a few steps each), not a learning test: the learning
figures of each recipe are measured by running it (see docs/benchmarks.md, section "Recipes").
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.dataflow import Algorithm, list_algorithms
from rlflow.trainer import load_config
from rlflow.trainer.data import task_records

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
YAMLS = sorted(RECIPES.glob("*.yaml"))
pytestmark = [pytest.mark.slow]
USER_ALGORITHM_RECIPES = ("a2c_custom",)  # trained by tests/dataflow/test_custom_algorithm.py
HELPERS = {"stages"}
BASELINES = {"distill_sft_arithmetic"}  # run another recipe's YAML (distill_arithmetic's) another way

# A 2-layer, 64-wide policy; 2 SFT steps, 2 reward-model steps and 2 PPO steps of 8 prompts.
TINY_MODEL = ["hidden_size=64", "intermediate_size=128", "num_layers=2", "num_heads=4", "num_kv_heads=2"]
COMMON = ["placement.search_seconds=0.5", "logging.console=false", "logging.tensorboard=false"]
SFT_TINY = [*(f"models.actor.{o}" for o in TINY_MODEL), "trainer.total_steps=2", "trainer.eval_every=0"]
SFT_TINY += ["data.batch_size=8", "data.eval_size=8", *COMMON]
RM_TINY = ["trainer.total_steps=2", "data.batch_size=4", "data.eval_size=8", *COMMON]
PPO_TINY = [*(f"models.actor.{o}" for o in TINY_MODEL), "trainer.total_steps=2", "trainer.eval_every=0"]
PPO_TINY += ["warmup.steps=1", "warmup.batch_size=8", "data.batch_size=8", "data.eval_size=8", *COMMON]


def test_there_is_a_recipe_per_algorithm():
    names = {p.stem for p in YAMLS}
    assert {f"{a}_arithmetic" for a in list_algorithms()} <= names
    assert all((RECIPES / f"{n}.py").is_file() for n in names), "every YAML has its runnable recipe"
    # Any other script is a user's algorithm in one file (its record, graph and config in the
    # module) or a helper the recipes share.
    scripts = {p.stem for p in RECIPES.glob("*.py")}
    assert scripts - names == set(USER_ALGORITHM_RECIPES) | HELPERS | BASELINES


@pytest.mark.parametrize("module", USER_ALGORITHM_RECIPES)
def test_a_user_algorithm_recipe_is_not_a_shipped_algorithm(module):
    """It defines its own record, under a name no shipped algorithm has; importing it registers
    nothing (``Trainer(algorithm=...)`` in its ``main`` does)."""
    records = [v for v in vars(importlib.import_module(f"recipes.{module}")).values() if isinstance(v, Algorithm)]
    assert len(records) == 1 and records[0].name not in list_algorithms()


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_recipe_validates_and_lists_the_models_its_algorithm_uses(path):
    cfg = load_config(path)
    assert path.stem in (f"{cfg.algorithm.name}{v}_arithmetic" for v in ("", "_tools", "_lora"))
    # No model is missing, and none is listed without being used (a reference nobody reads).
    assert set(cfg.models) == set(cfg.required_models())
    assert cfg.experiment_name == path.stem


def test_remax_has_the_reference_its_kl_term_reads():
    cfg = load_config(RECIPES / "remax_arithmetic.yaml")
    assert cfg.algorithm.kl_coef > 0
    ref = cfg.models["ref"]
    assert (ref.init, ref.init_from) == ("copy", "actor")


def test_the_pipeline_paths_line_up():
    """sft exports to <run dir>/actor, rm starts from it and exports to <run dir>/reward, ppo reads that."""
    sft, rm, ppo = (load_config(RECIPES / f"{n}_arithmetic.yaml") for n in ("sft", "rm", "ppo"))
    assert Path(rm.models["reward"].path) == sft.run_dir / "actor"
    assert Path(ppo.models["reward"].path) == rm.run_dir / "reward"
    assert ppo.algorithm.reward_fn is None and "reward" in ppo.required_models()
    assert ppo.reward_fn is None  # the rollouts are scored by the model, not by a rule
    task = ("task", "num_digits", "ops", "reverse_answer", "max_prompt_len", "max_response_len")
    for cfg in (sft, rm):  # the same problems, split the same way (the split follows the seed)
        assert cfg.seed == ppo.seed
        assert [getattr(cfg.data, k) for k in task] == [getattr(ppo.data, k) for k in task]


def test_the_distillation_teacher_is_the_larger_sft_policy_and_the_student_starts_from_sft(monkeypatch):
    monkeypatch.syspath_prepend(str(RECIPES))
    from distill_arithmetic import STUDENT_LR, STUDENT_TARGET, student_stage

    sft, distill = (load_config(RECIPES / f"{n}_arithmetic.yaml") for n in ("sft", "distill"))
    assert Path(distill.models["teacher"].path) == sft.run_dir / "actor"
    teacher, student = sft.models["actor"], distill.models["actor"]
    assert teacher.hidden_size >= student.hidden_size and teacher.num_layers > student.num_layers
    assert distill.seed == sft.seed and distill.data.task == sft.data.task == "arithmetic"
    assert distill.required_models() == ("actor", "teacher")
    # The student's start: SFT at the student's shape, exported where the recipe reads it.
    stage = load_config(RECIPES / "sft_arithmetic.yaml", student_stage(distill))
    assert stage.run_dir / "actor" == Path(student.path) and stage.models["actor"].num_layers == student.num_layers
    assert stage.models["actor"].lr == STUDENT_LR and stage.trainer.target_score == STUDENT_TARGET


def test_distill_recipe_trains_the_missing_teacher_then_distils_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(RECIPES))
    from distill_arithmetic import main
    from stages import has_model

    driver = ["placement.worker_host=driver", "placement.mode=heuristic", "placement.profile=false"]
    teacher = [*SFT_TINY, *driver, "trainer.total_steps=1", "data.eval_size=2", "logging.tensorboard=false"]
    start = [*teacher, "trainer.eval_every=1"]  # the student's SFT stage, evaluated for its target score
    student = [*driver, "trainer.total_steps=2", "data.batch_size=2", "data.eval_size=2", "trainer.eval_every=0"]
    student += ["trainer.eval_before_train=false", "logging.console=false", "logging.tensorboard=false"]
    result = main([*student, "algorithm.distill_student_fraction=1"], sft_argv=teacher, student_argv=start)
    assert has_model("runs/sft_arithmetic/actor") and has_model("runs/distill_student/actor")
    stage = load_config("runs/distill_student/config.yaml")
    assert stage.algorithm.name == "sft" and stage.trainer.target_score is not None and stage.models["actor"].lr == 2e-3
    assert result.steps == 2 and len(result.mfc_seconds["teacher_inf"]) == 2


def test_the_lora_recipe_starts_from_the_main_recipes_warm_up_and_adapts_every_linear():
    grpo, lora = (load_config(RECIPES / f"{n}_arithmetic.yaml") for n in ("grpo", "grpo_lora"))
    actor = lora.models["actor"]
    assert Path(actor.path) == Path("runs/sft_warmup_arithmetic/actor") and lora.warmup.steps == 0
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # a Llama layer's
    assert set(actor.lora.target_modules) == linears
    assert lora.seed == grpo.seed and lora.data == grpo.data and lora.algorithm == grpo.algorithm
    assert lora.required_models() == ("actor",)


def test_grpo_lora_recipe_trains_the_missing_base_then_adapters_that_load_in_plain_peft(tmp_path, monkeypatch):
    """The short recipe: 1 SFT step for the base, 2 GRPO steps on its adapters; the exported adapter
    loads onto the base with ``PeftModel.from_pretrained`` and gives the merged export's logits."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rlflow.engine.lora import linear_module_names

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(RECIPES))
    from grpo_lora_arithmetic import main
    from stages import has_model

    driver = ["placement.worker_host=driver", "placement.mode=heuristic", "placement.profile=false"]
    base = [*SFT_TINY, *driver, "trainer.total_steps=1", "data.eval_size=2", "logging.console=false"]
    grpo = [*driver, "trainer.total_steps=2", "data.batch_size=2", "algorithm.n_samples=2", "data.eval_size=2"]
    grpo += ["trainer.eval_every=0", "trainer.eval_before_train=false", "logging.console=false"]
    grpo += ["logging.tensorboard=false", "models.actor.dtype=float32"]
    grpo += ["algorithm.entropy_coef=0.1"]  # an untrained base earns no reward: the entropy bonus gives a gradient
    result = main(grpo, sft_argv=base)

    base_dir = tmp_path / "runs/sft_warmup_arithmetic/actor"
    assert has_model(base_dir) and result.steps == 2
    final = Path(result.run_dir) / "final" / "actor"
    merged = AutoModelForCausalLM.from_pretrained(final, local_files_only=True, dtype=torch.float32)
    base_model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
    linears = set(linear_module_names(base_model))  # before peft wraps them
    with_adapter = peft.PeftModel.from_pretrained(base_model, str(final / "adapter"))
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    torch.testing.assert_close(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-5)
    adapted = {p.rsplit(".", 1)[-1] for p, m in with_adapter.named_modules() if hasattr(m, "lora_A")}
    assert adapted == linears == set(with_adapter.peft_config["default"].target_modules)
    with with_adapter.disable_adapter():  # the adapters moved the policy off its base
        assert not torch.allclose(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)


def _tiny_teacher_and_student() -> list[str]:
    """A tiny untrained teacher and student at the distillation recipe's paths (in the current
    directory); the overrides of a 3-step student run in the driver."""
    tok = build_char_tokenizer()
    build_tiny_model(vocab_size=len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2).save_pretrained(
        "runs/sft_arithmetic/actor"
    )
    tok.save_pretrained("runs/sft_arithmetic/actor")
    build_tiny_model(vocab_size=len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2).save_pretrained(
        "runs/distill_student/actor"
    )  # the student's start
    tok.save_pretrained("runs/distill_student/actor")
    driver = ["placement.worker_host=driver", "placement.mode=heuristic", "placement.profile=false"]
    student = [*driver, "trainer.total_steps=3", "data.batch_size=4", "data.eval_size=2", "trainer.eval_every=0"]
    return [*student, "logging.console=false", "logging.tensorboard=false", "checkpoint.every_n_steps=0"]


def test_the_distillation_baseline_is_sft_of_the_student_on_the_teachers_samples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(RECIPES))
    from distill_sft_arithmetic import main

    student = _tiny_teacher_and_student()
    # The distillation's own settings, which SFT does not read, are accepted and dropped; the split's
    # seed draws the held-out file, which then holds the problems a distillation run of it scores.
    split = ["seed=1", "data.split_seed=0"]
    result = main([*student, *split, "algorithm.distill_divergence=jsd", "algorithm.distill_jsd_beta=0.1"])
    # 3 steps of 4 sequences: every training prompt once (a pass), each with one sample of the teacher.
    rows = [json.loads(line) for line in Path("runs/distill_arithmetic_sft_data/train.jsonl").open()]
    assert len(rows) == 4096 and all(set(r) == {"prompt", "completion", "answer"} for r in rows)
    assert result.steps == 3 and "actor_train" in result.mfc_seconds and result.score_after is not None
    cfg = load_config(Path(result.run_dir) / "config.yaml")
    assert cfg.algorithm.name == "sft" and cfg.models["actor"].num_layers == 2 and cfg.data.batch_size == 4
    assert cfg.algorithm.distill_divergence == "reverse" and cfg.algorithm.distill_jsd_beta == 0.5
    held_out = [json.loads(line) for line in Path("runs/distill_arithmetic_sft_data/eval.jsonl").open()]
    seed_0 = load_config(RECIPES / "distill_arithmetic.yaml", ["seed=0", "data.eval_size=2"])
    assert cfg.data.split_seed is None and held_out == task_records(seed_0, "test", 2)


def test_the_distillation_recipe_mixes_in_the_teachers_samples_it_draws_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(RECIPES))
    from distill_arithmetic import main

    student = _tiny_teacher_and_student()
    result = main([*student, "algorithm.distill_student_fraction=0.5"])
    # 3 steps of 2 given rows need one pass over the training prompts, one teacher sample each.
    rows = [json.loads(line) for line in Path("runs/distill_arithmetic_teacher_samples/train.jsonl").open()]
    assert len(rows) == 4096 and all(set(r) == {"prompt", "completion", "answer"} for r in rows)
    records = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").open()]
    given = [r["actor_train/given_response_fraction"] for r in records if "actor_train/given_response_fraction" in r]
    assert result.steps == 3 and given == [0.5] * 3 and result.score_after is not None
    cfg = load_config(Path(result.run_dir) / "config.yaml")
    assert cfg.algorithm.name == "distill" and cfg.data.train_file.endswith("train.jsonl") and cfg.data.task is None


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ppo_recipe_trains_the_missing_reward_model_then_ppo_with_it(ray_session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipes' relative runs/ paths land here
    monkeypatch.syspath_prepend(str(RECIPES))
    from ppo_arithmetic import main
    from stages import has_model

    result = main(PPO_TINY, rm_argv=RM_TINY, sft_argv=SFT_TINY)

    assert has_model("runs/sft_arithmetic/actor") and has_model("runs/rm_arithmetic/reward")
    config = json.loads((tmp_path / "runs/rm_arithmetic/reward/config.json").read_text())
    assert any(a.endswith("ForTokenClassification") for a in config["architectures"])
    assert result.steps == 2 and len(result.mfc_seconds["reward_inf"]) == 2
    plan = json.loads((Path(result.run_dir) / "plan.json").read_text())
    reward_calls = [c for c in plan["calls"] if c["name"] == "reward_inf"]
    assert [c["model"] for c in reward_calls] == ["reward"], "the reward is a model placed on the workers"
    run_cfg = load_config(Path(result.run_dir) / "config.yaml")
    assert Path(run_cfg.models["reward"].path).resolve() == (tmp_path / "runs/rm_arithmetic/reward").resolve()
    # Held-out evaluation is the task's exact-match rule: scores are fractions of the 8 prompts.
    assert result.score_before is not None and result.score_after is not None
    assert all(abs(score * 8 - round(score * 8)) < 1e-6 for _, score in result.eval_history)
