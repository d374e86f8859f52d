"""rlflow's GRPO update against TRL's ``GRPOTrainer``'s, step by step, on the same batches.

Where ``benchmarks/bench_trl.py`` compares whole runs (speed, reward per sample), this checks
the update rule itself. From one warm start of the main task (:func:`benchmarks.bench_trl.prepare`),
in float32 on one torch thread:

* **rlflow**: ``Trainer(rlflow_config(spec)).fit()`` for K steps with ``models.actor.dtype:
  float32``, once with shared prompts (``models.actor.shared_prefix: true``) and once on padded
  rows (``false``); the worker runs in this process (``placement.worker_host: driver``), where
  a wrapper around the actor's RL train step records each step's batch (prompt and response
  ids, masks, rewards), advantages, the gradients the optimizer sees (after clipping), the
  loss and gradient norm it reports, and the weights before and after;
* **TRL**: ``benchmarks/trl_update.py`` in TRL's venv (:func:`benchmarks.bench_trl.trl_python`)
  runs the real ``GRPOTrainer`` with the bench's ``GRPOConfig`` for K steps over the same
  prompts in the same order, its sampling replaced by rlflow's completions, and records the same.

Per step the record gives whether both trainers saw the same prompt ids, loss tokens and
rewards, the largest advantage difference, both losses and gradient norms, the relative
difference and cosine of the clipped gradients, and the largest difference of the two updates
of a weight against the largest update (the step size). Each side starts step k from its own
weights after step k-1, so differences may grow over the steps.

    python -m benchmarks.run update_parity

Environment: ``RLFLOW_BENCH_TRL_UPDATE_STEPS`` (3: K), ``RLFLOW_BENCH_TRL_UPDATE_WARM_START_STEPS``
(1200: supervised steps before GRPO, so that the samples of a prompt score differently; after 300
the main task's samples are nearly all wrong and most groups give no gradient),
``RLFLOW_BENCH_TRL_UPDATE_OUT`` (unset: the model, the recorded tensors and the logs go to a
temporary directory removed at the end; set: they are kept there, per variant ``rlflow.pt``,
``replay.pt``, ``trl.pt`` and TRL's log), ``RLFLOW_BENCH_TRL_VENV``
(TRL's venv, as for ``bench_trl``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.bench_trl import ROOT, _commit, _env_int, prepare, run_script, trl_python
from benchmarks.grpo_tasks import rlflow_config
from rlflow.algos.advantages import grpo_advantages
from rlflow.trainer import Trainer
from rlflow.workers.interfaces.actor import ActorInterface

TASK = "main"
# the epsilon of each side's group std: rlflow's GRPO estimator's default, TRL's GRPOTrainer's constant
RLFLOW_ADVANTAGE_EPS = inspect.signature(grpo_advantages).parameters["eps"].default
TRL_ADVANTAGE_EPS = 1e-4  # trl/trainer/grpo_trainer.py: advantages / (std_rewards + 1e-4)
VARIANTS = {"fp32_shared_prefix": True, "fp32_padded_rows": False}  # name → models.actor.shared_prefix
Tensors = Mapping[str, torch.Tensor]

# ----------------------------------------------------------------------------- the comparison (pure)


def _check_keys(a: Tensors, b: Tensors, what: str) -> list[str]:
    if set(a) != set(b):
        raise ValueError(f"{what}: only rlflow has {sorted(set(a) - set(b))}, only TRL has {sorted(set(b) - set(a))}")
    return sorted(a)


def global_norm(tensors: Tensors) -> float:
    """The L2 norm of all tensors together (as gradient clipping computes it).

    >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
    5.0
    """
    return sum(float(t.double().pow(2).sum()) for t in tensors.values()) ** 0.5


def relative_difference(a: Tensors, b: Tensors) -> float:
    """``||a - b|| / ||b||`` over all tensors together; ``a`` and ``b`` name the same tensors.
    NaN when ``b`` is zero (a batch whose groups all scored alike has no gradient).

    >>> relative_difference({"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.0, 0.0])})
    1.0
    """
    keys = _check_keys(a, b, "relative_difference")
    norm = global_norm(b)
    return global_norm({k: a[k].double() - b[k].double() for k in keys}) / norm if norm > 0 else math.nan


def cosine(a: Tensors, b: Tensors) -> float:
    """The cosine of the angle between ``a`` and ``b``, each flattened into one vector; NaN when one is zero.

    >>> cosine({"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([1.0, 1.0])})  # doctest: +ELLIPSIS
    0.7071...
    """
    keys = _check_keys(a, b, "cosine")
    dot, norms = sum(float((a[k].double() * b[k].double()).sum()) for k in keys), global_norm(a) * global_norm(b)
    return dot / norms if norms > 0 else math.nan


def max_abs_difference(a: Tensors, b: Tensors, keys: list[str]) -> float:
    """``max |a[k] - b[k]|`` over the tensors ``keys``.

    >>> max_abs_difference({"w": torch.tensor([1.0, 5.0])}, {"w": torch.tensor([1.5, 5.0])}, ["w"])
    0.5
    """
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def update_difference(
    rl_before: Tensors, rl_after: Tensors, trl_before: Tensors, trl_after: Tensors, trl_grads: Tensors
) -> dict[str, float]:
    """How far the two updates of the tensors of ``trl_grads`` differ.

    Returns:
        ``max_abs_diff``: ``max |Δw_rlflow - Δw_TRL|`` over the weights; ``max_abs``: ``max |Δw_TRL|``
        (the step size to read it against); ``rel_diff``: ``||Δw_rlflow - Δw_TRL|| / ||Δw_TRL||``;
        ``grad_at_max_abs_diff``: TRL's ``|g|`` at the weight of ``max_abs_diff`` (AdamW's first
        steps move a weight by about ``lr · g / (|g| + eps)``: where ``|g|`` is near its ``eps``,
        a tiny difference of the gradients moves the update by a fair part of ``lr``).

    >>> w0, w1 = {"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([1.0, -1.0])}
    >>> figures = update_difference(w0, {"w": torch.tensor([1.0, -0.5])}, w0, w1, {"w": torch.tensor([0.5, 0.25])})
    >>> {name: round(value, 4) for name, value in figures.items()}
    {'max_abs_diff': 0.5, 'max_abs': 1.0, 'rel_diff': 0.3536, 'grad_at_max_abs_diff': 0.25}
    """
    keys = sorted(trl_grads)
    rl = {k: rl_after[k].double() - rl_before[k].double() for k in keys}
    trl = {k: trl_after[k].double() - trl_before[k].double() for k in keys}
    diffs = {k: (rl[k] - trl[k]).abs() for k in keys}
    worst = max(keys, key=lambda k: float(diffs[k].max()))
    at = int(diffs[worst].argmax())
    return {
        "max_abs_diff": float(diffs[worst].max()),
        "max_abs": max(float(t.abs().max()) for t in trl.values()),
        "rel_diff": relative_difference(rl, trl),
        "grad_at_max_abs_diff": float(trl_grads[worst].double().flatten()[at].abs()),
    }


def advantages_at_eps(advantages: torch.Tensor, rewards: torch.Tensor, n_samples: int, eps: float) -> torch.Tensor:
    """``(N,)``: TRL's group advantages ``(r - mean) / (std + TRL_ADVANTAGE_EPS)`` as they are with
    ``eps`` in the denominator instead (``std``: the unbiased std of each group of ``n_samples``
    consecutive rows' rewards).

    >>> rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])  # group std 2 ** -0.5, then 0
    >>> advantages_at_eps(torch.tensor([0.5, -0.5, 0.0, 0.0]), rewards, 2, TRL_ADVANTAGE_EPS).tolist()
    [0.5, -0.5, 0.0, 0.0]
    """
    std = rewards.double().view(-1, n_samples).std(dim=1)
    scale = (std + TRL_ADVANTAGE_EPS) / (std + eps)
    return advantages.double() * scale.repeat_interleave(n_samples)


def masked_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's ids where ``mask`` is set, in order.

    >>> masked_rows(torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    [[5, 6], [7]]
    """
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def row_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(N,)``: the mean over each row's response tokens of rlflow's ``(N, T)`` token advantages
    (GRPO gives every token of a row the same value, TRL one per row).

    >>> row_advantages(torch.tensor([[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]]), torch.tensor([[0, 1, 1], [0, 1, 0]]))
    tensor([ 2., -1.])
    """
    mask = response_mask.to(advantages.dtype)
    return (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)


def _sig(value: float, digits: int = 6) -> float:
    return float(f"{value:.{digits}g}")


def compare_step(rl: dict[str, Any], trl: dict[str, Any], n_samples: int) -> dict[str, Any]:
    """One step's figures from both sides' records.

    Args:
        rl: rlflow's step: ``batch`` (``input_ids``, ``attention_mask``, ``response_mask`` ``(N, T)``,
            ``rewards`` ``(N,)``), ``advantages`` ``(N, T)``, ``grads`` (after clipping), ``before`` and
            ``after`` (weights), ``metrics`` (``pg_loss``, ``grad_norm`` before clipping).
        trl: TRL's step as ``benchmarks/trl_update.py`` writes it (rows in rlflow's order).
        n_samples: rows per group (consecutive).

    Returns:
        Whether the prompt ids, the loss tokens (response ids under the loss mask, EOS included)
        and the rewards are identical row by row; the largest advantage difference, as computed
        and with TRL's at rlflow's epsilon (:func:`advantages_at_eps`); both losses, gradient
        norms (before clipping, as each trainer reports it) and clipped gradient norms; the
        clipped gradients' relative difference (``||g_rlflow - g_TRL|| / ||g_TRL||``) and cosine;
        the updates' figures (:func:`update_difference`); the largest weight difference before
        and after the step.
    """
    batch = rl["batch"]
    prompt_mask = batch["attention_mask"].bool() & ~batch["response_mask"].bool()
    keys = _check_keys(rl["grads"], trl["grads"], "gradients")
    update = update_difference(rl["before"], rl["after"], trl["before"], trl["after"], trl["grads"])
    advantages = row_advantages(rl["advantages"], batch["response_mask"]).double()
    trl_at_rlflow_eps = advantages_at_eps(trl["advantages"], trl["rewards"], n_samples, RLFLOW_ADVANTAGE_EPS)
    return {
        "rows": len(batch["input_ids"]),
        "reward_mean": round(float(batch["rewards"].float().mean()), 4),
        "prompt_ids_identical": masked_rows(batch["input_ids"], prompt_mask) == trl["prompt_ids"],
        "loss_tokens_identical": masked_rows(batch["input_ids"], batch["response_mask"])
        == masked_rows(trl["completion_ids"], trl["completion_mask"]),
        "rewards_identical": torch.equal(batch["rewards"].float(), trl["rewards"].float()),
        "advantage_max_abs_diff": _sig(float((advantages - trl["advantages"].double()).abs().max()), 3),
        "advantage_max_abs_diff_same_eps": _sig(float((advantages - trl_at_rlflow_eps).abs().max()), 3),
        "loss": {"rlflow": _sig(rl["metrics"]["pg_loss"]), "trl": _sig(trl["loss"])},
        "grad_norm": {"rlflow": _sig(rl["metrics"]["grad_norm"]), "trl": _sig(trl["grad_norm"])},
        "clipped_grad_norm": {"rlflow": _sig(global_norm(rl["grads"])), "trl": _sig(global_norm(trl["grads"]))},
        "grad_rel_diff": _sig(relative_difference(rl["grads"], trl["grads"]), 3),
        "grad_cosine": _sig(cosine(rl["grads"], trl["grads"]), 9),
        "update_max_abs_diff": _sig(update["max_abs_diff"], 3),
        "update_max_abs": _sig(update["max_abs"], 3),
        "update_rel_diff": _sig(update["rel_diff"], 3),
        "grad_at_update_max_abs_diff": _sig(update["grad_at_max_abs_diff"], 3),
        "weights_max_abs_diff_before": _sig(max_abs_difference(rl["before"], trl["before"], keys), 3),
        "weights_max_abs_diff_after": _sig(max_abs_difference(rl["after"], trl["after"], keys), 3),
    }


def replay_of(step: dict[str, Any], n_samples: int) -> dict[str, Any]:
    """What TRL replays of one rlflow step: each group's prompt and ground truth, each row's completion ids.

    Raises:
        ValueError: a group's rows (``n_samples`` consecutive rows) are not all of one prompt.
    """
    columns, uids = step["columns"], step["uids"]
    if len(columns) % n_samples:
        raise ValueError(f"{len(columns)} rows are not groups of n_samples={n_samples}")
    for start in range(0, len(columns), n_samples):
        if len({str(u) for u in uids[start : start + n_samples]}) != 1:
            raise ValueError(
                f"rows {start}..{start + n_samples - 1} are not one prompt's group: uids {uids[start : start + n_samples]}"
            )
    heads = columns[::n_samples]
    return {
        "prompts": [c["prompt"] for c in heads],
        "ground_truths": [c["ground_truth"] for c in heads],
        "completion_ids": masked_rows(step["batch"]["input_ids"], step["batch"]["response_mask"]),
    }


# ----------------------------------------------------------------------------- rlflow's side


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def _weights(engine) -> dict[str, torch.Tensor]:
    return {name: _full(t) for name, t in engine.state_dict_full().items()}


@contextlib.contextmanager
def recording(steps: list[dict[str, Any]]) -> Iterator[None]:
    """While open, every RL train step of an actor worker in this process appends its record to ``steps``."""
    train_rl = ActorInterface._train_rl

    def recorded(actor: ActorInterface, engine, data, ctx) -> dict[str, float]:
        batch_keys = ("input_ids", "attention_mask", "response_mask", "rewards")
        step: dict[str, Any] = {"before": _weights(engine), "batch": {k: data.batch[k].clone() for k in batch_keys}}
        step["columns"] = list(data.non_tensor_batch["columns"])
        step["uids"] = [str(u) for u in data.non_tensor_batch["uid"]]
        grads: list[dict[str, torch.Tensor]] = []
        estimator = actor.advantages

        def advantages(d, c):
            out = estimator(d, c)
            step["advantages"] = out[0].detach().clone()
            return out

        def before_update(optimizer, args, kwargs) -> None:  # after clipping, as the optimizer sees them
            grads.append({n: _full(p.grad) for n, p in engine.stage.named_parameters() if p.grad is not None})

        hook = engine.optimizer.register_step_pre_hook(before_update)
        actor.advantages = advantages
        try:
            step["metrics"] = train_rl(actor, engine, data, ctx)
        finally:
            actor.advantages = estimator
            hook.remove()
        if len(grads) != 1:
            raise RuntimeError(f"the step took {len(grads)} optimizer steps; the comparison needs exactly one")
        step["grads"], step["after"] = grads[0], _weights(engine)
        steps.append(step)
        return step["metrics"]

    with mock.patch.object(ActorInterface, "_train_rl", recorded):
        yield


def rlflow_steps(spec: dict[str, Any], shared_prefix: bool, run_dir: Path) -> list[dict[str, Any]]:
    """``spec["steps"]`` GRPO steps of rlflow's real ``Trainer`` on ``spec`` in float32, each step's record."""
    config = rlflow_config(spec, str(run_dir))
    config["models"]["actor"].update(dtype="float32", shared_prefix=shared_prefix)
    config["placement"]["worker_host"] = "driver"  # in this process, where `recording` sees the engine
    steps: list[dict[str, Any]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as TRL's side
    try:
        with recording(steps), Trainer(config, progress_bars=False) as trainer:
            trainer.launch()
            trainer.fit()
    finally:
        torch.set_num_threads(threads)
    if len(steps) != spec["steps"]:
        raise RuntimeError(f"rlflow recorded {len(steps)} train steps for trainer.total_steps={spec['steps']}")
    return steps


# ----------------------------------------------------------------------------- TRL's side


def trl_steps(spec: dict[str, Any], replay: list[dict[str, Any]], workdir: Path) -> dict[str, Any]:
    """``benchmarks/trl_update.py`` in TRL's venv on ``replay``; its output (``versions``, ``steps``)."""
    spec_path, replay_path, out_path = workdir / "trl_spec.json", workdir / "replay.pt", workdir / "trl.pt"
    spec_path.write_text(json.dumps({**spec, "threads": 1, "output_dir": str(workdir / "trl_out")}, indent=1))
    torch.save({"steps": replay}, replay_path)
    script = ROOT / "benchmarks" / "trl_update.py"
    run_script(trl_python(), script, [spec_path, replay_path, out_path], workdir / "trl_log.txt", 1, "trl")
    return torch.load(out_path, weights_only=True)


# ----------------------------------------------------------------------------- the benchmark


def variant_record(variant: str, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Both trainers' K steps of one rlflow variant, compared step by step."""
    load_before = os.getloadavg()[0]
    rl = rlflow_steps(spec, VARIANTS[variant], workdir / "rlflow_run")
    torch.save(rl, workdir / "rlflow.pt")
    trl = trl_steps(spec, [replay_of(step, spec["n_samples"]) for step in rl], workdir)
    n = spec["n_samples"]
    per_step = [{"step": k + 1, **compare_step(r, t, n)} for k, (r, t) in enumerate(zip(rl, trl["steps"]))]
    return {
        "name": f"trl_update_{variant}",
        "task": TASK,
        "rlflow": {"dtype": "float32", "shared_prefix": VARIANTS[variant], "worker_host": "driver", "threads": 1},
        "trl": {**trl["versions"], "precision": "fp32", "threads": 1, "shuffle_dataset": False},
        "steps": per_step,
        "lr": spec["lr"],
        "warm_start": spec.get("warm_start"),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rlflow_commit": _commit(),
        "units": {
            "grad_rel_diff": "||g_rlflow - g_TRL|| / ||g_TRL|| of the gradients after clipping",
            "update_max_abs_diff": "max over weights of |Δw_rlflow - Δw_TRL| in the step",
            "update_max_abs": "max over weights of |Δw_TRL| in the step (the step size)",
            "update_rel_diff": "||Δw_rlflow - Δw_TRL|| / ||Δw_TRL|| over all weights",
            "grad_at_update_max_abs_diff": "TRL's |g| after clipping at the weight of update_max_abs_diff",
            "advantage_max_abs_diff_same_eps": "TRL's advantages rescaled to rlflow's epsilon of the group std",
            "grad_norm": "before clipping, as each trainer reports it",
        },
    }


def run(steps: int | None = None, warm_start_steps: int | None = None) -> list[dict]:
    """One record per rlflow variant (shared prompts, padded rows); arguments override the environment."""
    steps = steps or _env_int("RLFLOW_BENCH_TRL_UPDATE_STEPS", 3)
    if warm_start_steps is None:
        warm_start_steps = _env_int("RLFLOW_BENCH_TRL_UPDATE_WARM_START_STEPS", 1200, minimum=0)
    kept = os.environ.get("RLFLOW_BENCH_TRL_UPDATE_OUT")
    out = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="rlflow_bench_update_parity_"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        spec = prepare(TASK, steps, out, warm_start_steps)
        records = []
        for variant in VARIANTS:
            workdir = out / variant
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir()
            records.append({**variant_record(variant, spec, workdir), "tensors_dir": str(workdir) if kept else None})
        return records
    finally:
        if not kept:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    for record in run():
        print(json.dumps(record))
