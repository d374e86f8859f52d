"""On-policy distillation through ``Trainer.fit()``: a larger tiny teacher, trained first by SFT on the
main task, is distilled into a smaller student; the teacher's frozen call is in the graph and the
plan, the student's reverse KL to it falls; a teacher of another vocabulary or none is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tiny_fit import DRIVER_FIT, GRPO, REPO, TINY_ACTOR
from transformers import AutoModelForCausalLM

from rlflow.data.datasets import DatasetFormatError
from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer, load_tokenizer
from rlflow.trainer import ConfigError, Trainer, load_config

SFT = REPO / "recipes" / "sft_arithmetic.yaml"
# Twice the student's width and layers (TINY_ACTOR: width 32, one layer).
TEACHER_SHAPE = ["hidden_size=64", "intermediate_size=128", "num_layers=2", "num_heads=2", "num_kv_heads=2"]
QUIET = [
    "placement.worker_host=driver", "placement.mode=heuristic", "placement.profile=false",
    "logging.console=false", "logging.tensorboard=false", "data.eval_size=2", "trainer.eval_every=0",
]  # fmt: skip
DISTILL = [*TINY_ACTOR, *DRIVER_FIT, "algorithm.name=distill"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A teacher trained for 40 SFT steps on the main task (2-digit addition): its answers are peaked
    where a freshly initialised student's are near uniform."""
    run = tmp_path_factory.mktemp("teacher")
    overrides = [*(f"models.actor.{o}" for o in TEACHER_SHAPE), *QUIET, "trainer.total_steps=40"]
    overrides += [
        "data.batch_size=64",
        f"logging.dir={run}",
        "checkpoint.every_n_steps=0",
        "checkpoint.save_final=false",
    ]
    with Trainer(SFT, overrides=overrides, progress_bars=False) as trainer:
        trainer.fit()
    return run / "final" / "actor"


def exact_reverse_kl(student: Path, teacher: Path, tokenizer: Path) -> float:
    """KL(student || teacher) over the whole vocabulary, mean over the answer tokens of 64 held-out
    problems: a measure independent of the run's own (sampled, k1) metric."""
    task = load_config(GRPO, ["data.eval_size=2"]).data.build_task(0)
    tok = load_tokenizer(str(tokenizer))
    kls = []
    s_model, t_model = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (student, teacher))
    for ex in task.sample("test", 64):
        prompt = tok(ex.prompt)["input_ids"]
        ids = torch.tensor([prompt + tok(ex.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]])
        with torch.no_grad():
            s, t = (m(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1) for m in (s_model, t_model))
        kls.append((s.exp() * (s - t)).sum(-1).mean())
    return float(torch.stack(kls).mean())


def test_the_student_moves_toward_the_teacher(teacher, tmp_path):
    run = tmp_path / "run"
    overrides = [*DISTILL, "trainer.total_steps=12", "data.batch_size=8", "algorithm.n_samples=4"]
    overrides += [
        "models.actor.lr=2e-2",
        "models.teacher.init=path",
        f"models.teacher.path={teacher}",
        f"logging.dir={run}",
    ]
    with Trainer(GRPO, overrides=overrides, progress_bars=False) as trainer:
        assert list(trainer.graph.nodes) == ["actor_gen", "teacher_inf", "actor_train"]
        trainer.fit()
        problem = trainer.placement.problem
    # The planner placed the frozen teacher and counted its weights (twice the student's width and depth).
    models = {m.name: m for m in problem.models}
    assert not models["teacher"].trainable and models["actor"].trainable
    bytes_of = {name: problem.options[i][0].weight_bytes for i, name in enumerate(problem.mfc_names)}
    assert bytes_of["teacher_inf"] > 4 * bytes_of["actor_gen"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["actor_train/distill_reverse_kl"] for r in records if "actor_train/distill_reverse_kl" in r]
    assert len(kl) == 12 and all(
        r["actor_train/distill_share"] == 1.0 for r in records if "actor_train/distill_share" in r
    )
    # The student starts far from the peaked SFT teacher and ends close: by the run's metric, and exactly.
    assert sum(kl[-3:]) / 3 < 0.4 * sum(kl[:3]) / 3, kl
    before = exact_reverse_kl(run / "models" / "actor", teacher, run / "tokenizer")
    after = exact_reverse_kl(run / "final" / "actor", teacher, run / "tokenizer")
    assert after < 0.5 * before, (before, after)


