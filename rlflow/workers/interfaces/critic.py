"""The critic: per-token values, and the value-function train step on GAE returns.

``values[:, t]`` is the critic's value of the prefix *before* token ``t`` — its output at
position ``t - 1`` — so that for a response token ``t`` it values the state in which the
token was chosen (GAE's ``V(s_t)``). Position 0 and padding hold 0.

The train step computes returns with the same :class:`~rlflow.workers.advantage.AdvantageEstimator`
as the actor (both see the same rows, so both get the same returns), then runs the clipped
value loss over ``n_minibatches`` × ``ppo_epochs`` optimizer steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlflow.protocol import DataProto
from rlflow.workers.advantage import AdvantageEstimator
from rlflow.workers.context import CallContext, shift_right, tensors_of
from rlflow.workers.interfaces.base import ModelInterface, token_mask_key, train_epochs
from rlflow.workers.losses import value_loss_fn
from rlflow.workers.setup import ModelSetup, WorkerSetup

if TYPE_CHECKING:
    from rlflow.engine.train_engine import TrainEngine

__all__ = ["CriticInterface"]


class CriticInterface(ModelInterface):
    """The value model; see the module docstring."""

    role = "critic"
    objectives = ("value",)

    def __init__(self, model: ModelSetup, setup: WorkerSetup) -> None:
        super().__init__(model, setup)
        self.advantages = AdvantageEstimator(self.algo, setup.sampling.max_new_tokens)

    def inference(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> DataProto | None:
        """``values`` ``(N, T)`` float32 (module docstring); ``None`` off the last pipeline stage."""
        batch = tensors_of(data, ("input_ids", "attention_mask"))
        out = engine.forward(batch)
        if out is None:
            return None
        values = shift_right(out["values"]) * batch["attention_mask"]
        return DataProto.from_dict({"values": values.float()})

    def train_step(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> dict[str, float]:
        _, returns, metrics = self.advantages(data, ctx)
        batch = tensors_of(data, ("input_ids", "attention_mask", "response_mask", "values"))
        batch["returns"] = returns
        step = train_epochs(
            engine,
            batch,
            value_loss_fn(self.algo),
            epochs=self.algo.ppo_epochs,
            num_mini_batches=self.num_mini_batches(ctx),
            loss_mask_key=token_mask_key(self.algo.loss_agg_mode, "response_mask"),
        )
        return {**metrics, **step}

    def state_dict(self) -> dict[str, Any]:
        return {"advantages": self.advantages.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.advantages.load_state_dict(state["advantages"])
