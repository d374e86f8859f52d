"""The actor: rollouts, log-probs, and the policy's train step (PPO family, SFT or DPO).

Rollout rows follow ``rlflow.dataflow.algorithms``: every tensor is ``(N, P+R)`` aligned —
``input_ids`` and ``attention_mask`` (left-padded prompt then right-padded response),
``response_mask`` (1 on generated tokens) and ``old_logp`` (log-prob of each generated token
at the sampling temperature, 0 on prompt and padding). Rows are interleaved by prompt:
row ``i*n + j`` is sample ``j`` of prompt ``i``, so the ``n`` samples of a prompt are
consecutive (the GRPO group), and every non-tensor column of the prompts (``answers``...)
is repeated with its samples, plus a ``uid`` naming the prompt.

With ``rollout.multi_turn`` each sample is an episode (:mod:`rlflow.engine.rollout.multi_turn`,
on an engine with ``generate_episodes``): its rows hold the episode's prompt (``P`` =
``max_prompt_tokens``), then its sampled and observation tokens (``R`` = ``max_total_tokens``),
the observations real in ``attention_mask`` but outside ``response_mask``, with log-prob 0.

The train step runs the objective its MFC declares (``MFCDef.objective``): ``"rl"`` the policy
loss after computing advantages (PPO family); ``"dpo"`` the DPO/IPO loss over (chosen, rejected)
pairs; ``"sft"`` cross-entropy (SFT, also the SFT warm-up before RL).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlflow.algos import logp_mismatch
from rlflow.algos.overlong import truncated_rows
from rlflow.data.tokenizer import load_tokenizer
from rlflow.engine.lora import adapters_disabled
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.given import (
    COMPLETION,
    choose_given,
    completion_ids,
    given_rollout,
    merge_rollouts,
    sampled_rows,
)
from rlflow.engine.rollout.multi_turn import MultiTurn
from rlflow.engine.rollout.partial import TOKEN_VERSION, PartialCall, append_tokens, prefix_prompts, widen_rows
from rlflow.protocol import DataProto
from rlflow.workers.advantage import AdvantageEstimator
from rlflow.workers.context import CallContext, tensors_of
from rlflow.workers.interfaces.base import ModelInterface, log_probs, token_mask_key, train_epochs
from rlflow.workers.losses import dpo_loss_fn, policy_loss_fn, sft_loss_fn
from rlflow.workers.setup import ModelSetup, WorkerSetup

if TYPE_CHECKING:
    from rlflow.engine.rollout.base import RolloutEngine
    from rlflow.engine.train_engine import TrainEngine

__all__ = [
    "POLICY_LAG",
    "POLICY_VERSION",
    "ActorInterface",
    "pair_columns",
    "policy_lag_metrics",
    "rollout_rows",
    "row_versions",
    "token_lag_metrics",
]

# Non-tensor columns of rollout rows: the version of the weights that sampled each row (set by the
# generate call), and how many optimizer steps older they are than the weights training on it
# (set by the train call); see ``AlgorithmParams.policy_lag``.
POLICY_VERSION = "policy_version"
POLICY_LAG = "policy_lag"

# Seeds of successive rollouts are spread by a large prime so that streams do not overlap.
_SEED_STRIDE = 1_000_003
# Evaluation rollouts draw from a stream of their own, this far from the training seeds.
_EVAL_SEED_OFFSET = 2**61


def rollout_rows(sampled: DataProto, prompt_width: int) -> DataProto:
    """The rollout engine's output as dataflow rows, all tensors ``(N, P+R)``.

    Args:
        sampled: :meth:`~rlflow.engine.rollout.base.RolloutEngine.generate` output
            (``response_mask`` and ``old_logp`` are ``(N, R)``).
        prompt_width: ``P``.

    Returns:
        ``input_ids``, ``attention_mask``, ``response_mask``, ``old_logp`` plus the non-tensor columns.
    """
    response_mask, old_logp = sampled.batch["response_mask"], sampled.batch["old_logp"]
    zeros = torch.zeros(response_mask.shape[0], prompt_width, dtype=response_mask.dtype)
    tensors = {
        "input_ids": sampled.batch["input_ids"],
        "attention_mask": sampled.batch["attention_mask"],
        "response_mask": torch.cat([zeros, response_mask], dim=1),
        "old_logp": torch.cat([zeros.float(), old_logp.float()], dim=1),
    }
    return DataProto.from_dict(tensors, dict(sampled.non_tensor_batch))


def policy_lag_metrics(data: DataProto) -> dict[str, float]:
    """``policy_lag`` (mean) and ``policy_lag_max`` of the rows: optimizer steps between the weights
    that sampled each row and the weights training on it (the ``policy_lag`` column the model
    worker sets); nothing for rows without the column."""
    lag = data.non_tensor_batch.get(POLICY_LAG)
    if lag is None or len(lag) == 0:
        return {}
    lag = np.asarray(lag, dtype=np.float64)
    return {"policy_lag": float(lag.mean()), "policy_lag_max": float(lag.max())}


def row_versions(data: DataProto, version: int) -> np.ndarray:
    """``(N,)`` int64 version of the weights that sampled each row: ``version`` for a whole response,
    its oldest token's for a partial rollout's row (``token_version``)."""
    if TOKEN_VERSION not in data.batch_keys:
        return np.full(len(data), version, dtype=np.int64)
    mask = data.batch["response_mask"].bool()
    oldest = data.batch[TOKEN_VERSION].masked_fill(~mask, version).min(dim=1).values
    return oldest.numpy().astype(np.int64)


def token_lag_metrics(data: DataProto, version: int) -> dict[str, float]:
    """Staleness of a partial rollout's tokens against the weights ``version`` training on them:
    ``token_lag`` (mean versions behind, over response tokens), ``token_lag_max`` and
    ``stale_token_fraction`` (the share sampled by older weights); nothing for rows without
    ``token_version``."""
    if TOKEN_VERSION not in data.batch_keys or len(data) == 0:
        return {}
    mask = data.batch["response_mask"].bool()
    lag = (version - data.batch[TOKEN_VERSION])[mask].double()
    if lag.numel() == 0:
        return {}
    return {
        "token_lag": float(lag.mean()),
        "token_lag_max": float(lag.max()),
        "stale_token_fraction": float((lag > 0).double().mean()),
    }


def pair_columns(num_rows: int) -> dict[str, torch.Tensor]:
    """``pair_index`` and ``chosen`` of rows laid out as pairs (row ``2i`` chosen, ``2i+1`` rejected).

    Raises:
        ValueError: an odd number of rows (the dp split cut a pair).
    """
    if num_rows % 2:
        raise ValueError(f"paired rows must come in (chosen, rejected) pairs; this rank got {num_rows} rows")
    rows = torch.arange(num_rows)
    return {"pair_index": rows // 2, "chosen": (rows % 2 == 0).long()}


class ActorInterface(ModelInterface):
    """The policy; see the module docstring."""

    role = "actor"
    objectives = ("rl", "dpo", "sft")

    def __init__(self, model: ModelSetup, setup: WorkerSetup) -> None:
        super().__init__(model, setup)
        self.num_rollouts = 0  # training rollouts so far: seeds the next one
        self.num_eval_rollouts = 0  # evaluation rollouts, counted apart so they never move training sampling
        limit = setup.sampling.max_new_tokens
        self.advantages = AdvantageEstimator(self.algo, limit) if self.algo.adv_estimator is not None else None

    # ------------------------------------------------------------------ generate
    def sampling_params(self, *, greedy: bool, evaluate: bool) -> tuple[SamplingParams, int]:
        """Parameters of the next rollout and how often to repeat each result row.

        * default: the training sampling parameters (``n`` samples per prompt);
        * ``evaluate``: the held-out evaluation parameters (greedy if asked);
        * ``greedy`` alone: one greedy response per prompt, repeated ``n`` times so its rows
          align with the sampled rollout's (ReMax's baseline).

        Every rollout gets its own seed (base seed + a stride per rollout). Evaluation rollouts
        count and seed apart from training ones: how often a run evaluates does not change
        what its training rollouts sample.
        """
        base = self.setup.eval_sampling if evaluate else self.setup.sampling
        count, offset = (self.num_eval_rollouts, _EVAL_SEED_OFFSET) if evaluate else (self.num_rollouts, 0)
        seed = (base.seed if base.seed is not None else self.setup.seed) + offset + _SEED_STRIDE * count
        params = replace(base, seed=seed % 2**62, greedy=base.greedy or greedy)
        if greedy and not evaluate:
            return replace(params, n=1), self.setup.sampling.n
        return params, 1

    def generate(
        self,
        engine: RolloutEngine,
        data: DataProto,
        ctx: CallContext,
        *,
        greedy: bool = False,
        evaluate: bool = False,
        partial: PartialCall | None = None,
    ) -> DataProto:
        """Sample responses to ``prompts`` / ``prompt_mask`` ``(B, P)``; see the module docstring.

        With ``partial`` (``rollout.partial_tokens``), at most ``partial.max_tokens`` tokens per
        response, the rows as wide as whole responses and with ``token_version``; with
        ``partial.resume`` the rows given are carried responses, continued
        (:meth:`continue_rows`).
        """
        if partial is not None and partial.resume:
            return self.continue_rows(engine, data, partial)
        tensors = tensors_of(data, ("prompts", "prompt_mask"))
        params, repeat = self.sampling_params(greedy=greedy, evaluate=evaluate)
        if partial is not None:
            params = replace(params, max_new_tokens=min(partial.max_tokens, params.max_new_tokens))
        columns = dict(data.non_tensor_batch)
        if not greedy and not evaluate and "uid" not in columns:
            dp_rank = ctx.coords.dp
            columns["uid"] = np.asarray([f"{self.num_rollouts}:{dp_rank}:{i}" for i in range(len(data))], dtype=object)
        prompts = DataProto.from_dict(
            {"input_ids": tensors["prompts"], "attention_mask": tensors["prompt_mask"].long()}, columns
        )
        if evaluate:
            self.num_eval_rollouts += 1
        else:
            self.num_rollouts += 1
        if self.algo.distill_student_fraction < 1 and not greedy and not evaluate:
            sampled = self._sample_or_give(engine, prompts, params, ctx)
        else:
            sampled = self._sample(engine, prompts, params)
        # An engine that reports log-probs of the top-k/top-p filtered distribution says so (vLLM);
        # logged as <call>/old_logp_filtered (algorithm.recompute_old_logp replaces them).
        filtered = sampled.meta_info.get("old_logp_filtered")
        if repeat > 1:
            sampled = sampled.repeat(repeat, interleave=True)
        out = rollout_rows(sampled, sampled.batch["prompts"].shape[1])
        if partial is not None:
            out = self._partial_rows(out, sampled.batch["prompts"].shape[1], engine.pad_token_id, partial.version)
        out.meta_info["response_length"] = float(out.batch["response_mask"].sum(dim=1).float().mean())
        if self.multi_turn is not None:  # episode metrics (multi_turn/*, the environment's tools/*)
            out.meta_info.update(sampled.meta_info)
        if filtered is not None:  # after the episode metrics, which carry the engine's flag as a bool
            out.meta_info["old_logp_filtered"] = float(bool(filtered))
        return out

    def _partial_rows(self, out: DataProto, prompt_width: int, pad_token_id: int, version: int) -> DataProto:
        """A partial call's fresh rows: as wide as whole responses, each token's version beside it."""
        width = prompt_width + self.setup.sampling.max_new_tokens
        rows = widen_rows({k: out.batch[k] for k in out.batch_keys}, width, pad_token_id)
        rows[TOKEN_VERSION] = rows["response_mask"].long() * version
        return DataProto.from_dict(rows, dict(out.non_tensor_batch))

    def continue_rows(self, engine: RolloutEngine, data: DataProto, partial: PartialCall) -> DataProto:
        """Sample up to ``partial.max_tokens`` more tokens for each carried row (rollout rows with
        ``token_version``, none finished): its prompt and response so far are prefilled under the
        current weights, the new tokens written after them (:mod:`rlflow.engine.rollout.partial`).
        The rows' earlier tokens, log-probs and versions are kept as they are."""
        keys = ("input_ids", "attention_mask", "response_mask", "old_logp", TOKEN_VERSION)
        rows = {k: t.clone() for k, t in tensors_of(data, keys).items()}
        limit = self.setup.sampling.max_new_tokens
        prompt_width = rows["input_ids"].shape[1] - limit
        lengths = rows["response_mask"].sum(dim=1)
        if len(data) == 0 or int(lengths.max()) >= limit:
            raise ValueError(f"continue_rows: needs rows with fewer than max_new_tokens={limit} response tokens")
        room = limit - int(lengths.min())  # rows with less room keep what fits (append_tokens)
        ids, mask = prefix_prompts(rows["input_ids"], rows["attention_mask"])
        params, _ = self.sampling_params(greedy=False, evaluate=False)
        self.num_rollouts += 1
        # One sample per row; the stop tokens are free again (partial_tokens >= min_new_tokens).
        params = replace(params, n=1, min_new_tokens=0, max_new_tokens=min(partial.max_tokens, room))
        sampled = engine.generate(DataProto.from_dict({"input_ids": ids, "attention_mask": mask.long()}), params)
        new = sampled.batch if isinstance(sampled, DataProto) else sampled
        append_tokens(
            rows, prompt_width, new["responses"], new["response_mask"], new["old_logp"], partial.version
        )  # fmt: skip
        out = DataProto.from_dict(rows, dict(data.non_tensor_batch))
        out.meta_info["response_length"] = float(rows["response_mask"].sum(dim=1).float().mean())
        return out

    def _sample(self, engine: RolloutEngine, prompts: DataProto, params: SamplingParams) -> DataProto:
        """One response per sample, or an episode per sample when the run is multi-turn."""
        if self.multi_turn is None:
            return engine.generate(prompts, params)
        run = getattr(engine, "generate_episodes", None)
        if run is None:
            raise ValueError(
                f"rollout.multi_turn: the {self.setup.rollout_engine!r} rollout engine runs no episodes "
                "(no generate_episodes; rollout.engine: hf or vllm runs them)"
            )
        return run(prompts, params, self.multi_turn)

    def _sample_or_give(
        self, engine: RolloutEngine, prompts: DataProto, params: SamplingParams, ctx: CallContext
    ) -> DataProto:
        """GKD's mixed rollout (``algorithm.distill_student_fraction``, :mod:`rlflow.engine.rollout.given`):
        a drawn share of the prompts take their row's completion as the response, the policy samples
        the others. The draw is seeded by the rollout's seed and the dp rank, so every tp and pp rank
        of a dp rank takes the same prompts, and a resumed run the same as the interrupted one."""
        given = choose_given(len(prompts), self.algo.distill_student_fraction, (params.seed, ctx.coords.dp))
        pad = engine.pad_token_id
        sampled = self._sample(engine, prompts[~given], params) if not given.all() else None
        given_rows = None
        if given.any():
            rows = prompts[given]
            texts = [row.get(COMPLETION) for row in rows.non_tensor_batch["columns"]]
            responses = completion_ids(self._tokenizer, texts, params.max_new_tokens)
            given_rows = given_rollout(rows, responses, params.n, pad)
        return merge_rollouts(sampled, given_rows, given, params.n, pad)

    @cached_property
    def _tokenizer(self):
        return load_tokenizer(self.setup.tokenizer_path)

    @cached_property
    def multi_turn(self) -> MultiTurn | None:
        """The episodes of ``rollout.multi_turn`` (built once: the episodes share one tool thread pool)."""
        if self.setup.multi_turn is None:
            return None
        return self.setup.multi_turn.build(self._tokenizer, self.setup.sampling.stop_token_ids or None)

    # ------------------------------------------------------------------ inference
    def inference(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> DataProto | None:
        """``logp`` ``(N, T)`` under the current policy at the sampling temperature.

        Given the rollout engine's ``rollout_logp`` (the old-log-prob recompute call), it also
        reports how far those are from ``logp`` over the response tokens (``logp_mismatch_mean``,
        ``logp_mismatch_max``).
        """
        out = log_probs(engine, data, self.temperature)
        if out is not None and "rollout_logp" in data.batch_keys:
            mask = data.batch["response_mask"]
            sampled = sampled_rows(data)
            if sampled is not None:  # given responses have no rollout log-probs to compare
                mask = mask * sampled[:, None].to(mask.dtype)
            out.meta_info.update(logp_mismatch(out.batch["logp"], data.batch["rollout_logp"], mask))
        return out

    # ------------------------------------------------------------------ train
    def train_step(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> dict[str, float]:
        """The objective the MFC declares (see the module docstring)."""
        objectives = {"rl": self._train_rl, "dpo": self._train_dpo, "sft": self._train_sft}
        return objectives[ctx.mfc.objective](engine, data, ctx)

    def _train_rl(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> dict[str, float]:
        if self.advantages is None:
            raise ValueError(
                f"MFC {ctx.mfc.name!r} trains objective 'rl' but algorithm {self.algo.name!r} has no adv_estimator"
            )
        if self.model.lora is not None and self.algo.kl_coef > 0 and "ref_logp" not in data.batch_keys:
            data = data.union(DataProto.from_dict({"ref_logp": self._base_log_probs(engine, data)}))
        if self.algo.distill_student_fraction < 1:  # on every rank: the forward it may take is collective
            data = self._own_logp_of_given_rows(engine, data)
        advantages, _, metrics = self.advantages(data, ctx)
        batch = tensors_of(data, ("input_ids", "attention_mask", "response_mask", "old_logp"))
        batch["advantages"] = advantages
        if not self.algo.kl_in_reward and metrics["kl_coef"] > 0:
            batch["ref_logp"] = tensors_of(data, ("ref_logp",))["ref_logp"]
        if "rollout_logp" in data.batch_keys:  # old_logp was recomputed by the trainer (see policy_loss_fn)
            batch["rollout_logp"] = data.batch["rollout_logp"]
        if "teacher_vocab_logp" in data.batch_keys:  # the full-vocabulary distillation loss (see policy_loss_fn)
            batch["teacher_vocab_logp"] = data.batch["teacher_vocab_logp"]
        if self.algo.mask_truncated:
            metrics["truncated_fraction"] = self._mask_truncated(batch)
        num_mini_batches = self.num_mini_batches(ctx)
        several_updates = self.algo.ppo_epochs * num_mini_batches > 1
        if self.algo.behaviour_correction == "decoupled" and several_updates and "rollout_logp" not in batch:
            # Several updates: the proximal policy is the weights before the first, computed here
            # (one update: its own forward's log-probs are the proximal ones, see policy_loss_fn;
            # a recomputed old_logp is that forward already).
            prox = log_probs(engine, data, self.temperature)
            batch["prox_logp"] = prox.batch["logp"] if prox is not None else batch["old_logp"]
        metrics.update(policy_lag_metrics(data))
        step = train_epochs(
            engine,
            batch,
            policy_loss_fn(self.algo, metrics["kl_coef"]),
            epochs=self.algo.ppo_epochs,
            num_mini_batches=num_mini_batches,
            loss_mask_key=token_mask_key(self.algo.loss_agg_mode, "response_mask"),
            temperature=self.temperature,
            empty_ok=self.algo.mask_truncated,  # a mini-batch of truncated responses only has no loss
        )
        return {**metrics, **step}

    def _own_logp_of_given_rows(self, engine: TrainEngine, data: DataProto) -> DataProto:
        """Rows whose response was given (GKD's mixed rollouts, ``given_response``) have no sampler's
        log-probs: their ``old_logp`` becomes the student's own before this step (the train engine's,
        at the sampling temperature), so the ratio, the KL terms and the metrics read them as a sample
        of these weights. Under the old-log-prob recompute ``old_logp`` is that already, and their
        ``rollout_logp`` becomes it (no mismatch to correct: no engine sampled them)."""
        if "rollout_logp" in data.batch_keys:
            own, key = data.batch["old_logp"], "rollout_logp"
        else:
            out = log_probs(engine, data, self.temperature)
            if out is None:  # not the last pipeline stage: no loss is taken here
                return data
            own, key = out.batch["logp"] * data.batch["response_mask"], "old_logp"
        tensors = dict(data.batch.items())
        tensors[key] = torch.where(sampled_rows(data)[:, None], tensors[key], own.to(tensors[key].dtype))
        out = DataProto.from_dict(tensors, dict(data.non_tensor_batch))
        out.meta_info.update(data.meta_info)
        return out

    def _mask_truncated(self, batch: dict[str, torch.Tensor]) -> float:
        """Leaves the responses the generation limit cut off out of the loss (``algorithm.mask_truncated``);
        returns their fraction of this rank's rows."""
        sampling = self.setup.sampling
        truncated = truncated_rows(
            batch["input_ids"], batch["response_mask"], sampling.max_new_tokens, sampling.stop_token_ids
        )
        batch["response_mask"] = batch["response_mask"] * ~truncated[:, None]
        return float(truncated.float().mean()) if len(truncated) else 0.0

    def _base_log_probs(self, engine: TrainEngine, data: DataProto) -> torch.Tensor:
        """``ref_logp`` ``(N, T)`` under the LoRA actor's base (adapters disabled): the reference
        policy, computed on the actor's own weights (no reference model is built, see
        :meth:`rlflow.trainer.config.RLFlowConfig.required_models`). LoRA runs with pp = 1, so
        every rank gets them."""
        with adapters_disabled(engine.stage):
            return log_probs(engine, data, self.temperature).batch["logp"]

    def _train_sft(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> dict[str, float]:
        batch = tensors_of(data, ("input_ids", "attention_mask", "loss_mask"))
        # A sequence's first token has no prediction: keep it out of the loss and the token count.
        batch["loss_mask"] = batch["loss_mask"] * (position_ids_from_mask(batch["attention_mask"]) > 0)
        return train_epochs(
            engine,
            batch,
            sft_loss_fn(self.algo.loss_agg_mode),
            epochs=1,
            num_mini_batches=self.num_mini_batches(ctx),
            loss_mask_key=token_mask_key(self.algo.loss_agg_mode, "loss_mask"),
        )

    def _train_dpo(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> dict[str, float]:
        batch = tensors_of(data, ("input_ids", "attention_mask", "loss_mask", "ref_logp"))
        batch.update(pair_columns(len(data)))
        return train_epochs(engine, batch, dpo_loss_fn(self.algo), epochs=1, num_mini_batches=1, loss_mask_key=None)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"num_rollouts": self.num_rollouts, "num_eval_rollouts": self.num_eval_rollouts}
        if self.advantages is not None:
            state["advantages"] = self.advantages.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_rollouts = int(state["num_rollouts"])
        self.num_eval_rollouts = int(state.get("num_eval_rollouts", 0))
        if self.advantages is not None:
            self.advantages.load_state_dict(state["advantages"])