def _full_vocab_fit(teacher, run, extra: list[str], check_graph: bool = False) -> list[float]:
    """An 8-step full-vocabulary distillation fit (``extra`` on top); its per-step ``distill_vocab_kl``."""
    overrides = [*DISTILL, "algorithm.distill_loss=full_vocab", *extra, "trainer.total_steps=8", "data.batch_size=8"]
    overrides += [
        "algorithm.n_samples=2",
        "models.actor.lr=2e-2",
        "models.teacher.init=path",
        f"models.teacher.path={teacher}",
        f"logging.dir={run}",
    ]
    with Trainer(GRPO, overrides=overrides, progress_bars=False) as trainer:
        if check_graph:
            assert "teacher_vocab_logp" in trainer.graph.nodes["actor_train"]["mfc"].input_keys
        trainer.fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["actor_train/distill_vocab_kl"] for r in records if "actor_train/distill_vocab_kl" in r]


def test_the_full_vocabulary_loss_moves_the_student_toward_the_teacher(teacher, tmp_path):
    run = tmp_path / "run"
    kl = _full_vocab_fit(teacher, run, [], check_graph=True)
    assert len(kl) == 8 and all(k >= 0 for k in kl), kl
    # The loss is the exact KL on the student's own samples: it falls, and so does the KL on held-out answers.
    assert sum(kl[-2:]) / 2 < 0.5 * sum(kl[:2]) / 2, kl
    before = exact_reverse_kl(run / "models" / "actor", teacher, run / "tokenizer")
    after = exact_reverse_kl(run / "final" / "actor", teacher, run / "tokenizer")
    assert after < 0.5 * before, (before, after)


def test_the_jsd_loss_moves_the_student_toward_the_teacher(teacher, tmp_path):
    run = tmp_path / "run"
    jsd = _full_vocab_fit(teacher, run, ["algorithm.distill_divergence=jsd", "algorithm.distill_jsd_beta=0.5"])
    # JSD_0.5 lies in [0, log 2]; on the student's own samples it falls, and the exact KL on held-out answers too.
    assert len(jsd) == 8 and all(0 <= j <= math.log(2) for j in jsd), jsd
    assert sum(jsd[-2:]) / 2 < 0.5 * sum(jsd[:2]) / 2, jsd
    before = exact_reverse_kl(run / "models" / "actor", teacher, run / "tokenizer")
    after = exact_reverse_kl(run / "final" / "actor", teacher, run / "tokenizer")
    assert after < 0.5 * before, (before, after)


def test_a_reward_and_the_teacher_mixed(tmp_path):
    run = tmp_path / "run"
    teacher = ["models.teacher.init=tiny", *(f"models.teacher.{o}" for o in TEACHER_SHAPE)]
    overrides = [*TINY_ACTOR, *DRIVER_FIT, *teacher, "algorithm.distill_coef=0.5", "trainer.total_steps=2"]
    with Trainer(GRPO, overrides=[*overrides, f"logging.dir={run}"], progress_bars=False) as trainer:
        assert list(trainer.graph.nodes) == ["actor_gen", "teacher_inf", "reward_inf", "actor_train"]
        trainer.fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [r["actor_train/distill_share"] for r in records if "actor_train/distill_share" in r]
    # An untrained policy scores 0 everywhere: GRPO's advantages are 0, the teacher's signal is all there is.
    assert len(shares) == 2 and all(0.0 < s <= 1.0 for s in shares)
    assert all("actor_train/score_mean" in r for r in records if "actor_train/distill_share" in r)


def test_a_teacher_of_another_vocabulary_is_refused_before_any_worker_starts(tmp_path):
    vocab = len(build_char_tokenizer())
    build_tiny_model(vocab_size=vocab + 8, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2).save_pretrained(
        tmp_path / "teacher"
    )
    overrides = [*DISTILL, f"logging.dir={tmp_path / 'run'}", "models.teacher.init=path"]
    # Construction fails: fit(), which starts the workers, is never reached.
    with pytest.raises(ConfigError, match=f"vocab_size={vocab + 8}, but the student .* has vocab_size={vocab}") as err:
        Trainer(GRPO, overrides=[*overrides, f"models.teacher.path={tmp_path / 'teacher'}"], progress_bars=False)
    assert err.value.key == "models.teacher"


def test_a_distillation_without_a_teacher_names_models_teacher():
    for algorithm in (["algorithm.name=distill"], ["algorithm.distill_coef=0.5"]):
        with pytest.raises(ConfigError, match="missing: algorithm '(distill|grpo)' needs a teacher model") as err:
            load_config(GRPO, [*TINY_ACTOR, *algorithm])
        assert err.value.key == "models.teacher"


