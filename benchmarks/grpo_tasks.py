"""The GRPO tasks of ``benchmarks/bench_trl.py`` and the pure parts around them.

A task is one dict (:data:`TASKS`), written as JSON for both sides; :func:`rlflow_config`
maps it to rlflow's config, ``benchmarks/trl_grpo.py: grpo_config_kwargs`` to TRL's
``GRPOConfig``. Both sides write the same event lines (``train_begin``, ``step`` with wall
times and the mean reward, ``done``), which :func:`summarize` turns into the figures and
:func:`smooth` into the reward curve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["TASKS", "percentile", "rlflow_config", "smooth", "summarize"]

# Shared by every task: the arithmetic task of recipes/grpo_arithmetic.yaml, its reward, sampling
# at temperature 1, AdamW at a constant lr with the gradient norm clipped to 1, no KL.
_COMMON = {
    "num_digits": 2,
    "ops": ["+"],
    "reverse_answer": True,
    "max_prompt_len": 8,  # <bos> + "99+99=" is 7 tokens
    "temperature": 1.0,
    "grad_clip": 1.0,
    "seed": 0,
}

TASKS: dict[str, dict[str, Any]] = {
    # Issue 12's task: a tiny Llama, 2 prompts x 8 completions of up to 32 tokens per step.
    "tiny": {
        **_COMMON,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 256,
        "tie_word_embeddings": True,
        "num_prompts": 2,
        "n_samples": 8,
        "max_new_tokens": 32,
        "lr": 1e-3,
        "clip_low": 0.2,
        "clip_high": 0.2,
        "steps": 150,
    },
    # The GRPO part of recipes/grpo_arithmetic.yaml (the main job) without its SFT warm-up.
    "main": {
        **_COMMON,
        "hidden_size": 128,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 512,
        "tie_word_embeddings": True,
        "num_prompts": 32,
        "n_samples": 8,
        "max_new_tokens": 5,
        "lr": 1e-4,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "steps": 30,
    },
    # Where compute matters: a 21M-parameter Llama (8 layers of width 512), 2 prompts x 8
    # completions of exactly 128 tokens (the EOS is kept out of the choice until then, on both
    # sides), so that each step's matmuls, not its overheads, set the time.
    "compute": {
        **_COMMON,
        "hidden_size": 512,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 8,
        "intermediate_size": 1024,
        "tie_word_embeddings": True,
        "num_prompts": 2,
        "n_samples": 8,
        "max_new_tokens": 128,
        "min_new_tokens": 128,
        "lr": 1e-4,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "steps": 12,
    },
}


def rlflow_config(spec: dict[str, Any], run_dir: str, policy_lag: int | None = None) -> dict[str, Any]:
    """rlflow's config (a nested dict for ``Trainer``) of a task spec.

    The model and tokenizer come from ``spec["model_dir"]`` (the directory TRL loads too).
    Placement is left at its defaults but for the two CPU worker processes of the 2-core
    machine; ``policy_lag`` is set only when given, so a config without the field still loads, and
    ``dtype`` (``models.actor.dtype``, else ``auto``) likewise.
    No evaluation, warm-up, checkpoint or TensorBoard: only the training loop runs.

    >>> cfg = rlflow_config({**TASKS["tiny"], "model_dir": "/m", "steps": 5}, "/run")
    >>> cfg["data"]["batch_size"], cfg["algorithm"]["n_samples"], cfg["rollout"]["max_new_tokens"]
    (2, 8, 32)
    """
    algorithm = {
        "name": "grpo",
        "n_samples": spec["n_samples"],
        "clip_ratio_low": spec["clip_low"],
        "clip_ratio_high": spec["clip_high"],
        "kl_coef": 0.0,
        "loss_agg_mode": "token-mean",
        "norm_adv_by_std": True,
        "reward_fn": "numeric_match",
        "ppo_epochs": 1,
        "n_minibatches": 1,
    }
    if policy_lag is not None:
        algorithm["policy_lag"] = policy_lag
    return {
        "experiment_name": f"bench_trl_{spec.get('name', 'task')}",
        "seed": spec["seed"],
        "algorithm": algorithm,
        "models": {
            "actor": {
                "init": "path",
                "path": spec["model_dir"],
                "lr": spec["lr"],
                "grad_clip": spec["grad_clip"],
                "weight_decay": 0.0,
                "lr_schedule": "constant",
                **({"dtype": spec["dtype"]} if "dtype" in spec else {}),
            }
        },
        "data": {
            "task": "arithmetic",
            "num_digits": spec["num_digits"],
            "ops": list(spec["ops"]),
            "reverse_answer": spec["reverse_answer"],
            "tokenizer": spec["model_dir"],
            "batch_size": spec["num_prompts"],
            "max_prompt_len": spec["max_prompt_len"],
            "max_response_len": spec["max_new_tokens"],
            "eval_size": 0,
        },
        "rollout": {
            "engine": "hf",
            "temperature": spec["temperature"],
            "max_new_tokens": spec["max_new_tokens"],
            "min_new_tokens": spec.get("min_new_tokens", 0),
        },
        "warmup": {"steps": 0},
        "placement": {"devices_per_node": 2},
        "trainer": {"total_steps": spec["steps"], "eval_every": 0, "eval_before_train": False, "log_every": 1},
        "logging": {"dir": run_dir, "console": False, "jsonl": True, "tensorboard": False},
        "checkpoint": {"every_n_steps": 0, "save_final": False},
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between order statistics (numpy's default).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 90)
    (2.5, 3.7)
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be in [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(events: Sequence[dict[str, Any]], spawned_at: float) -> dict[str, Any]:
    """The figures of one run from its event lines.

    Args:
        events: the run's ``train_begin`` / ``step`` / ``done`` events, in order written.
            A ``step`` holds ``step``, ``t_end`` (wall seconds), ``reward`` (mean reward of
            its completions) and ``completions``.
        spawned_at: wall time the benchmark started the run's process.

    Returns:
        ``steps``; ``completions_per_s``: completions of steps 2..N over the wall seconds from
        the end of step 1 to the end of step N (the first step, which pays for warm caches
        and lazy set-up, excluded); ``step_s_median`` / ``step_s_p90`` of the seconds between
        consecutive step ends; ``startup_first_step_done_s`` (process start to the end of
        step 1) and, when the run reports it, ``startup_first_step_start_s``; ``rewards``
        (one per step) and ``samples`` (completions seen up to and including each step).

    Raises:
        ValueError: fewer than 2 steps, or steps out of order.

    >>> ev = [{"event": "train_begin", "t": 12.0}] + [
    ...     {"event": "step", "step": i, "t_end": 13.0 + 0.5 * i, "reward": 0.1 * i, "completions": 16}
    ...     for i in (1, 2, 3)]
    >>> s = summarize(ev, spawned_at=10.0)
    >>> s["completions_per_s"], s["step_s_median"], s["startup_first_step_done_s"], s["samples"]
    (32.0, 0.5, 3.5, [16, 32, 48])
    """
    steps = [e for e in events if e["event"] == "step"]
    if len(steps) < 2:
        raise ValueError(f"{len(steps)} step events; the figures need at least 2")
    numbers = [e["step"] for e in steps]
    if numbers != sorted(numbers) or len(set(numbers)) != len(numbers):
        raise ValueError(f"step events out of order: {numbers[:10]}...")
    ends = [e["t_end"] for e in steps]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    loop_s = ends[-1] - ends[0]
    samples, total = [], 0
    for e in steps:
        total += e["completions"]
        samples.append(total)
    figures = {
        "steps": len(steps),
        "completions_per_s": round((total - steps[0]["completions"]) / loop_s, 2) if loop_s > 0 else None,
        "step_s_median": round(percentile(gaps, 50), 4),
        "step_s_p90": round(percentile(gaps, 90), 4),
        "loop_s": round(loop_s, 2),
        "startup_first_step_done_s": round(ends[0] - spawned_at, 2),
    }
    begins = [e["t"] for e in events if e["event"] == "train_begin"]
    if begins:
        figures["startup_first_step_start_s"] = round(begins[0] - spawned_at, 2)
    figures["rewards"] = [round(e["reward"], 4) for e in steps]
    figures["samples"] = samples
    return figures


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average: point ``i`` is the mean of ``values[max(0, i-window+1) : i+1]``.

    >>> smooth([0.0, 1.0, 2.0, 3.0], 2)
    [0.0, 0.5, 1.5, 2.5]
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    out, running = [], 0.0
    for i, value in enumerate(values):
        running += value
        if i >= window:
            running -= values[i - window]
        out.append(running / min(i + 1, window))
    return out
