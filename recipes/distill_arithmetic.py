"""Distillation of the SFT policy of ``sft_arithmetic`` into a smaller student on 2-digit addition.

The teacher (``models.teacher``) is the export of ``sft_arithmetic``, which this script trains
first when ``models.teacher.path`` holds no model. At each position of a step's responses the student
is trained toward the teacher's whole next-token distribution (``algorithm.distill_loss: full_vocab``).
The responses are GKD's mix (``algorithm.distill_student_fraction``, 0.5 in the recipe): the student
samples that share of a step's prompts itself (on-policy), and the others take a response the teacher
sampled, which this script draws from the teacher first (:func:`teacher_sample_data`, two per training
prompt). At 1 the run is on-policy only and samples nothing from the teacher.

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


def main(argv: Sequence[str] | None = None, sft_argv: Sequence[str] = ()) -> FitResult:
    """Trains the teacher if ``models.teacher.path`` holds none, samples it when the run mixes its
    samples in, then distils it into the student.

    Args:
        argv: the recipe's command line (default ``sys.argv[1:]``): an optional YAML, then
            ``key=value`` overrides.
        sft_argv: overrides of ``sft_arithmetic`` when the teacher has to be trained first.
    """
    source, overrides = recipe_args(RECIPE, sys.argv[1:] if argv is None else argv)
    cfg = load_config(source, overrides)
    ensure_model(cfg, "teacher", lambda args, path: train_sft(args, path), sft_argv)
    fraction = cfg.algorithm.distill_student_fraction
    if fraction < 1 and cfg.data.train_file is None:
        given_per_step = math.ceil((1 - fraction) * cfg.data.batch_size)
        directory = Path(cfg.run_dir).with_name(f"{Path(cfg.run_dir).name}_teacher_samples")
        overrides = [*overrides, *teacher_sample_data(cfg, directory, given_per_step)]
    return run_recipe(source, overrides)


if __name__ == "__main__":
    main()
