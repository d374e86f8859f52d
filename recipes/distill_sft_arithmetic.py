"""The baseline of ``distill_arithmetic``: SFT of the same student on its teacher's samples
(sequence-level knowledge distillation), with the same budget of steps and sequences per step.

The teacher (trained first as ``distill_arithmetic.py`` does when it is missing) samples responses to
the training prompts at the rollout's temperature (``SAMPLES_PER_PROMPT`` each at most); the student
trains on those (prompt, response) pairs with the distillation run's optimizer, steps and sequences per
step, and is scored on the same held-out problems.

python recipes/distill_sft_arithmetic.py [recipes/other.yaml] [key=value ...]   (overrides of distill_arithmetic.yaml)
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
from rlflow.trainer import FitResult, load_config, run_recipe
from rlflow.trainer.data import TASK_TRAIN_SIZE, task_records
from rlflow.trainer.recipe import recipe_args

DISTILL = Path(__file__).with_name("distill_arithmetic.yaml")
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


def main(argv: Sequence[str] | None = None) -> FitResult:
    """Samples the teacher, then trains the student of ``distill_arithmetic.yaml`` by SFT on the samples."""
    source, overrides = recipe_args(DISTILL, sys.argv[1:] if argv is None else argv)
    cfg = load_config(source, overrides)
    ensure_model(cfg, "teacher", lambda args, path: train_sft(args, path))
    rows_per_step = cfg.data.batch_size * cfg.algorithm.n_samples
    prompts = [r["prompt"] for r in task_records(cfg, "train", TASK_TRAIN_SIZE)]
    # The run's budget of sequences, or at most SAMPLES_PER_PROMPT samples of each prompt (the SFT run then
    # passes over them again): sampling costs the teacher's forward passes on the CPU.
    passes = min(SAMPLES_PER_PROMPT, math.ceil(cfg.trainer.total_steps * rows_per_step / len(prompts)))
    torch.manual_seed(cfg.seed)
    prompts = prompts * passes
    responses = teacher_samples(cfg.models["teacher"].path, prompts, cfg.data.max_response_len, cfg.rollout.temperature)
    data_dir = Path(cfg.run_dir).with_name(f"{cfg.experiment_name}_sft_data")
    data_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": p, "completion": r}) + "\n" for p, r in zip(prompts, responses)))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in task_records(cfg, "test", cfg.data.eval_size)))
    sft = [
        "algorithm.name=sft",
        "algorithm.distill_loss=sampled",  # SFT reads no teacher: its distillation settings go
        "algorithm.distill_divergence=reverse",
        "algorithm.distill_jsd_beta=0.5",
        f"experiment_name={cfg.experiment_name}_sft",
        "data.task=null",
        "data.split_seed=null",  # the files hold the split's problems
        f"data.train_file={train}",
        f"data.eval_file={held_out}",
        f"data.batch_size={rows_per_step}",
        f"algorithm.reward_fn={cfg.data.build_task(cfg.seed).reward_name}",
    ]
    return run_recipe(source, [*overrides, *sft])


if __name__ == "__main__":
    main()
