"""TRL's ``GRPOTrainer`` on one task of ``benchmarks/bench_trl.py``; runs inside TRL's own venv.

    <trl venv>/bin/python benchmarks/trl_grpo.py SPEC.json EVENTS.jsonl

``SPEC.json`` is a task of :mod:`benchmarks.grpo_tasks` as written by the benchmark (model
and tokenizer directory, prompts file, batch, lengths, lr, clip, steps, torch threads, the
wall time the parent started this process). ``EVENTS.jsonl`` gets one JSON object per line:
``versions``, ``train_begin`` (wall time the first step can start), one ``step`` per
optimizer step (wall times of its begin and end, the mean reward of its completions) and
``done``.

This file imports neither rlflow nor anything outside TRL's venv: the reward is
:func:`numeric_match`, rlflow's ``numeric_match`` rule rewritten here (a unit test in the
main venv checks that both score sample strings alike), and TRL is imported inside
:func:`main` so that the tests can import the rest without TRL installed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from fractions import Fraction
from typing import Any

# ----------------------------------------------------------------------------- the reward

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKERS = ("####", "answer:")


def _first_number(text: str) -> str | None:
    match = _NUMBER.search(text)
    return match.group(0).replace(",", "") if match else None


def extract_answer(response: str) -> str | None:
    """The answer number of ``response``: inside the last ``<answer>`` block, the last
    ``\\boxed{}``, after the last ``####``/``answer:`` marker, else its last number.

    >>> extract_answer("so 3 + 4 = 7. Answer:  12 ")
    '12'
    """
    for pattern in (_ANSWER_TAG, _BOXED):
        blocks = pattern.findall(response)
        if blocks:
            return _first_number(blocks[-1])
    lowered = response.lower()
    for marker in _MARKERS:
        position = lowered.rfind(marker)
        if position >= 0:
            return _first_number(response[position + len(marker) :])
    numbers = _NUMBER.findall(response)
    return numbers[-1].replace(",", "") if numbers else None


def numeric_match(response: str, ground_truth: dict[str, Any]) -> float:
    """1.0 when the answer of ``response`` equals ``ground_truth["answer"]`` (digits reversed
    first when ``ground_truth["reverse_digits"]``), else 0.0; rlflow's ``numeric_match``.

    >>> numeric_match(" 64", {"answer": "46", "reverse_digits": True})
    1.0
    """
    found = extract_answer(response)
    if found is None:
        return 0.0
    if ground_truth.get("reverse_digits", False):
        sign = found[0] if found[0] in "+-" else ""
        found = sign + found[len(sign) :][::-1]
    try:
        return 1.0 if Fraction(found) == Fraction(str(ground_truth["answer"])) else 0.0
    except (ValueError, ZeroDivisionError):
        return 0.0


def reward_numeric_match(prompts: list[str], completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
    """TRL's reward-function convention: the dataset's ``ground_truth`` column holds JSON text."""
    return [numeric_match(c, json.loads(g)) for c, g in zip(completions, ground_truth)]


# ----------------------------------------------------------------------------- the settings


def grpo_config_kwargs(spec: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments of a task spec (field names of TRL 1.x).

    One generation per optimizer step, one update per generation, no KL, no reference model,
    a constant learning rate, on the CPU in float32 or, with ``spec["precision"] == "bf16"``,
    HF Trainer's ``bf16=True`` (autocast); ``min_new_tokens`` reaches ``generate``; nothing
    saved or reported.

    >>> kw = grpo_config_kwargs({"num_prompts": 2, "n_samples": 8, "max_new_tokens": 32, "lr": 1e-3,
    ...     "clip_low": 0.2, "clip_high": 0.2, "steps": 10, "seed": 0, "grad_clip": 1.0, "temperature": 1.0}, "/tmp/x")
    >>> kw["per_device_train_batch_size"], kw["num_generations"], kw["beta"]
    (16, 8, 0.0)
    """
    return {
        "output_dir": output_dir,
        # batch: num_prompts x n_samples completions per step, all generated at that step
        "per_device_train_batch_size": spec["num_prompts"] * spec["n_samples"],
        "num_generations": spec["n_samples"],
        "steps_per_generation": 1,
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_steps": spec["steps"],
        # sampling
        "max_completion_length": spec["max_new_tokens"],
        "temperature": spec["temperature"],
        "top_p": 1.0,
        "top_k": 0,
        # loss: rlflow's GRPO with token-mean aggregation and std-normalised group advantages
        "beta": 0.0,
        "epsilon": spec["clip_low"],
        "epsilon_high": spec["clip_high"],
        "loss_type": "dapo",
        "scale_rewards": "group",
        # optimizer: AdamW at a constant lr, rlflow's defaults
        "learning_rate": spec["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": spec["grad_clip"],
        "generation_kwargs": {"min_new_tokens": spec["min_new_tokens"]} if spec.get("min_new_tokens") else None,
        # the CPU, float32 or bf16 autocast, nothing on the side
        "use_cpu": True,
        "bf16": spec.get("precision", "fp32") == "bf16",
        "fp16": False,
        "use_vllm": False,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": spec["seed"],
    }


# ----------------------------------------------------------------------------- the run


class _Events:
    def __init__(self, path: str) -> None:
        self.file = open(path, "w")  # closed by main

    def write(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, **fields}) + "\n")
        self.file.flush()


def _load_prompts(path: str):
    from datasets import Dataset

    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list([{"prompt": r["prompt"], "ground_truth": json.dumps(r["ground_truth"])} for r in rows])


def main(spec_path: str, events_path: str) -> int:
    import os

    import torch

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    events = _Events(events_path)
    events.write(
        "versions",
        trl=trl.__version__,
        transformers=transformers.__version__,
        torch=torch.__version__,
        datasets=datasets.__version__,
        threads=torch.get_num_threads(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
    )

    class Timestamps(TrainerCallback):
        """Wall times of each optimizer step and the mean reward TRL logs for it."""

        def __init__(self, completions: int) -> None:
            self.completions = completions
            self.begin: float | None = None
            self.pending: dict[str, Any] | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            events.write("train_begin", t=time.time())

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            self.pending = {"step": state.global_step, "t_begin": self.begin, "t_end": time.time()}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.pending is not None and logs and "reward" in logs:
                events.write("step", **self.pending, reward=float(logs["reward"]), completions=self.completions)
                self.pending = None

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    stamps = Timestamps(spec["num_prompts"] * spec["n_samples"])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_numeric_match,
        args=GRPOConfig(**grpo_config_kwargs(spec, spec["output_dir"])),
        train_dataset=_load_prompts(spec["prompts_file"]),
        processing_class=tokenizer,
        callbacks=[stamps],
    )
    trainer.train()
    events.write("done", t=time.time())
    events.file.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json EVENTS.jsonl")
    sys.exit(main(sys.argv[1], sys.argv[2]))
