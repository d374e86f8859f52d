"""What the driver reads before any worker starts: recipe arguments, paths, task data, warm-up settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import ConfigError, load_config
from rlflow.trainer.build import resolve_paths
from rlflow.trainer.data import build_trainer_data, split_examples, task_records
from rlflow.trainer.recipe import recipe_args

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"


# ---------------------------------------------------------------------------- recipe arguments
@pytest.mark.parametrize(
    ("argv", "source", "overrides"),
    [
        (["data.train_file=train.yaml", "seed=1"], "default.yaml", ["data.train_file=train.yaml", "seed=1"]),
        (["mine.yaml", "data.eval_file=test.yml"], "mine.yaml", ["data.eval_file=test.yml"]),
        (["configs/mine.conf"], "configs/mine.conf", []),
        ([], "default.yaml", []),
    ],
)
def test_only_a_first_argument_without_equals_sign_is_the_recipe(argv, source, overrides):
    assert recipe_args("default.yaml", argv) == (source, overrides)


def test_an_override_naming_a_yaml_file_reaches_the_config(tmp_path):
    (tmp_path / "train.yaml").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    files = [f"data.train_file={tmp_path / 'train.yaml'}", f"data.eval_file={tmp_path / 'train.yaml'}"]
    source, overrides = recipe_args(GRPO, [*files, "data.task=null"])
    cfg = load_config(source, overrides)
    assert cfg.experiment_name == "grpo_arithmetic" and cfg.data.train_file == str(tmp_path / "train.yaml")


# ---------------------------------------------------------------------------- paths
def test_every_path_of_the_config_becomes_absolute_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for directory in ("base_model", "tok", "ckpts/step_3"):
        (tmp_path / directory).mkdir(parents=True)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    cfg = load_config(
        None,
        [
            "models.actor.init=path",
            "models.actor.path=base_model",
            "data.tokenizer=./tok",
            "data.task=null",
            "data.train_file=train.jsonl",
            "data.eval_file=test.jsonl",
            "algorithm.reward_fn=numeric_match",
            "checkpoint.dir=ckpts",
            "checkpoint.resume=ckpts/step_3",
        ],
    )
    resolved = resolve_paths(cfg)
    assert resolved.models["actor"].path == str(tmp_path / "base_model")
    assert resolved.data.tokenizer == str(tmp_path / "tok")
    assert (resolved.data.train_file, resolved.data.eval_file) == (
        str(tmp_path / "train.jsonl"),
        str(tmp_path / "test.jsonl"),
    )
    assert resolved.logging.dir == str(tmp_path / "runs" / "rlflow")  # the default run directory too
    assert resolved.checkpoint.dir == str(tmp_path / "ckpts")
    assert resolved.checkpoint.resume == str(tmp_path / "ckpts" / "step_3")
    elsewhere = resolve_paths(load_config(None, ["checkpoint.dir=ckpts"]), base=tmp_path / "other")
    assert elsewhere.checkpoint.dir == str(tmp_path / "other" / "ckpts")
    assert resolve_paths(load_config(None, ["checkpoint.resume=auto"])).checkpoint.resume == "auto"
    assert resolve_paths(resolved) == resolved  # absolute paths stay as they are


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["models.actor.init=path", "models.actor.path=missing_model"], "models.actor.path"),
        (["data.tokenizer=missing_tokenizer"], "data.tokenizer"),
        (
            [
                "data.task=null",
                "data.train_file=missing.jsonl",
                "data.eval_size=0",
                "algorithm.reward_fn=numeric_match",
            ],
            "data.train_file",
        ),
        (["data.eval_file=missing.jsonl"], "data.eval_file"),
    ],
)
def test_a_missing_input_path_names_its_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        resolve_paths(load_config(None, overrides), base=tmp_path)
    assert info.value.key == key and "does not exist" in str(info.value) and str(tmp_path) in str(info.value)


# ---------------------------------------------------------------------------- task data
ONE_DIGIT = ["data.num_digits=1", "data.batch_size=8", "warmup.steps=1", "warmup.batch_size=16"]


def test_one_digit_arithmetic_trains_on_every_problem_it_has():
    tokenizer = build_char_tokenizer()
    train, test = (split_examples(load_config(None, ONE_DIGIT).data.build_task(0), s) for s in ("train", "test"))
    assert len(train) + len(test) == 100 and len(test) == 13
    data = build_trainer_data(load_config(None, [*ONE_DIGIT, "data.eval_size=13"]), tokenizer)
    assert len(data.train.dataset) == len(data.warmup.dataset) == 87  # all of them, not 4096
    prompts = [
        tokenizer.decode(row[mask.bool()])
        for row, mask in zip(data.eval_prompts.batch["prompts"], data.eval_prompts.batch["prompt_mask"])
    ]
    assert len(set(prompts)) == 13
    batch = next(iter(data.train))
    assert batch.batch["prompts"].shape[0] == 8


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        ("data.eval_size=14", "data.eval_size", "holds only 13 held-out problems"),
        ("warmup.batch_size=128", "warmup.batch_size", "128 is more than the 87 training examples"),
        ("data.batch_size=100", "data.batch_size", "100 is more than the 87 training examples"),
    ],
)
def test_a_task_too_small_for_the_request_says_so(override, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_trainer_data(load_config(None, [*ONE_DIGIT, "data.eval_size=13", override]), build_char_tokenizer())
    assert info.value.key == key


def test_countdown_with_fewer_instances_than_the_training_request_uses_them_all():
    cfg = load_config(None, ["data.task=countdown", "data.max_prompt_len=32", "data.max_response_len=16"])
    data = build_trainer_data(cfg, build_char_tokenizer())
    assert len(data.train.dataset) == len(split_examples(cfg.data.build_task(0), "train")) < 4096
    assert len(data.eval_prompts) == cfg.data.eval_size


def test_a_split_seed_keeps_the_held_out_problems_across_run_seeds():
    def records(*overrides: str) -> tuple[list, list]:
        cfg = load_config(None, list(overrides))
        return task_records(cfg, "train", 64), task_records(cfg, "test", cfg.data.eval_size)

    train, held_out = records("seed=0")
    other_train, other_held_out = records("seed=1", "data.split_seed=0")
    assert other_held_out == held_out and other_train != train  # the run's seed still draws the training prompts
    split_0_test = {e.prompt for e in split_examples(load_config(None).data.build_task(0), "test")}
    assert not split_0_test & {r["prompt"] for r in other_train}
    split_1 = records("seed=1", "data.split_seed=1")
    assert split_1 == records("seed=1") and split_1[1] != held_out  # null: the run's seed splits


# ---------------------------------------------------------------- warm-up and target settings
@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["warmup.steps=10", "warmup.target_score=0.5"], "warmup.target_score", "eval_every=0 must be > 0"),
        (
            ["warmup.steps=10", "warmup.eval_every=5", "warmup.target_score=0.5", "data.eval_size=0"],
            "warmup.target_score",
            "data.eval_size is 0",
        ),
        (["trainer.target_score=0.9", "trainer.eval_every=0"], "trainer.target_score", "eval_every=0 must be > 0"),
        (["trainer.target_score=0.9", "data.eval_size=0"], "trainer.target_score", "data.eval_size is 0"),
        (
            ["algorithm.name=rm", "trainer.eval_every=5", "trainer.target_score=0.9"],
            "trainer.target_score",
            "no held-out generation to score",
        ),
    ],
)
def test_settings_on_held_out_scores_need_a_held_out_score(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(REPO / "recipes" / "rm_arithmetic.yaml" if "algorithm.name=rm" in overrides else None, overrides)
    assert info.value.key == key


def test_a_dpo_warmup_is_evaluated_like_any_policy():
    dpo = ["algorithm.name=dpo", "models.ref.init=copy", "models.ref.init_from=actor"]
    cfg = load_config(None, [*dpo, "warmup.steps=10", "warmup.eval_every=5", "warmup.target_score=0.5"])
    assert cfg.warmup.eval_every == 5


def test_warmup_target_is_off_by_default_and_inert_without_a_warmup():
    assert load_config().warmup.target_score is None and load_config().warmup.eval_every == 0
    cfg = load_config(GRPO, ["warmup.eval_every=25", "warmup.target_score=0.7"])
    assert (cfg.warmup.eval_every, cfg.warmup.target_score) == (25, 0.7)
    # The main recipe sets a target; turning its warm-up off must not make the target an error.
    assert load_config(GRPO, ["warmup.steps=0"]).warmup.steps == 0
