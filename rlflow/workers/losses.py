"""The loss callables the training engine runs on every micro-batch, one per objective.

Each ``*_loss_fn`` returns ``loss_fn(outputs, batch) -> (loss, metrics)`` in the form
:meth:`rlflow.engine.train_engine.TrainEngine.train_step` takes: ``outputs`` holds the
engine's per-token ``log_probs`` / ``entropy`` / ``logits`` (LM) or ``values`` (value head),
aligned with the micro-batch's columns; ``loss`` is the mean over the micro-batch's loss
units (tokens of the ``loss_mask_key`` the caller passes, or rows), which is what the
engine expects to scale to the global mini-batch. Metrics are plain floats.

All math comes from :mod:`rlflow.algos`; this module only picks the tensors.

Pairs (DPO, reward model): rows carry ``pair_index`` (which pair) and ``chosen`` (1 for the
preferred response). The engine may reorder rows into token-balanced micro-batches, so a
pair is found by its index, and a micro-batch holding half a pair is an error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from rlflow.algos import (
    agg_loss,
    behaviour_weights,
    bradley_terry_loss,
    dpo_loss,
    get_policy_loss,
    kl_loss,
    masked_mean,
    mismatch_weights,
    sft_loss,
    value_loss,
    vocab_divergence,
    vocab_log_probs,
)
from rlflow.algos.params import AlgorithmParams, estimator_reads
from rlflow.engine.models import sequence_scores
from rlflow.workers.context import shift_right

__all__ = [
    "dpo_loss_fn",
    "pair_rows",
    "policy_loss_fn",
    "reward_model_loss_fn",
    "sft_loss_fn",
    "value_loss_fn",
]

LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def _supported(fn: Callable, options: dict) -> dict:
    """The subset of ``options`` that ``fn`` takes (registered policy losses take different options)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in options.items() if k in params}


