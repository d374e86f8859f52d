"""Reward-model training (Bradley-Terry) on preference pairs of 2-digit addition.

The reward model starts from the policy of ``sft_arithmetic`` (trained first when its export is
missing), is exported to ``<run dir>/reward`` (loadable as ``models.reward: {init: path,
path: ...}``), and is scored on held-out pairs: the fraction of (correct, corrupted) answer
pairs of test-split problems in which the correct answer scores higher.

python recipes/rm_arithmetic.py [recipes/other.yaml] [key=value ...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from sft_arithmetic import train_sft
from stages import ensure_model, run_and_export

from rlflow.data.datasets import PreferenceDataset
from rlflow.data.tokenizer import load_tokenizer
from rlflow.engine.models import build_value_model, compute_values, sequence_scores
from rlflow.trainer import RLFlowConfig, load_config
from rlflow.trainer.data import pairs_to_proto, preference_pairs, task_records
from rlflow.trainer.recipe import recipe_args

RECIPE = Path(__file__).with_suffix(".yaml")


@torch.no_grad()
def pair_accuracy(model_dir: str | Path, cfg: RLFlowConfig, tokenizer_dir: str | Path) -> float:
    """Fraction of held-out preference pairs whose chosen answer the reward model scores higher.

    The pairs are built like the training pairs (``rlflow.trainer.data.preference_pairs``: the
    correct answer and a copy with one digit changed) from ``data.eval_size`` problems of the
    task's test split, which training never sees.
    """
    pairs = preference_pairs(task_records(cfg, "test", cfg.data.eval_size), cfg.seed)
    max_len = cfg.data.max_prompt_len + cfg.data.max_response_len
    dataset = PreferenceDataset(pairs, load_tokenizer(tokenizer_dir), max_len)
    rows = pairs_to_proto(dataset.collate([dataset[i] for i in range(len(dataset))])).batch  # chosen 2i, rejected 2i+1
    model = build_value_model(model_dir)
    scores = sequence_scores(compute_values(model, rows["input_ids"], rows["attention_mask"]), rows["attention_mask"])
    return float((scores[0::2] > scores[1::2]).float().mean())


def train_reward_model(
    argv: Sequence[str] = (), export_to: str | Path | None = None, sft_argv: Sequence[str] = ()
) -> tuple[Path, float]:
    """Trains the SFT policy if missing, then the reward model; exports it and scores it on held-out pairs.

    Args:
        argv: the recipe's command line: an optional YAML, then ``key=value`` overrides.
        export_to: the reward model's HF directory; default ``<run dir>/reward``.
        sft_argv: overrides of ``sft_arithmetic`` when it has to run first.

    Returns:
        ``(export directory, held-out pair accuracy)``.
    """
    source, overrides = recipe_args(RECIPE, argv)
    ensure_model(load_config(source, overrides), "reward", train_sft, sft_argv)
    cfg, result, target = run_and_export(source, overrides, "reward", export_to)
    accuracy = pair_accuracy(target, cfg, cfg.data.tokenizer or Path(result.run_dir) / "tokenizer")
    print(f"{cfg.experiment_name}: held-out pair accuracy {accuracy:.1%} ({cfg.data.eval_size} pairs)")
    return target, accuracy


if __name__ == "__main__":
    train_reward_model(sys.argv[1:])
