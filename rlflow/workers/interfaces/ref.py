"""Frozen log-probs: the reference policy's, for the KL terms and for DPO, and the distillation
teacher's, for on-policy distillation (:mod:`rlflow.algos.distill`).

Their weights never train; with PPO-EMA a ``ParamReallocHook`` blends the actor into the
reference before each call (run by the worker's residency layer, not here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlflow.algos import vocab_log_probs
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext, temperature_scaled, tensors_of
from rlflow.workers.interfaces.base import ModelInterface, log_probs

if TYPE_CHECKING:
    from rlflow.engine.train_engine import TrainEngine

__all__ = ["RefInterface", "TeacherInterface"]


class RefInterface(ModelInterface):
    """``logp`` ``(N, T)`` under the reference model, at the policy's temperature."""

    role = "ref"

    def inference(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> DataProto | None:
        return log_probs(engine, data, self.temperature)


class TeacherInterface(RefInterface):
    """``logp`` ``(N, T)`` of the student's sampled tokens under the distillation teacher, at the policy's
    temperature; under ``algorithm.distill_loss: full_vocab`` also ``vocab_logp`` ``(N, T, V)``, its whole
    next-token distributions (:func:`~rlflow.algos.vocab_log_probs`: position ``t`` is token ``t``'s)."""

    role = "teacher"

    def inference(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> DataProto | None:
        if self.algo.distill_loss != "full_vocab":
            return log_probs(engine, data, self.temperature)
        with temperature_scaled(engine, self.temperature):
            out = engine.forward(tensors_of(data, ("input_ids", "attention_mask")), logits=True)
        if out is None:
            return None
        return DataProto.from_dict({"logp": out["log_probs"], "vocab_logp": vocab_log_probs(out["logits"])})
