"""What a finished run leaves a user: the final model (loads and generates with plain transformers),
checkpoint exports with the tokenizer, the measured timeline as a Perfetto / Chrome trace, and the
torch-profiler traces of the calls asked for.

Most tests check one tiny GRPO run of two steps, its one worker in the driver (no Ray); a run
stopped by a callback, one stopped by SIGINT and one on two Ray workers have tests of their own.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlflow.trainer import ConfigError, Trainer, load_config

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"
STEPS = 2
TINY = [
    "models.actor.hidden_size=32",
    "models.actor.intermediate_size=64",
    "models.actor.num_layers=1",
    "models.actor.num_heads=2",
    "models.actor.num_kv_heads=1",
    "models.actor.lr=1e-2",
    "algorithm.n_samples=2",
    "algorithm.entropy_coef=0.1",  # rewards are 0 this early: the bonus moves the weights
    "data.batch_size=2",
    "data.eval_size=2",
    "rollout.temperature=0.8",
    "warmup.steps=0",
    "placement.mode=heuristic",
    "placement.worker_host=driver",
    "placement.profile=false",
    "logging.console=false",
    "logging.tensorboard=false",
]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("outputs") / "run"
    overrides = [
        *TINY,
        f"trainer.total_steps={STEPS}",
        "trainer.eval_before_train=false",
        "trainer.eval_every=0",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=1",  # pruning runs at every save: the final directory is not its to delete
        "trainer.profile_calls=[actor_train]",
        "trainer.profile_steps=[2]",
        f"logging.dir={run_dir}",
    ]
    with Trainer(load_config(GRPO, overrides), progress_bars=False) as trainer:
        trainer.fit()
    return run_dir


def test_the_final_model_loads_and_generates_with_transformers_alone(run_dir):
    final = run_dir / "final" / "actor"
    assert sorted(p.name for p in (run_dir / "final").iterdir()) == ["actor"]  # no temporary left
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{STEPS}"]
    exported = load_file(run_dir / "checkpoints" / f"step_{STEPS}" / "actor" / "hf" / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(final)
    weights = model.state_dict()
    for name, tensor in exported.items():
        assert torch.equal(weights[name], tensor), name
    initial = AutoModelForCausalLM.from_pretrained(run_dir / "models" / "actor").state_dict()
    assert any(not torch.equal(initial[n], t) for n, t in exported.items())  # the trained weights, not the start
    tokenizer = AutoTokenizer.from_pretrained(final)
    generation = GenerationConfig.from_pretrained(final)
    assert generation.temperature == 0.8 and generation.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer(["1+2=", "3+4="], return_tensors="pt", padding=True)
    out = model.generate(**prompt, max_new_tokens=3)
    assert out.shape[0] == 2 and prompt.input_ids.shape[1] < out.shape[1] <= prompt.input_ids.shape[1] + 3


def test_checkpoint_exports_carry_the_tokenizer(run_dir):
    export = run_dir / "checkpoints" / f"step_{STEPS}" / "actor" / "hf"
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.decode(tokenizer("12+3=").input_ids, skip_special_tokens=True) == "12+3="
    assert GenerationConfig.from_pretrained(export).do_sample


def test_the_measured_timeline_is_a_trace_of_every_call(run_dir):
    trace = json.loads((run_dir / "timeline.trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    calls = [e for e in events if e["args"]["kind"] == "call"]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0 for e in events)  # one worker: rank 0
    steps = {(e["args"]["step"], e["name"]) for e in calls}
    for step in range(1, STEPS + 1):  # each step's calls once on the one rank
        assert {(step, name) for name in ("actor_gen", "reward_inf", "actor_train")} <= steps
    assert len(calls) == len(steps)
    train = next(e for e in calls if e["name"] == "actor_train")
    assert (train["args"]["dp"], train["args"]["tp"], train["args"]["pp"]) == (1, 1, 1)


def test_the_chosen_call_is_profiled_at_the_chosen_step(run_dir):
    assert sorted(p.name for p in (run_dir / "profiles").iterdir()) == [f"step{STEPS}_actor_train_rank0.json"]
    trace = json.loads((run_dir / "profiles" / f"step{STEPS}_actor_train_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)
    assert "aten::mm" in names or "aten::addmm" in names or "aten::matmul" in names


def test_an_unknown_call_to_profile_is_refused_naming_the_calls(tmp_path):
    overrides = [*TINY, "trainer.profile_calls=[actor_trian]", "trainer.profile_steps=[1]", f"logging.dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"trainer.profile_calls: \['actor_trian'\] .*'actor_train'"):
        Trainer(load_config(GRPO, overrides), progress_bars=False)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.profile_calls=[actor_train]"], "trainer.profile_steps: empty, but profile_calls=['actor_train']"),
        (["trainer.profile_steps=[1]"], "trainer.profile_calls: empty, but profile_steps=[1]"),
        (["trainer.profile_calls=[actor_gen]", "trainer.profile_steps=[-1]"], "trainer.profile_steps: [-1]"),
    ],
)
def test_profiling_needs_calls_and_steps_both(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(GRPO, overrides)


def test_a_run_stopped_by_a_callback_leaves_its_final_model_where_final_dir_says(tmp_path):
    overrides = [
        *TINY,
        "trainer.total_steps=3",
        "trainer.eval_before_train=false",
        f"checkpoint.final_dir={tmp_path / 'exported'}",
        f"logging.dir={tmp_path / 'run'}",
    ]
    with Trainer(load_config(GRPO, overrides), callbacks=[lambda step, metrics: step >= 1], progress_bars=False) as t:
        steps = t.fit().steps
    assert steps < 3  # the step issued ahead of the stop finishes too
    assert not (tmp_path / "run" / "final").exists()
    final = load_file(tmp_path / "exported" / "actor" / "model.safetensors")
    saved = load_file(tmp_path / "run" / "checkpoints" / f"step_{steps}" / "actor" / "hf" / "model.safetensors")
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
    assert AutoTokenizer.from_pretrained(tmp_path / "exported" / "actor").eos_token == "<eos>"


@pytest.mark.parametrize(("target", "steps"), [(0.0, 2), (1.5, 4)])
def test_a_run_stops_at_the_first_evaluation_that_reaches_target_score(tmp_path, target, steps):
    """Every score reaches 0 (the run stops at its first evaluation, step 2, and saves its final
    checkpoint there); none reaches 1.5 (all four steps run)."""
    overrides = [*TINY, "trainer.total_steps=4", "trainer.eval_every=2", f"trainer.target_score={target}"]
    overrides += ["trainer.eval_before_train=false", "checkpoint.every_n_steps=0", f"logging.dir={tmp_path}"]
    with Trainer(load_config(GRPO, overrides), progress_bars=False) as t:
        result = t.fit()
    assert result.steps == steps and [step for step, _ in result.eval_history] == [2, steps]  # a loop's, the final
    assert (tmp_path / "checkpoints" / f"step_{steps}").is_dir() and (tmp_path / "final" / "actor").is_dir()


def test_a_run_stopped_by_sigint_leaves_its_final_model_and_save_hf_false_no_checkpoint_export(tmp_path):
    overrides = [*TINY, "trainer.total_steps=3", "checkpoint.save_hf=false", f"logging.dir={tmp_path}"]

    sent = []

    def interrupt(step, metrics):  # called for every log of a step: one signal (a second acts at once)
        if step >= 1 and not sent:  # in training: before it (step 0's evaluation) SIGINT interrupts as usual
            sent.append(step)
            os.kill(os.getpid(), signal.SIGINT)  # rlflow's handler: finish the step in flight, save, exit

    with Trainer(load_config(GRPO, overrides), callbacks=[interrupt], progress_bars=False) as trainer:
        with pytest.raises(KeyboardInterrupt):
            trainer.fit()
        steps = trainer.step
    checkpoint = tmp_path / "checkpoints" / f"step_{steps}" / "actor"
    assert (checkpoint / "engine").is_dir() and not (checkpoint / "hf").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "actor")
    assert model.generation_config.temperature == 0.8


@pytest.mark.distributed
@pytest.mark.slow  # Ray's start, when the session has not started it yet
def test_two_ray_workers_each_write_the_profile_of_their_share_of_the_call(ray_session, tmp_path):
    overrides = [
        *[o for o in TINY if not o.startswith(("placement.mode", "placement.worker_host"))],
        "placement.mode=colocated",  # every call data-parallel over both workers
        "placement.worker_host=ray",
        "placement.devices_per_node=2",
        "data.batch_size=4",
        "trainer.total_steps=1",
        "trainer.eval_before_train=false",
        "trainer.profile_calls=[actor_gen]",
        "trainer.profile_steps=[1]",
        f"logging.dir={tmp_path}",
    ]
    with Trainer(load_config(GRPO, overrides), progress_bars=False) as trainer:
        trainer.fit()
    profiles = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert profiles == ["step1_actor_gen_rank0.json", "step1_actor_gen_rank1.json"]
    for name in profiles:
        events = json.loads((tmp_path / "profiles" / name).read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)
    trace = json.loads((tmp_path / "timeline.trace.json").read_text())
    gen = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "actor_gen"]
    assert sorted(e["pid"] for e in gen) == [0, 1] and all(e["args"]["dp"] == 2 for e in gen)
