"""The hyper-parameters of an algorithm, declared once: :class:`AlgorithmParams`.

The trainer's ``algorithm`` config section (:class:`rlflow.trainer.config.AlgorithmConfig`)
extends this record, so its keys, defaults, help text and allowed values (which render
``docs/configuration.md``) are these fields; the workers receive a plain ``AlgorithmParams``
with the estimator and the KL placement resolved (:meth:`AlgorithmParams.resolved`).

Each field's ``metadata`` holds ``help``, ``choices`` (a sequence, or a callable read at
validation time for registries users extend) and the bounds ``ge``/``gt``/``le``/``lt`` — the
form of the trainer's ``_f`` fields.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any

from rlflow.algos.advantages import get_adv_estimator, list_adv_estimators
from rlflow.algos.distill import DEFAULT_JSD_BETA, DISTILL_DIVERGENCES, DISTILL_LOSSES
from rlflow.algos.kl import KL_ESTIMATORS
from rlflow.algos.losses import LOSS_AGG_MODES, get_policy_loss, list_policy_losses
from rlflow.algos.mismatch import SEQ_RATIO_FORMS
from rlflow.dataflow.algorithms import DEFAULT_REF_EMA_ETA, get_algorithm, list_algorithms
from rlflow.fields import declared_field

__all__ = ["BEHAVIOUR_CORRECTIONS", "DPO_LOSSES", "MISMATCH_OPTIONS", "AlgorithmParams", "estimator_reads"]

DPO_LOSSES = ("sigmoid", "ipo")
# How the policy loss treats rollouts from older weights (``policy_lag``): see AlgorithmParams.behaviour_correction.
BEHAVIOUR_CORRECTIONS = ("auto", "none", "decoupled")
# The corrections of the rollout engine's log-probs against recomputed ones (on-policy, off when null).
MISMATCH_OPTIONS = (
    "tis_cap",
    "seq_tis_cap",
    "seq_mask_low",
    "seq_mask_high",
    "token_mask_low",
    "token_mask_high",
)


def estimator_reads(estimator: str | None, key: str) -> bool:
    """Whether advantage estimator ``estimator`` takes input ``key`` (``"values"``: it needs a
    critic; ``"index"``: it compares the samples of a prompt, which must then share a dp rank).
    ``None`` (an algorithm that samples nothing) reads nothing.

    >>> estimator_reads("gae", "values"), estimator_reads("grpo", "index"), estimator_reads(None, "index")
    (True, True, False)
    """
    return estimator is not None and key in inspect.signature(get_adv_estimator(estimator)).parameters


@dataclass(frozen=True)
class AlgorithmParams:
    """What is optimised: the algorithm, its advantage estimator and loss coefficients."""

    name: str = declared_field("grpo", "training algorithm; decides the dataflow graph", choices=list_algorithms)
    adv_estimator: str | None = declared_field(
        None, "null: the algorithm's (ppo: gae, grpo: grpo...)", choices=list_adv_estimators
    )
    policy_loss: str = declared_field(
        "ppo", "policy-gradient loss (registry in rlflow.algos.losses)", choices=list_policy_losses
    )
    n_samples: int = declared_field(8, "responses sampled per prompt (the GRPO/RLOO group size)", ge=1)
    gamma: float = declared_field(1.0, "discount factor of GAE / discounted returns", ge=0.0, le=1.0)
    lam: float = declared_field(1.0, "GAE lambda", ge=0.0, le=1.0)
    clip_ratio_low: float = declared_field(0.2, "PPO clip: ratio kept above 1 - clip_ratio_low", gt=0.0, lt=1.0)
    clip_ratio_high: float = declared_field(
        0.2, "PPO clip: ratio kept below 1 + clip_ratio_high (DAPO clip-higher)", gt=0.0
    )
    dual_clip_c: float | None = declared_field(None, "dual-clip bound c for negative advantages; null: off", gt=1.0)
    entropy_coef: float = declared_field(0.0, "weight of the entropy bonus in the policy loss", ge=0.0)
    kl_coef: float = declared_field(0.0, "weight of KL(actor || ref); 0 disables the reference model's KL", ge=0.0)
    kl_estimator: str = declared_field("k3", "per-token KL estimator", choices=KL_ESTIMATORS)
    kl_in_reward: bool | None = declared_field(
        None,
        "true: subtract kl_coef*KL from the token rewards; false: add a KL loss; null: the algorithm's "
        "(reinforce_pp: true, others: false)",
    )
    kl_target: float | None = declared_field(None, "target KL of the adaptive controller; null: fixed kl_coef", gt=0.0)
    kl_horizon: int = declared_field(10000, "horizon (in samples) of the adaptive KL controller", ge=1)
    distill_coef: float = declared_field(
        0.0,
        "on-policy distillation mixed with a reward: add distill_coef * (log pi_teacher - log pi_old) to each "
        "sampled token's advantage (reverse KL to models.teacher, undiscounted); 0: no teacher. Algorithm "
        "distill uses the teacher's signal alone",
        ge=0.0,
    )
    distill_loss: str = declared_field(
        "sampled",
        "how the teacher's signal enters: sampled (log pi_teacher - log pi_old of each sampled token as its "
        "advantage) or full_vocab (the exact KL over the vocabulary at each sampled position, distill_divergence, "
        "as a loss term, weighted by distill_coef, or 1 under algorithm distill; the teacher's call then ships "
        "(N, T, vocab) log-probs: for small vocabularies)",
        choices=DISTILL_LOSSES,
    )
    distill_divergence: str = declared_field(
        "reverse",
        "the divergence distill_loss full_vocab takes at each sampled position: reverse KL(student || teacher), "
        "forward KL(teacher || student) (the teacher's soft labels on the student's own prefixes, GKD's beta=0) "
        "or jsd, GKD's generalised Jensen-Shannon divergence between them (distill_jsd_beta)",
        choices=DISTILL_DIVERGENCES,
    )
    distill_jsd_beta: float = declared_field(
        DEFAULT_JSD_BETA,
        "distill_divergence jsd: beta KL(teacher || m) + (1 - beta) KL(student || m) with m = beta teacher + "
        "(1 - beta) student (TRL GKDTrainer's beta: toward 0 it behaves as the forward KL, toward 1 as the reverse; "
        "those ends are distill_divergence forward and reverse)",
        gt=0.0,
        lt=1.0,
    )
    distill_student_fraction: float = declared_field(
        1.0,
        "GKD's lambda (TRL GKDConfig's lmbda): the share of each step's prompts whose responses the student "
        "samples; the others take their training row's 'completion' (a teacher's sample: sequence-level KD data) "
        "as the response, and the same distill_loss full_vocab divergence trains on both kinds of row; 1: "
        "on-policy only",
        ge=0.0,
        le=1.0,
    )
    loss_agg_mode: str = declared_field("token-mean", "how per-token losses are reduced", choices=LOSS_AGG_MODES)
    norm_adv_by_std: bool = declared_field(
        True, "GRPO: divide group-centred rewards by the group std (false: Dr. GRPO)"
    )
    overlong_buffer: int | None = declared_field(
        None,
        "DAPO soft overlong penalty: over the last overlong_buffer tokens before rollout.max_new_tokens a "
        "response's reward falls linearly by up to overlong_penalty; null: off",
        ge=1,
    )
    overlong_penalty: float = declared_field(
        1.0, "the soft overlong penalty at rollout.max_new_tokens (with overlong_buffer)", gt=0.0
    )
    mask_truncated: bool = declared_field(
        False,
        "DAPO overlong filtering: leave responses that reached rollout.max_new_tokens without a stop token out "
        "of the policy loss (they still count in the advantages' group statistics)",
    )
    value_clip: float | None = declared_field(0.5, "clip of value predictions around the old values; null: off", gt=0.0)
    vf_coef: float = declared_field(0.5, "weight of the value loss in the critic's loss", gt=0.0)
    n_minibatches: int = declared_field(1, "optimizer steps per epoch over one batch (PPO mini-batches)", ge=1)
    ppo_epochs: int = declared_field(1, "passes over each batch of samples", ge=1)
    dpo_beta: float = declared_field(0.1, "DPO inverse temperature beta", gt=0.0)
    dpo_loss: str = declared_field("sigmoid", "DPO loss variant", choices=DPO_LOSSES)
    ema_eta: float = declared_field(
        DEFAULT_REF_EMA_ETA, "ppo_ema: weight of the actor in the reference's moving average per step", gt=0.0, le=1.0
    )
    policy_lag: int = declared_field(
        0,
        "bounded staleness: rollouts may use weights this many optimizer steps behind the step that trains on "
        "them, so generation of step t+lag overlaps training of step t on a disjoint mesh; 0: on-policy",
        ge=0,
    )
    behaviour_correction: str = declared_field(
        "auto",
        "decoupled: clip the PPO ratio around the weights before this step (recomputed log-probs) and weight each "
        "token by min(pi_prox / pi_rollout, is_cap); none: ratio against the rollout's log-probs; auto: decoupled "
        "when policy_lag > 0 or rollout.partial_tokens > 0",
        choices=BEHAVIOUR_CORRECTIONS,
    )
    is_cap: float = declared_field(
        2.0, "decoupled correction: truncation of the importance weight pi_prox / pi_rollout (TIS)", gt=0.0
    )
    recompute_old_logp: bool | None = declared_field(
        None,
        "recompute the rollout's log-probs with the trainer's model and engine (an inference call after the "
        "rollout; the PPO ratio then uses them); null: when the rollout's numerics differ from the trainer's "
        "(a rollout engine with its own kernels such as vllm, another dtype, top_p < 1 or top_k > 0)",
    )
    tis_cap: float | None = declared_field(
        None,
        "with recomputed log-probs: weight each token by min(pi_old / pi_rollout, tis_cap), the truncated "
        "importance weight against the rollout engine's log-probs (TIS); null: off",
        gt=0.0,
    )
    seq_tis_cap: float | None = declared_field(
        None,
        "with recomputed log-probs: weight each sequence by min(s, seq_tis_cap), s its importance ratio "
        "pi_old / pi_rollout (seq_is_ratio); sequence-level TIS; null: off",
        gt=0.0,
    )
    seq_is_ratio: str = declared_field(
        "geometric_mean",
        "a sequence's importance ratio s for seq_tis_cap and seq_mask_*: geometric_mean (exp of the mean token "
        "log-ratio) or product (the sequence's likelihood ratio)",
        choices=SEQ_RATIO_FORMS,
    )
    seq_mask_low: float | None = declared_field(
        None,
        "with recomputed log-probs: drop (weight 0) each sequence whose ratio s is below this (masked IS); null: off",
        ge=0.0,
        lt=1.0,
    )
    seq_mask_high: float | None = declared_field(
        None, "with recomputed log-probs: drop each sequence whose ratio s is above this (masked IS); null: off", gt=1.0
    )
    token_mask_low: float | None = declared_field(
        None,
        "with recomputed log-probs: drop (weight 0) each token whose ratio pi_old / pi_rollout is below this "
        "(IcePop-style band); null: off",
        ge=0.0,
        lt=1.0,
    )
    token_mask_high: float | None = declared_field(
        None,
        "with recomputed log-probs: drop each token whose ratio pi_old / pi_rollout is above this; null: off",
        gt=1.0,
    )

    def __post_init__(self) -> None:
        for f in fields(AlgorithmParams):
            _check(f"AlgorithmParams.{f.name}", getattr(self, f.name), f.metadata)
        conflict = self.conflict()
        if conflict is not None:
            raise ValueError(f"AlgorithmParams.{conflict[0]}={getattr(self, conflict[0])!r}: {conflict[1]}")

    def conflict(self) -> tuple[str, str] | None:
        """``(field, problem)`` of the first pair of fields that contradict each other, or None."""
        if self.tis_cap is not None and self.resolved_behaviour_correction == "decoupled":
            return (
                "tis_cap",
                "the decoupled correction (policy_lag > 0) already weights each token by min(pi_prox / pi_rollout, "
                "is_cap), against the recomputed log-probs when there are; set is_cap instead",
            )
        loss_options = inspect.signature(get_policy_loss(self.policy_loss)).parameters
        if self.dual_clip_c is not None and "clip_ratio_c" not in loss_options:
            return ("dual_clip_c", f"policy loss {self.policy_loss!r} has no dual clip; set null")
        distill = self._distill_conflict()
        if distill is not None:
            return distill
        mismatch = self.mismatch_options()
        if mismatch and self.resolved_behaviour_correction == "decoupled":
            return (
                next(iter(mismatch)),
                "the mismatch corrections weigh on-policy rollouts against recomputed log-probs; the decoupled "
                "correction (policy_lag > 0) weighs by pi_prox / pi_rollout instead (is_cap)",
            )
        return None

    def _distill_conflict(self) -> tuple[str, str] | None:
        """The on-policy distillation settings that contradict the others (see :meth:`conflict`)."""
        estimator = self.resolved_adv_estimator
        teacher_only = estimator_reads(estimator, "teacher_logp") and not estimator_reads(
            estimator, "token_level_rewards"
        )
        if self.distill_coef > 0 and estimator_reads(estimator, "teacher_logp"):
            return (
                "distill_coef",
                f"the {estimator} estimator's advantage is the teacher's signal itself; distill_coef mixes it into "
                "a reward estimator's advantages: set 0, or name a reward estimator (grpo, rloo...)",
            )
        if self.kl_in_reward and self.kl_coef > 0 and teacher_only:
            return (
                "kl_in_reward",
                f"the {estimator} estimator reads no reward for a KL penalty to enter; set false (a KL loss)",
            )
        if self.distill_divergence != "reverse" and self.distill_loss != "full_vocab":
            return (
                "distill_divergence",
                f"distill_loss {self.distill_loss!r} estimates the reverse KL from the sampled tokens; the "
                f"{self.distill_divergence} divergence needs the teacher's whole distributions "
                "(distill_loss: full_vocab)",
            )
        if self.distill_jsd_beta != DEFAULT_JSD_BETA and self.distill_divergence != "jsd":
            return (
                "distill_jsd_beta",
                f"only distill_divergence jsd reads it (distill_divergence is {self.distill_divergence!r}); "
                f"set distill_divergence jsd, or leave distill_jsd_beta at {DEFAULT_JSD_BETA}",
            )
        if self.distill_loss != "sampled" and not self.uses_teacher:
            return (
                "distill_loss",
                "no teacher is read (algorithm distill, or distill_coef > 0, reads one); set sampled",
            )
        if self.distill_student_fraction < 1 and not (teacher_only and self.distill_loss == "full_vocab"):
            return (
                "distill_student_fraction",
                "given completions train under the divergence over the whole vocabulary alone (the student did not "
                "sample them: a sampled-token advantage or a reward's would be off-policy); set algorithm.name "
                "distill and distill_loss full_vocab, or 1",
            )
        if self.distill_coef > 0 and not get_algorithm(self.name).samples_responses:
            return ("distill_coef", f"algorithm {self.name!r} samples nothing for a teacher to score; set 0")
        return None

    def mismatch_options(self) -> dict[str, float]:
        """The mismatch corrections set (:data:`MISMATCH_OPTIONS` that are not null), by field name."""
        return {k: getattr(self, k) for k in MISMATCH_OPTIONS if getattr(self, k) is not None}

    @property
    def resolved_adv_estimator(self) -> str | None:
        """``adv_estimator``, or the algorithm's default when null; None for algorithms that sample nothing."""
        return self.adv_estimator or get_algorithm(self.name).default_estimator

    @property
    def uses_teacher(self) -> bool:
        """Whether the advantage reads a distillation teacher: ``distill_coef > 0``, or an estimator of
        the teacher's log-probs (``reverse_kl``, algorithm ``distill``)."""
        return self.distill_coef > 0 or estimator_reads(self.resolved_adv_estimator, "teacher_logp")

    @property
    def resolved_kl_in_reward(self) -> bool:
        """``kl_in_reward``, or the algorithm's default when null."""
        return get_algorithm(self.name).kl_in_reward if self.kl_in_reward is None else self.kl_in_reward

    @property
    def resolved_behaviour_correction(self) -> str:
        """``behaviour_correction``, ``auto`` resolved: ``decoupled`` when rollouts may lag, else ``none``."""
        if self.behaviour_correction != "auto":
            return self.behaviour_correction
        return "decoupled" if self.policy_lag > 0 else "none"

    def resolved(self) -> AlgorithmParams:
        """A plain record with the estimator, the KL placement and the behaviour correction resolved:
        what the workers receive."""
        values = {f.name: getattr(self, f.name) for f in fields(AlgorithmParams)}
        values.update(
            adv_estimator=self.resolved_adv_estimator,
            kl_in_reward=self.resolved_kl_in_reward,
            behaviour_correction=self.resolved_behaviour_correction,
        )
        return AlgorithmParams(**values)


def _check(name: str, value: Any, meta: Any) -> None:
    """The field's choices and bounds (``None`` means off and passes)."""
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None:
        allowed = list(choices() if callable(choices) else choices)
        if value not in allowed:
            raise ValueError(f"{name}={value!r}; expected one of {allowed}")
    bounds = {
        "ge": (float.__ge__, ">="),
        "gt": (float.__gt__, ">"),
        "le": (float.__le__, "<="),
        "lt": (float.__lt__, "<"),
    }
    for key, (holds, op) in bounds.items():
        limit = meta.get(key)
        if limit is not None and not isinstance(value, bool) and not holds(float(value), float(limit)):
            raise ValueError(f"{name}={value!r}; expected {op} {limit:g}")
