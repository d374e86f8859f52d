"""Advantages and returns of an RL train step, computed from the rows of the whole batch.

The actor and the critic both call :class:`AdvantageEstimator` on the rows of their train
step. Rows are first gathered over the call's dp group, so batch-wide statistics (GAE's and
REINFORCE++'s whitening, group baselines, the KL controller's signal) are those of the whole
global batch — the single-process result, whatever the dp split — and each rank keeps its
own rows of the result. Actor and critic see the same batch and so compute the same returns.

Inputs (dataflow keys, see ``rlflow.dataflow.algorithms``):

==================  =========  ===============================================================
``rewards``         (N,)       outcome score of each response (absent under algorithm distill)
``response_mask``   (N, T)     1 on response tokens
``old_logp``        (N, T)     rollout log-probs (for the KL penalty / signal)
``ref_logp``        (N, T)     reference log-probs (optional)
``teacher_logp``    (N, T)     distillation teacher's log-probs (optional; ``rlflow.algos.distill``)
``values``          (N, T)     critic values (GAE)
``greedy_rewards``  (N,)       ReMax baseline: score of the greedy response to the same prompt
``uid``             (N,)       non-tensor group id (prompt) of each row (GRPO / RLOO)
==================  =========  ===============================================================

The math lives in ``rlflow.algos`` (:func:`~rlflow.algos.compute_advantages`,
:func:`~rlflow.algos.apply_kl_penalty`); this module only assembles its inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rlflow.algos import (
    apply_kl_penalty,
    build_kl_controller,
    compute_advantages,
    distill_metrics,
    distill_signal,
    masked_mean,
)
from rlflow.algos.overlong import overlong_penalty, response_lengths
from rlflow.algos.params import AlgorithmParams, estimator_reads
from rlflow.engine.rollout.given import sampled_rows
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext, gather_dp, last_token_scatter

__all__ = ["AdvantageEstimator", "group_ids"]

_INPUTS = ("rewards", "response_mask", "old_logp", "ref_logp", "teacher_logp", "values", "greedy_rewards")


def group_ids(data: DataProto, n_samples: int, dp_rank: int) -> np.ndarray:
    """``(N,)`` group id of every row: its ``uid`` column, else blocks of ``n_samples`` consecutive rows.

    The fallback ids carry the dp rank, so they stay unique once the dp parts are gathered
    (the driver splits batches at group boundaries).
    """
    if "uid" in data.non_tensor_keys:
        return np.asarray([str(u) for u in data.non_tensor_batch["uid"]], dtype=object)
    rows = np.arange(len(data))
    return np.asarray([f"dp{dp_rank}:{i // n_samples}" for i in rows], dtype=object)


class AdvantageEstimator:
    """Token rewards → advantages and returns for the algorithm's estimator, with the KL controller.

    Args:
        algo: the algorithm settings (estimator, gamma, lam, KL options, overlong penalty).
        max_new_tokens: the rollout's generation limit; needed by the overlong penalty
            (``algo.overlong_buffer``).
    """

    def __init__(self, algo: AlgorithmParams, max_new_tokens: int | None = None) -> None:
        if algo.adv_estimator is None:
            raise ValueError(f"algorithm {algo.name!r} has no advantage estimator (adv_estimator=None)")
        if algo.overlong_buffer is not None and (max_new_tokens is None or algo.overlong_buffer > max_new_tokens):
            raise ValueError(
                f"overlong_buffer={algo.overlong_buffer} needs a generation limit of at least as many tokens "
                f"(max_new_tokens={max_new_tokens})"
            )
        self.algo, self.max_new_tokens = algo, max_new_tokens
        kind = "fixed" if algo.kl_target is None else "adaptive"
        self.kl_controller = build_kl_controller(kind, algo.kl_coef, algo.kl_target, algo.kl_horizon)

    def __call__(self, data: DataProto, ctx: CallContext) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Advantages and returns of this rank's rows.

        Args:
            data: this rank's rows with the keys of the module docstring.
            ctx: the call; its dp group gathers the rows.

        Returns:
            ``(advantages, returns, metrics)``: ``(n, T)`` float32 each (``n`` local rows),
            and metrics of the global batch (``score_mean``, ``kl``, ``kl_coef``, ``advantage_mean``,
            ``return_mean``; ``overlong_penalty_mean`` with the overlong penalty; ``distill_reverse_kl``
            and ``distill_share`` with a teacher), identical on every rank.
        """
        reads_rewards = estimator_reads(self.algo.adv_estimator, "token_level_rewards")
        needed = ("rewards", "response_mask") if reads_rewards else ("response_mask",)
        missing = [k for k in needed if k not in data.batch_keys]
        if missing:
            raise KeyError(f"advantages need {missing}; the train step's rows hold {sorted(data.keys)}")
        local: dict[str, Any] = {k: data.batch[k] for k in _INPUTS if k in data.batch_keys}
        local["uid"] = group_ids(data, self.algo.n_samples, ctx.coords.dp)
        sampled = sampled_rows(data)  # GKD's mixed rollouts: which rows the policy sampled
        if sampled is not None:
            local["sampled_rows"] = sampled
        batch, rows = gather_dp(local, ctx)
        mask = batch["response_mask"].float()
        kl_coef = self.kl_controller.value
        metrics = {"score_mean": float(batch["rewards"].float().mean())} if "rewards" in batch else {}
        metrics["kl_coef"] = kl_coef
        token_rewards = torch.zeros_like(mask)  # algorithm distill scores nothing: its signal is the teacher's
        if "rewards" in batch:
            token_rewards = last_token_scatter(self._shaped_rewards(batch["rewards"], mask, metrics), mask)
        if "ref_logp" in batch and "old_logp" in batch:
            penalised, mean_kl = apply_kl_penalty(
                token_rewards, batch["old_logp"], batch["ref_logp"], mask, kl_coef, self.algo.kl_estimator
            )
            if self.algo.kl_in_reward:
                token_rewards = penalised
            metrics["kl"] = float(mean_kl)
            self.kl_controller.update(float(mean_kl), n_steps=int(mask.shape[0]))
        advantages, returns = self._estimate(batch, token_rewards, mask)
        if estimator_reads(self.algo.adv_estimator, "teacher_logp"):  # the teacher's signal alone
            sampled = batch.get("sampled_rows")
            if sampled is None:
                metrics.update(distill_metrics(advantages, None, 1.0, mask))
            else:  # the reverse-KL estimate is over the student's own samples; the given share beside it
                metrics.update(distill_metrics(advantages, None, 1.0, mask * sampled[:, None].float()))
                metrics["given_response_fraction"] = float(1.0 - sampled.float().mean())
        elif "teacher_logp" in batch and self.algo.distill_coef > 0:
            signal = distill_signal(batch["old_logp"], batch["teacher_logp"], mask)
            if self.algo.distill_loss == "sampled":
                metrics.update(distill_metrics(signal, advantages, self.algo.distill_coef, mask))
                advantages = advantages + self.algo.distill_coef * signal
            else:  # full_vocab: the teacher enters the loss (policy_loss_fn), not the advantage
                metrics["distill_reverse_kl"] = distill_metrics(signal, None, 1.0, mask)["distill_reverse_kl"]
        metrics["advantage_mean"] = float(masked_mean(advantages, mask))
        metrics["return_mean"] = float(masked_mean(returns, mask))
        return advantages[rows].float(), returns[rows].float(), metrics

    def _shaped_rewards(self, rewards: torch.Tensor, mask: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """``(N,)`` the scores with DAPO's soft overlong penalty when it is on (``score_mean`` stays the task's)."""
        if self.algo.overlong_buffer is None:
            return rewards
        penalty = overlong_penalty(
            response_lengths(mask), self.max_new_tokens, self.algo.overlong_buffer, self.algo.overlong_penalty
        )
        metrics["overlong_penalty_mean"] = float(penalty.mean())
        return rewards.float() + penalty

    def _estimate(self, batch: Mapping[str, Any], token_rewards: torch.Tensor, mask: torch.Tensor):
        inputs: dict[str, Any] = {
            "token_level_rewards": token_rewards,
            "response_mask": mask,
            "index": batch["uid"],
            "gamma": self.algo.gamma,
            "lam": self.algo.lam,
            "norm_by_std": self.algo.norm_adv_by_std,
        }
        if "values" in batch:
            inputs["values"] = batch["values"].float() * mask
        if "greedy_rewards" in batch:
            inputs["baseline_rewards"] = batch["greedy_rewards"].float()
        for key in ("old_logp", "teacher_logp"):  # the reverse_kl estimator's (on-policy distillation)
            if key in batch and estimator_reads(self.algo.adv_estimator, key):
                inputs[key] = batch[key].float()
        try:
            return compute_advantages(self.algo.adv_estimator, **inputs)
        except TypeError as err:
            given = sorted(k for k in inputs if k not in ("gamma", "lam", "norm_by_std"))
            raise TypeError(f"advantage estimator {self.algo.adv_estimator!r} cannot run on {given}: {err}") from err

    def state_dict(self) -> dict[str, float]:
        return {"kl_coef": float(self.kl_controller.value)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kl_controller.value = float(state["kl_coef"])