def test_other_bad_distillation_settings_name_their_field():
    teacher = ["models.teacher.init=tiny"]
    cases = {
        "algorithm.adv_estimator": ["algorithm.name=distill", "algorithm.adv_estimator=grpo"],
        "models.teacher.trainable": ["algorithm.name=distill", "models.teacher.trainable=true"],
        "algorithm.distill_coef": ["algorithm.name=sft", "algorithm.distill_coef=0.5"],
        "algorithm.distill_jsd_beta": [
            "algorithm.name=distill",
            "algorithm.distill_loss=full_vocab",
            "algorithm.distill_divergence=jsd",
            "algorithm.distill_jsd_beta=1.0",
        ],
    }
    for key, overrides in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(GRPO, [*TINY_ACTOR, *teacher, *overrides])
        assert err.value.key == key, (key, str(err.value))
    # A teacher beside an algorithm that reads none is not built.
    assert "teacher" not in load_config(GRPO, [*TINY_ACTOR, *teacher]).required_models()


def _completions_file(path: Path, rows: int = 64) -> Path:
    """Training rows of the main task with the task's answer as each row's ``completion`` (a perfect
    teacher's sample) beside the ``answer`` the held-out rule reads."""
    task = load_config(GRPO, ["data.eval_size=2"]).data.build_task(0)
    lines = [
        json.dumps({"prompt": ex.prompt, "completion": ex.answer, "answer": ex.answer})
        for ex in task.sample("train", rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mixed_rows_take_their_completion_and_train_on_the_teachers_distributions(teacher, tmp_path):
    """GKD's mix (``distill_student_fraction``): half of each step's prompts take their row's completion,
    the student samples the others; the rows say which is which, a given row's old log-probs are the
    student's own (the ratio is 1 on every token of a one-update step), and the divergence falls."""
    run = tmp_path / "run"
    data = _completions_file(tmp_path / "train.jsonl")
    overrides = [*DISTILL, "algorithm.distill_loss=full_vocab", "algorithm.distill_divergence=forward"]
    overrides += ["algorithm.distill_student_fraction=0.5", "algorithm.n_samples=2", "data.batch_size=8"]
    overrides += [f"data.train_file={data}", "data.task=null", "logging.rollouts_every=1", "trainer.total_steps=8"]
    overrides += ["models.actor.lr=2e-2", "models.teacher.init=path", f"models.teacher.path={teacher}"]
    with Trainer(GRPO, overrides=[*overrides, f"logging.dir={run}"], progress_bars=False) as trainer:
        # The planner prices the sampling for the student's 4 prompts x 2 samples, the teacher's call for every row.
        mfcs = {name: trainer.graph.nodes[name]["mfc"] for name in trainer.graph.nodes}
        assert mfcs["actor_gen"].n_seqs == 8 and mfcs["teacher_inf"].n_seqs is None
        trainer.fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor_train/distill_vocab_kl" in r]
    assert len(steps) == 8 and all(r["actor_train/given_response_fraction"] == 0.5 for r in steps)
    # Old log-probs of given rows left at 0 would put the ratio at exp(log pi) and approx_kl far above 0.
    assert all(abs(r["actor_train/approx_kl"]) < 1e-5 for r in steps), [r["actor_train/approx_kl"] for r in steps]
    kl = [r["actor_train/distill_vocab_kl"] for r in steps]
    assert sum(kl[-2:]) / 2 < 0.5 * sum(kl[:2]) / 2, kl
    answers = {json.loads(line)["prompt"]: json.loads(line)["completion"] for line in data.read_text().splitlines()}
    for step in range(1, 9):
        rows = [json.loads(line) for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        given = [r for r in rows if r["given"]]
        assert len(given) == 8 and len(rows) == 16  # 4 of 8 prompts, 2 sample slots each
        assert all(r["response"] == answers[r["prompt"]] for r in given)
        assert {r["group"] for r in given}.isdisjoint({r["group"] for r in rows if not r["given"]})


def test_mixed_rows_need_a_completion_on_every_training_row_before_any_worker_starts(tmp_path):
    data = _completions_file(tmp_path / "train.jsonl", rows=4)
    lines = data.read_text().splitlines()
    lines[2] = json.dumps({k: v for k, v in json.loads(lines[2]).items() if k != "completion"})
    data.write_text("\n".join(lines) + "\n")
    overrides = [*DISTILL, "algorithm.distill_loss=full_vocab", "algorithm.distill_student_fraction=0.5"]
    overrides += ["models.teacher.init=tiny", f"logging.dir={tmp_path / 'run'}", "data.task=null"]
    with pytest.raises(DatasetFormatError, match=r"train\.jsonl:3: .*'completion'.*got no such column"):
        Trainer(GRPO, overrides=[*overrides, f"data.train_file={data}"], progress_bars=False)
    # The synthetic task has no completions.
    with pytest.raises(ConfigError, match="synthetic task 'arithmetic' has none") as err:
        Trainer(GRPO, overrides=[*overrides[:-1]], progress_bars=False)
    assert err.value.key == "algorithm.distill_student_fraction"


def test_mixed_rows_with_an_objective_that_reads_sampled_tokens_are_refused():
    teacher = ["models.teacher.init=tiny", "algorithm.distill_student_fraction=0.5"]
    for extra in (
        ["algorithm.name=distill"],  # the sampled-token advantage
        ["algorithm.distill_coef=0.5", "algorithm.distill_loss=full_vocab"],  # GRPO's reward advantage
        ["algorithm.name=distill", "algorithm.distill_loss=full_vocab", "rollout.partial_tokens=2"],
    ):
        with pytest.raises(ConfigError) as err:
            load_config(GRPO, [*TINY_ACTOR, *teacher, *extra])
        assert err.value.key == "algorithm.distill_student_fraction", (extra, str(err.value))


def test_mixed_rows_under_the_old_logp_recompute_compare_only_the_sampled_rows(tmp_path):
    """With the recompute the trainer's log-probs are every row's ``old_logp``; a given row has no
    rollout log-probs, so the engine/trainer mismatch is over the student's samples (0 would be
    compared with the trainer's log-probs of the given tokens otherwise) and the ratio stays 1."""
    run = tmp_path / "run"
    data = _completions_file(tmp_path / "train.jsonl")
    overrides = [*DISTILL, "algorithm.distill_loss=full_vocab", "algorithm.distill_divergence=forward"]
    overrides += ["algorithm.distill_student_fraction=0.5", "algorithm.recompute_old_logp=true"]
    overrides += [f"data.train_file={data}", "data.task=null", "trainer.total_steps=3", "models.teacher.init=tiny"]
    overrides += ["data.batch_size=8", *(f"models.teacher.{o}" for o in TEACHER_SHAPE)]
    with Trainer(GRPO, overrides=[*overrides, f"logging.dir={run}"], progress_bars=False) as trainer:
        assert list(trainer.graph.nodes) == ["actor_gen", "actor_inf", "teacher_inf", "actor_train"]
        trainer.fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    mismatch = [r["actor_inf/logp_mismatch_max"] for r in records if "actor_inf/logp_mismatch_max" in r]
    assert len(mismatch) == 3 and max(mismatch) < 1e-3, mismatch
    steps = [r for r in records if "actor_train/approx_kl" in r]
    assert len(steps) == 3 and all(abs(r["actor_train/approx_kl"]) < 1e-5 for r in steps)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_mixed_rows_on_two_data_parallel_ranks(ray_session, tmp_path):
    """Each dp rank draws its own given prompts; the train call's forward for the given rows' old
    log-probs runs on both FSDP ranks (a collective), and half of every step's rows are given."""
    run = tmp_path / "run"
    data = _completions_file(tmp_path / "train.jsonl")
    m = "placement.manual"
    dp2 = ["placement.mode=manual", "placement.devices_per_node=2", "placement.worker_host=ray"]
    for call in ("actor_gen", "teacher_inf", "actor_train"):
        dp2 += [f"{m}.{call}.mesh.num_devices=2", f"{m}.{call}.strategy.dp=2"]
    overrides = [*DISTILL, *dp2, "algorithm.distill_loss=full_vocab", "algorithm.distill_divergence=forward"]
    overrides += ["algorithm.distill_student_fraction=0.5", f"data.train_file={data}", "data.task=null"]
    overrides += ["data.batch_size=8", "trainer.total_steps=3", "models.teacher.init=tiny", "logging.rollouts_every=1"]
    with Trainer(GRPO, overrides=[*overrides, f"logging.dir={run}"], progress_bars=False) as trainer:
        trainer.fit()
        assert trainer.placement.plan.call("actor_train").strategy.dp == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor_train/given_response_fraction" in r]
    assert len(steps) == 3 and all(r["actor_train/given_response_fraction"] == 0.5 for r in steps)
    assert all(abs(r["actor_train/approx_kl"]) < 1e-5 for r in steps)
    for step in range(1, 4):
        rows = [json.loads(line) for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and sum(r["given"] for r in rows) == 8
