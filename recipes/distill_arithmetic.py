"""Distillation of the SFT policy of ``sft_arithmetic`` into a smaller student on 2-digit addition.

Two stages come first when their models are missing: the teacher (``models.teacher``, the export of
``sft_arithmetic``) and the student's start (``models.actor``): SFT of the recipe's student shape on
the task's answers until its held-out score reaches ``STUDENT_TARGET`` (:func:`student_stage`), as
the main job's policy starts from an SFT warm-up. At each position of a step's responses the
student is then trained toward the teacher's whole next-token distribution
(``algorithm.distill_loss: full_vocab``). The responses are GKD's mix
(``algorithm.distill_student_fraction``, 0.5 in the recipe): the student samples that share of a
step's prompts itself (on-policy), and the others take a response the teacher sampled, which this
script draws from the teacher first (:func:`teacher_sample_data`, two per training prompt). At 1
the run is on-policy only and samples nothing from the teacher.

python recipes/distill_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from sft_arithmetic import train_sft
from stages import ensure_model
from transformers import AutoModelForCausalLM

from rlflow.data.tokenizer import load_tokenizer
from rlflow.trainer import FitResult, RLFlowConfig, load_config, run_recipe
from rlflow.trainer.data import TASK_TRAIN_SIZE, task_records
from rlflow.trainer.recipe import recipe_args

RECIPE = Path(__file__).with_suffix(".yaml")
# The student's SFT stage: the held-out score it stops at, its step budget and learning rate.
STUDENT_TARGET = 0.6
STUDENT_MAX_STEPS = 1200
STUDENT_LR = 2e-3
# The fields of models.actor that give the stage its student's shape.
STUDENT_SHAPE = (
    "family",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "tie_word_embeddings",
)
# Teacher samples of each training prompt at most (the runs then pass over them again): sampling
# costs the teacher's forward passes on the CPU.
SAMPLES_PER_PROMPT = 2


@torch.no_grad()
def teacher_samples(teacher: str | Path, prompts: Sequence[str], max_new_tokens: int, temperature: float) -> list[str]:
    """One sampled response (text, special tokens dropped) of the HF model ``teacher`` to each prompt."""
    tok = load_tokenizer(str(teacher), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    out: list[str] = []
    for start in range(0, len(prompts), 1024):
        batch = tok(list(prompts[start : start + 1024]), return_tensors="pt", padding=True)
        ids = model.generate(
            **batch,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        out += tok.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def teacher_sample_data(cfg: RLFlowConfig, directory: Path, rows_per_step: int) -> list[str]:
    """Samples the teacher (seeded by the run's seed) on the task's training prompts and writes them as
    files: ``train.jsonl`` rows ``{prompt, completion, answer}`` (the completion is the teacher's
    sample, the answer the task's, for the held-out rule's checks), ``eval.jsonl`` the held-out
    problems. Returns the data overrides that read them instead of the synthetic task.

    Args:
        cfg: the run's config (the task, the teacher, the rollout's temperature and length limit).
        directory: where the files go (created).
        rows_per_step: the run's teacher-sampled rows a step; with ``trainer.total_steps``, how many
            samples the run can use (at most ``SAMPLES_PER_PROMPT`` of each prompt are drawn).
    """
    records = task_records(cfg, "train", TASK_TRAIN_SIZE)
    passes = min(SAMPLES_PER_PROMPT, math.ceil(cfg.trainer.total_steps * rows_per_step / len(records)))
    records = records * passes
    torch.manual_seed(cfg.seed)
    prompts = [r["prompt"] for r in records]
    responses = teacher_samples(cfg.models["teacher"].path, prompts, cfg.data.max_response_len, cfg.rollout.temperature)
    directory.mkdir(parents=True, exist_ok=True)
    train, held_out = directory / "train.jsonl", directory / "eval.jsonl"
    rows = ({"prompt": r["prompt"], "completion": c, "answer": r["answer"]} for r, c in zip(records, responses))
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in task_records(cfg, "test", cfg.data.eval_size)))
    return [
        "data.task=null",
        "data.split_seed=null",  # the files hold the split's problems
        f"data.train_file={train}",
        f"data.eval_file={held_out}",
        f"algorithm.reward_fn={cfg.data.build_task(cfg.seed).reward_name}",  # scores the held-out answers
    ]


def student_stage(cfg: RLFlowConfig) -> list[str]:
    """The overrides of ``sft_arithmetic`` that train ``cfg``'s student: its shape, SFT on the task's
    answers at ``STUDENT_LR``, evaluated every 25 steps, stopping once the held-out score reaches
    ``STUDENT_TARGET`` (``trainer.target_score``; at most ``STUDENT_MAX_STEPS`` steps)."""
    actor = cfg.models["actor"]
    shape = [f"models.actor.{name}={getattr(actor, name)}" for name in STUDENT_SHAPE]
    stop = [
        f"trainer.total_steps={STUDENT_MAX_STEPS}",
        "trainer.eval_every=25",
        f"trainer.target_score={STUDENT_TARGET}",
    ]
    return [f"experiment_name={Path(actor.path).parent.name}", *shape, f"models.actor.lr={STUDENT_LR}", *stop]


def ensure_models(cfg: RLFlowConfig, sft_argv: Sequence[str] = (), student_argv: Sequence[str] = ()) -> None:
    """Trains the teacher, then the student's start, where their ``init: path`` directories hold no model."""
    ensure_model(cfg, "teacher", train_sft, sft_argv)
    ensure_model(cfg, "actor", train_sft, [*student_stage(cfg), *student_argv])


def main(
    argv: Sequence[str] | None = None, sft_argv: Sequence[str] = (), student_argv: Sequence[str] = ()
) -> FitResult:
    """Trains the teacher and the student's start where missing, samples the teacher when the run
    mixes its samples in, then distils it into the student.

    Args:
        argv: the recipe's command line (default ``sys.argv[1:]``): an optional YAML, then
            ``key=value`` overrides.
        sft_argv: overrides of ``sft_arithmetic`` when the teacher has to be trained first.
        student_argv: overrides of ``sft_arithmetic`` (after :func:`student_stage`'s) when the
            student's start has to be trained first.
    """
    source, overrides = recipe_args(RECIPE, sys.argv[1:] if argv is None else argv)
    cfg = load_config(source, overrides)
    ensure_models(cfg, sft_argv, student_argv)
    fraction = cfg.algorithm.distill_student_fraction
    if fraction < 1 and cfg.data.train_file is None:
        given_per_step = math.ceil((1 - fraction) * cfg.data.batch_size)
        directory = Path(cfg.run_dir).with_name(f"{Path(cfg.run_dir).name}_teacher_samples")
        overrides = [*overrides, *teacher_sample_data(cfg, directory, given_per_step)]
    return run_recipe(source, overrides)


if __name__ == "__main__":
    main()
