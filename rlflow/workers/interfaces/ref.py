"""Frozen log-probs: the reference policy's, for the KL terms and for DPO, and the distillation
teacher's, for on-policy distillation (:mod:`rlflow.algos.distill`).

Their weights never train; with PPO-EMA a ``ParamReallocHook`` blends the actor into the
reference before each call (run by the worker's residency layer, not here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext
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
    """``logp`` ``(N, T)`` of the student's sampled tokens under the distillation teacher, at the policy's temperature."""

    role = "teacher"
