"""What a Python caller hands the Trainer, checked at construction without Ray: the config forms,
datasets with every column, reward signatures, defaults that follow each other, callbacks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from ray import cloudpickle

from rlflow.data.datasets import DatasetFormatError, PromptDataset
from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import ConfigError, Trainer, build, load_config
from rlflow.trainer.callbacks import Callbacks
from rlflow.trainer.data import prompts_to_proto
from rlflow.workers.reward_funcs import check_reward_signature, pack_reward_funcs, score_completions

ROWS = [{"prompt": f"{i}+1=", "label": str(i + 1), "weight": i % 3} for i in range(8)]
SMALL = {
    "algorithm": {"name": "grpo", "n_samples": 2},
    "data": {"batch_size": 4},
    "trainer": {"total_steps": 1},
    "logging": {"tensorboard": False},
}


def label_reward(prompts, completions, label, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, label)]


@pytest.fixture
def no_ray(monkeypatch):
    """Construction must not start Ray, profile, plan or spawn workers."""

    def refuse(cfg):
        raise AssertionError("Trainer.__init__ started Ray")

    monkeypatch.setattr(build, "ensure_ray", refuse)


def make(tmp_path, **kwargs) -> Trainer:
    kwargs.setdefault("reward_funcs", label_reward)
    kwargs.setdefault("train_dataset", ROWS)
    return Trainer({**SMALL, "logging": {"dir": str(tmp_path / "run"), "tensorboard": False}}, **kwargs)


def test_construction_prepares_without_launching(tmp_path, no_ray):
    model = build_tiny_model(
        vocab_size=len(build_char_tokenizer()), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1
    )
    trainer = make(tmp_path, model=model, tokenizer=build_char_tokenizer(), callbacks=[lambda s, m: None])
    assert not trainer.launched and not hasattr(trainer, "placement")
    cfg = trainer.cfg
    assert cfg.data.task is None and cfg.models["actor"].init == "path"
    assert (tmp_path / "run" / "models" / "actor_init" / "config.json").is_file()
    assert cfg.data.tokenizer == str(tmp_path / "run" / "tokenizer")
    lines = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert lines == ROWS
    assert trainer.data.columns == ("prompt", "label", "weight")  # every column kept
    assert trainer.data.eval_prompts is None  # no eval_dataset: no held-out score
    trainer.close()  # nothing launched: nothing to release


def test_every_column_reaches_the_rows_the_reward_reads(tmp_path, no_ray):
    trainer = make(tmp_path)
    batch = next(iter(trainer.data.train))
    rows = batch.non_tensor_batch["columns"]
    assert {tuple(sorted(r)) for r in rows} == {("label", "prompt", "weight")}
    assert all(r in ROWS for r in rows)


def test_a_reward_naming_a_missing_column_is_refused_at_construction(tmp_path, no_ray):
    def needs_answer(prompts, completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"needs column\(s\) \['answer'\].*\['label', 'weight'\]"):
        make(tmp_path, reward_funcs=[needs_answer])


def test_reward_signatures():
    check_reward_signature(label_reward, {"label"})
    check_reward_signature(lambda completions, prompts, weight=1: [], set())  # defaults need no column
    with pytest.raises(TypeError, match="must accept"):
        check_reward_signature(lambda texts: [], {"label"})
    with pytest.raises(TypeError, match="positional-only"):
        check_reward_signature(lambda prompts, completions, /, **kw: [], set())


def test_rewards_are_summed_with_weights_and_none_is_skipped():
    def half(prompts, completions, **kwargs):
        return [0.5] * len(completions)

    def only_first(prompts, completions, **kwargs):
        return [1.0] + [None] * (len(completions) - 1)

    def skip_all(prompts, completions, **kwargs):
        return [None] * len(completions)

    funcs = pack_reward_funcs([half, only_first, skip_all], [2.0, 3.0, 1.0])
    rewards, means = score_completions(funcs, ["a", "b"], ["x", "y"], {"label": ["1", "2"]})
    assert rewards.tolist() == [4.0, 1.0]
    assert means["rewards/half"] == 0.5 and means["rewards/only_first"] == 1.0
    assert means["rewards/skip_all"] != means["rewards/skip_all"]  # NaN: it scored nothing

    def two(prompts, completions, **kwargs):
        return [0.0, 0.0]

    with pytest.raises(ValueError, match="'two' returned 2 values for 3 completions"):
        score_completions(pack_reward_funcs([two]), ["a"] * 3, ["x"] * 3, {})
    with pytest.raises(ValueError, match="repeat"):
        pack_reward_funcs([half, half])
    with pytest.raises(ValueError, match="1 values for 2 reward functions"):
        pack_reward_funcs([half, only_first], [1.0])


def test_a_function_of_a_module_workers_cannot_import_is_pickled_by_value(tmp_path, monkeypatch):
    (tmp_path / "my_local_rewards.py").write_text(
        textwrap.dedent(
            """
            BONUS = 0.25

            def bonus(prompts, completions, **kwargs):
                return [BONUS + len(c) for c in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_local_rewards

    payload = pack_reward_funcs([my_local_rewards.bonus]).payload
    # A fresh interpreter without tmp_path on its path, as a Ray worker: the code travels with the payload.
    script = "import pickle, sys; fn, = pickle.loads(sys.stdin.buffer.read()); print(fn([''], ['abc']))"
    out = subprocess.run([sys.executable, "-c", script], input=payload, capture_output=True, check=True)
    assert out.stdout.decode().strip() == "[3.25]"
    assert "my_local_rewards" not in cloudpickle.list_registry_pickle_by_value()  # nothing left registered


def test_response_length_follows_max_new_tokens_and_a_train_file_means_no_task(tmp_path):
    cfg = load_config(None, ["rollout.max_new_tokens=32"])
    assert (cfg.rollout.max_new_tokens, cfg.data.max_response_len) == (32, 32)
    assert load_config(None, ["data.max_response_len=12"]).rollout.max_new_tokens == 12
    assert load_config().data.max_response_len == 8
    with pytest.raises(ConfigError, match="32 > data.max_response_len=8"):
        load_config(None, ["rollout.max_new_tokens=32", "data.max_response_len=8"])
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(None, [f"data.train_file={path}", "algorithm.reward_fn=numeric_match"])
    assert cfg.data.task is None and cfg.data.eval_file is None


def test_an_over_long_prompt_names_its_row_unless_truncated_from_the_left():
    tokenizer = build_char_tokenizer()
    rows = [{"prompt": "1+1="}, {"prompt": "123456789+1="}]
    with pytest.raises(
        DatasetFormatError, match=r"<records>:2: prompt has 13 tokens > max_prompt_length=6.*truncation=left"
    ):
        PromptDataset(rows, tokenizer, 6)
    with pytest.warns(UserWarning, match="truncated 1 of 2"):
        kept = PromptDataset(rows, tokenizer, 6, truncation="left")
    assert tokenizer.decode(kept[1]["input_ids"], skip_special_tokens=True) == "89+1="  # BOS + the last 5
    assert load_config(None, ["data.truncation=left"]).data.truncation == "left"


def test_a_conversational_prompt_needs_a_chat_template():
    rows = [{"prompt": [{"role": "user", "content": "1+1="}]}]
    with pytest.raises(DatasetFormatError, match="no chat template"):
        PromptDataset(rows, build_char_tokenizer(), 16)
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    item = PromptDataset(rows, tokenizer, 16)[0]
    assert tokenizer.decode(item["input_ids"]) == "1+1=" and item["prompt"] == rows[0]["prompt"]


def test_prompt_rows_carry_every_field():
    dataset = PromptDataset(ROWS[:2], build_char_tokenizer(), 16)
    proto = prompts_to_proto(dataset.collate([dataset[0], dataset[1]]))
    assert list(proto.non_tensor_batch["columns"]) == ROWS[:2]


def test_datasets_dataset_rows_keep_their_columns(tmp_path, no_ray):
    import datasets  # in the test extra: the optional input type is tested for real

    trainer = make(tmp_path, train_dataset=datasets.Dataset.from_list(ROWS))
    assert trainer.data.columns == ("prompt", "label", "weight")


def test_config_forms_and_sources_of_reward(tmp_path, no_ray):
    with pytest.raises(ValueError, match="apply to a YAML path or a dict"):
        Trainer(load_config(), overrides=["trainer.total_steps=2"])
    trainer = make(tmp_path, overrides=["trainer.total_steps=3"], algorithm="rloo")
    assert trainer.cfg.trainer.total_steps == 3 and trainer.cfg.algorithm.name == "rloo"
    with pytest.raises(ConfigError, match="both give rewards"):
        make(tmp_path, overrides=["algorithm.reward_fn=numeric_match"])
    with pytest.raises(ConfigError, match=r"reward_funcs=\[fn\]"):
        make(tmp_path, reward_funcs=None)


def test_callbacks_take_functions_and_objects_and_may_ask_to_stop():
    seen = []

    class Stopper:
        def on_step_end(self, step, metrics):
            seen.append(("object", step))
            return step >= 2

    hooks = Callbacks([lambda step, metrics: seen.append(("fn", step, metrics["loss"])), Stopper()])
    assert hooks(1, {"loss": 1.0}) is False and hooks(2, {"loss": 0.5}) is True and hooks.stop_requested
    assert seen == [("fn", 1, 1.0), ("object", 1), ("fn", 2, 0.5), ("object", 2)]
    with pytest.raises(TypeError, match="neither a function"):
        Callbacks([42])


def test_a_model_smaller_than_the_tokenizer_is_refused_at_construction(tmp_path, no_ray):
    model = build_tiny_model(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match=r"models\.actor\.path: .*vocab_size=16 < the \d+ tokens of the tokenizer"):
        make(tmp_path, model=model)  # no tokenizer given: the built-in one has more tokens


def test_an_algorithm_record_is_registered_and_named_in_the_config(tmp_path, no_ray):
    from dataclasses import replace

    from rlflow.dataflow.algorithms import get_algorithm

    record = replace(get_algorithm("grpo"), name="grpo_from_python")
    trainer = make(tmp_path, algorithm=record)
    assert trainer.cfg.algorithm.name == "grpo_from_python" and get_algorithm("grpo_from_python") is record
    assert make(tmp_path, algorithm=record).cfg.algorithm.name == "grpo_from_python"  # the same record again
    with pytest.raises(ValueError, match="another algorithm is registered as 'grpo_from_python'"):
        make(tmp_path, algorithm=replace(record, description="another"))
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        make(tmp_path, algorithm="nope")
