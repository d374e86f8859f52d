"""TRL's ``GRPOTrainer`` replaying rlflow's rollouts step by step; runs inside TRL's own venv.

    <trl venv>/bin/python benchmarks/trl_update.py SPEC.json REPLAY.pt OUT.pt

The TRL side of ``benchmarks/bench_update_parity.py``. ``REPLAY.pt`` holds, per step, the prompts
rlflow drew (text and ground truth, one per group, in order) and the completion ids it sampled
(one list per row, a group's rows consecutive, the EOS kept where one was sampled). The real
``GRPOTrainer``, with the bench's ``GRPOConfig`` (:func:`benchmarks.trl_grpo.grpo_config_kwargs`)
and the prompts in that order (``shuffle_dataset=False``), runs as many steps; only its sampling
is replaced, by the recorded completions. ``OUT.pt`` gets, per step, what TRL made of them: the
prompt ids it tokenized, its completion ids and mask, rewards and advantages (in generation
order, before TRL shuffles the rows for the update), the loss, the gradient norm it logged
(before clipping), the gradients the optimizer saw (after clipping) and the weights before and
after the step.

Like ``trl_grpo.py``, this file imports nothing of rlflow; TRL is imported inside :func:`main`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.trl_grpo import grpo_config_kwargs, reward_numeric_match  # noqa: E402

# what every step of OUT.pt holds once the step has run
STEP_KEYS = (
    "prompt_ids",
    "completion_ids",
    "completion_mask",
    "rewards",
    "advantages",
    "loss",
    "grad_norm",
    "grads",
    "before",
    "after",
)


def replay_dataset_rows(replay: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The prompt rows of every step, in order, as TRL's dataset holds them (ground truth as JSON text).

    >>> replay_dataset_rows([{"prompts": ["1+2="], "ground_truths": [{"answer": "3"}]}])
    [{'prompt': '1+2=', 'ground_truth': '{"answer": "3"}'}]
    """
    return [
        {"prompt": prompt, "ground_truth": json.dumps(truth)}
        for step in replay
        for prompt, truth in zip(step["prompts"], step["ground_truths"])
    ]


def _clone(named) -> dict[str, Any]:
    return {name: tensor.detach().clone() for name, tensor in named}


def main(spec_path: str, replay_path: str, out_path: str) -> int:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    replay = torch.load(replay_path, weights_only=True)["steps"]
    steps: list[dict[str, Any]] = [{} for _ in replay]

    # HF Trainer's global_step is the number of optimizer steps taken: it counts up after the
    # step's update, so during step k (0-based) every hook below but the log sees k.
    class ReplayTrainer(GRPOTrainer):
        """``GRPOTrainer`` whose sampling returns rlflow's completions and which records each step."""

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            k = self.state.global_step
            completions = replay[k]["completion_ids"]
            if len(prompt_ids) != len(completions):
                raise ValueError(
                    f"step {k + 1}: TRL asks for {len(prompt_ids)} completions, rlflow has {len(completions)}"
                )
            steps[k]["prompt_ids"] = [[int(t) for t in p] for p in prompt_ids]
            return [list(c) for c in completions], None

        def _calculate_rewards(self, *args, **kwargs):
            rewards = super()._calculate_rewards(*args, **kwargs)  # (N, reward functions)
            steps[self.state.global_step]["rewards"] = rewards[:, 0].detach().clone()
            return rewards

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            keys = ("completion_ids", "completion_mask", "advantages")
            steps[self.state.global_step].update({key: out[key].detach().clone() for key in keys})
            return out

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            steps[self.state.global_step]["loss"] = float(loss.detach())
            return loss

    class Recorder(TrainerCallback):
        """Weights before and after each step, the clipped gradients and the logged gradient norm."""

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            steps[state.global_step]["before"] = _clone(model.state_dict().items())

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):  # after clipping
            named = ((n, p.grad) for n, p in model.named_parameters() if p.grad is not None)
            steps[state.global_step]["grads"] = _clone(named)

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            steps[state.global_step]["after"] = _clone(model.state_dict().items())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                steps[state.global_step - 1]["grad_norm"] = float(logs["grad_norm"])

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    config = GRPOConfig(
        **{**grpo_config_kwargs({**spec, "steps": len(replay)}, spec["output_dir"]), "shuffle_dataset": False}
    )
    trainer = ReplayTrainer(
        model=model,
        reward_funcs=reward_numeric_match,
        args=config,
        train_dataset=Dataset.from_list(replay_dataset_rows(replay)),
        processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
        callbacks=[Recorder()],
    )
    trainer.train()
    for k, step in enumerate(steps):
        missing = [key for key in STEP_KEYS if key not in step]
        if missing:
            raise RuntimeError(f"step {k + 1} of {len(steps)}: nothing recorded for {missing}")
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": str(torch.__version__)}
    torch.save({"versions": versions, "steps": steps}, out_path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json REPLAY.pt OUT.pt")
    sys.exit(main(*sys.argv[1:]))