def policy_loss_fn(algo: AlgorithmParams, kl_coef: float) -> LossFn:
    """PPO-family actor loss: policy loss − ``entropy_coef``·entropy (+ ``kl_coef``·KL loss).

    The KL term is added when the KL is not already in the reward (``kl_in_reward=False``)
    and ``kl_coef > 0``; the batch must then hold ``ref_logp``.

    The ratio is taken against ``old_logp``. When the graph recomputes it (the batch then also
    holds the rollout engine's ``rollout_logp``), the behaviour policy is the rollout's: the
    decoupled correction weights by ``min(pi_prox / pi_rollout, is_cap)`` with the recomputed
    log-probs as the proximal ones, and otherwise ``tis_cap`` (when set) weights each token by
    ``min(pi_old / pi_rollout, tis_cap)`` — one truncated importance weight
    (:func:`~rlflow.algos.behaviour_weights`) in both — and the sequence-level weight and masks
    (``seq_tis_cap``, ``seq_mask_*``, ``token_mask_*``: :func:`~rlflow.algos.mismatch_weights`)
    multiply into it.

    Under ``distill_loss: full_vocab`` the exact ``KL(pi_theta || pi_teacher)`` over the vocabulary
    at each response position (:func:`~rlflow.algos.vocab_reverse_kl`; another divergence with
    ``distill_divergence``, :func:`~rlflow.algos.vocab_divergence`) is added with weight
    ``distill_coef``; under the ``reverse_kl`` estimator (algorithm distill) it replaces the policy
    loss, weight 1.

    Batch keys: ``response_mask``, ``old_logp``, ``advantages`` (all ``(b, t)``), ``ref_logp``,
    ``rollout_logp``, ``prox_logp``, ``teacher_vocab_logp`` ``(b, t, V)``.
    """
    policy = get_policy_loss(algo.policy_loss)
    options = _supported(
        policy,
        {
            "clip_ratio_low": algo.clip_ratio_low,
            "clip_ratio_high": algo.clip_ratio_high,
            "clip_ratio_c": algo.dual_clip_c,
            "loss_agg_mode": algo.loss_agg_mode,
        },
    )
    use_kl_loss = not algo.kl_in_reward and kl_coef > 0
    # Full-vocabulary distillation: the teacher's term is a loss of its own. Alone (estimator reverse_kl)
    # it is the whole loss: the advantage is the sampled estimate of the same KL and would count it twice.
    distill_alone = estimator_reads(algo.adv_estimator, "teacher_logp")
    vocab_coef = (1.0 if distill_alone else algo.distill_coef) if algo.distill_loss == "full_vocab" else 0.0
    decoupled = algo.behaviour_correction == "decoupled"
    mismatch = {k: v for k, v in algo.mismatch_options().items() if k != "tis_cap"}

    def loss_fn(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        mask = batch["response_mask"]
        log_prob = outputs["log_probs"]
        old_logp, advantages, correction = batch["old_logp"], batch["advantages"], {}
        recomputed = "rollout_logp" in batch
        if decoupled:
            # Decoupled PPO: clip around the proximal policy (the weights before this step: the
            # recomputed old_logp, the batch's prox_logp, or this forward's own log-probs when the
            # step makes one update), and weight each token by the truncated importance ratio
            # proximal / behaviour (TIS).
            behaviour = batch["rollout_logp"] if recomputed else old_logp
            prox = batch.get("prox_logp", old_logp if recomputed else log_prob.detach())
            weight, correction = behaviour_weights(prox, behaviour, mask, algo.is_cap)
            old_logp, advantages = prox, advantages * weight
        elif recomputed and (algo.tis_cap is not None or mismatch):
            # On-policy TIS: the ratio stays around the recomputed log-probs; each token is weighted
            # by how much likelier the trainer finds it than the rollout engine did, truncated; the
            # sequence-level weight and the masks multiply into the same weight.
            weight = mask.float()
            if algo.tis_cap is not None:
                weight, correction = behaviour_weights(old_logp, batch["rollout_logp"], mask, algo.tis_cap)
            if mismatch:
                more, extra = mismatch_weights(
                    old_logp, batch["rollout_logp"], mask, seq_ratio=algo.seq_is_ratio, **mismatch
                )
                weight, correction = weight * more, {**correction, **extra}
            advantages = advantages * weight
        out = policy(log_prob, old_logp, advantages, mask, **options)
        entropy = agg_loss(outputs["entropy"], mask, algo.loss_agg_mode)
        loss = -algo.entropy_coef * entropy
        replaced = vocab_coef and distill_alone  # the policy term is not optimised: no pg_loss to log
        if not replaced:
            loss = loss + out.loss
        metrics = {
            **({} if replaced else {"pg_loss": float(out.loss.detach())}),
            "clip_fraction": float(out.clip_fraction),
            "dual_clip_fraction": float(out.dual_clip_fraction),
            "approx_kl": float(out.approx_kl),
            "entropy": float(entropy.detach()),
            **{k: float(v) for k, v in out.metrics.items()},
            **correction,
        }
        if vocab_coef:
            student = vocab_log_probs(outputs["logits"])
            divergence = vocab_divergence(
                student, batch["teacher_vocab_logp"], algo.distill_divergence, algo.distill_jsd_beta
            )
            vocab_kl = agg_loss(divergence, mask, algo.loss_agg_mode)
            loss = loss + vocab_coef * vocab_kl
            metrics["distill_vocab_kl"] = float(vocab_kl.detach())
        if use_kl_loss:
            kl = kl_loss(log_prob, batch["ref_logp"], mask, algo.kl_estimator, algo.loss_agg_mode)
            loss = loss + kl_coef * kl
            metrics["kl_loss"] = float(kl.detach())
        return loss, metrics

    return loss_fn


def value_loss_fn(algo: AlgorithmParams) -> LossFn:
    """Critic loss ``vf_coef``·clipped value loss on the returns.

    The critic's value of the prefix before token ``t`` is its output at ``t - 1``
    (:func:`~rlflow.workers.context.shift_right`), the convention of the ``values`` key.

    Batch keys: ``response_mask``, ``values`` (at rollout time), ``returns``.
    """

    def loss_fn(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        mask = batch["response_mask"]
        values = shift_right(outputs["values"])
        loss, clip_fraction = value_loss(
            values, batch["values"], batch["returns"], mask, algo.value_clip, algo.loss_agg_mode
        )
        metrics = {
            "vf_loss": float(loss.detach()),
            "vf_clip_fraction": float(clip_fraction),
            "value_mean": float(masked_mean(values.detach(), mask)),
        }
        return algo.vf_coef * loss, metrics

    return loss_fn


def sft_loss_fn(loss_agg_mode: str) -> LossFn:
    """Next-token cross-entropy over ``loss_mask`` (``loss_mask[:, t]`` marks token ``t`` as a target)."""

    def loss_fn(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        logits = outputs["logits"][:, :-1]
        loss = sft_loss(logits, batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:], loss_agg_mode)
        return loss, {"sft_loss": float(loss.detach())}

    return loss_fn


def pair_rows(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen rows, rejected rows)`` of the pairs of a micro-batch, aligned pair by pair.

    Raises:
        ValueError: a pair is incomplete (the micro-batch split it) or has not one chosen row.
    """
    pair, chosen = batch["pair_index"].long(), batch["chosen"].bool()
    order = torch.argsort(pair * 2 + (~chosen).long())  # each pair: chosen row, then rejected
    pair, chosen = pair[order], chosen[order]
    if (
        pair.numel() % 2
        or not torch.equal(pair[0::2], pair[1::2])
        or not bool(chosen[0::2].all() & ~chosen[1::2].any())
    ):
        raise ValueError(
            f"rows must form complete (chosen, rejected) pairs in every micro-batch; got pair_index "
            f"{batch['pair_index'].tolist()} with chosen {batch['chosen'].tolist()} (use one micro-batch per step)"
        )
    return order[0::2], order[1::2]


def dpo_loss_fn(algo: AlgorithmParams) -> LossFn:
    """DPO / IPO over pairs: sequence log-probs are sums of token log-probs over ``loss_mask``.

    Batch keys: ``loss_mask``, ``ref_logp`` ``(b, t)``; ``pair_index``, ``chosen`` ``(b,)``.
    """

    def loss_fn(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        mask = batch["loss_mask"].to(outputs["log_probs"].dtype)
        policy = (outputs["log_probs"] * mask).sum(-1)  # (b,) log pi(response)
        ref = (batch["ref_logp"].to(mask.dtype) * mask).sum(-1)  # (b,) log pi_ref(response)
        c, r = pair_rows(batch)
        out = dpo_loss(policy[c], policy[r], ref[c], ref[r], beta=algo.dpo_beta, loss_type=algo.dpo_loss)
        loss = out.losses.mean()
        metrics = {
            "dpo_loss": float(loss.detach()),
            "reward_accuracy": float((out.chosen_rewards > out.rejected_rewards).float().mean()),
            "reward_margin": float((out.chosen_rewards - out.rejected_rewards).mean()),
        }
        return loss, metrics

    return loss_fn


def reward_model_loss_fn() -> LossFn:
    """Bradley–Terry loss on the scores (value at each row's last real token) of the pairs.

    Batch keys: ``attention_mask``; ``pair_index``, ``chosen`` ``(b,)``.
    """

    def loss_fn(outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        scores = sequence_scores(outputs["values"], batch["attention_mask"])  # (b,)
        c, r = pair_rows(batch)
        loss = bradley_terry_loss(scores[c], scores[r])
        gap = (scores[c] - scores[r]).detach()
        return loss, {
            "rm_loss": float(loss.detach()),
            "rm_accuracy": float((gap > 0).float().mean()),
            "rm_margin": float(gap.mean()),
        }

    return loss_fn
