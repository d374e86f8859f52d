"""The base class of the role interfaces (actor, critic, ref, reward).

An interface computes what an MFC means for one role — a rollout, log-probs, values,
rewards, a training step — on the rows this rank received. It never splits or gathers
data itself (the controller does) and never moves weights (the worker's residency layer
does); it is handed the engine to run on and returns tensors under the *interface* names of
``rlflow.dataflow.algorithms`` (the worker applies the MFC's key remaps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlflow.algos.params import AlgorithmParams
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext, temperature_scaled, tensors_of
from rlflow.workers.setup import ModelSetup, WorkerSetup

if TYPE_CHECKING:
    from rlflow.dataflow.mfc import MFCDef
    from rlflow.engine.train_engine import TrainEngine

__all__ = ["ModelInterface", "log_probs", "token_mask_key", "train_epochs"]


class ModelInterface:
    """Base of the role interfaces; a call kind the role does not serve raises ``NotImplementedError``.

    Args:
        model: the model's setup.
        setup: the whole worker setup (algorithm, sampling, tokenizer, seed).
    """

    role = ""
    # The train_step objectives (``MFCDef.objective``) the role serves.
    objectives: tuple[str, ...] = ()

    def __init__(self, model: ModelSetup, setup: WorkerSetup) -> None:
        self.model = model
        self.setup = setup

    @classmethod
    def check_mfc(cls, mfc: MFCDef) -> None:
        """Raise ``ValueError`` when this role cannot serve ``mfc`` (checked before any worker starts)."""
        if getattr(cls, mfc.interface_type) is getattr(ModelInterface, mfc.interface_type):
            raise ValueError(f"MFC {mfc.name!r} is a {mfc.interface_type} call, which {cls.__name__} does not serve")
        if mfc.is_train and mfc.objective not in cls.objectives:
            raise ValueError(
                f"MFC {mfc.name!r}: objective={mfc.objective!r}, which {cls.__name__} does not train; "
                f"expected one of {cls.objectives}"
            )

    @property
    def algo(self) -> AlgorithmParams:
        return self.setup.algo

    def generate(self, engine: Any, data: DataProto, ctx: CallContext, *, greedy: bool, evaluate: bool) -> DataProto:
        """Rollout rows ``(N, P+R)`` from prompt rows ``(B, P)``; see :class:`~rlflow.workers.interfaces.actor.ActorInterface`."""
        raise NotImplementedError(f"role {self.role!r} (model {self.model.name!r}) does not generate")

    def inference(self, engine: TrainEngine | None, data: DataProto, ctx: CallContext) -> DataProto | None:
        """Per-row or per-token outputs for ``data``; ``None`` on ranks that hold no output (not the last stage)."""
        raise NotImplementedError(f"role {self.role!r} (model {self.model.name!r}) has no inference call")

    def train_step(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> dict[str, float]:
        """Optimizer steps on ``data``; returns metrics identical on every rank of the call."""
        raise NotImplementedError(f"role {self.role!r} (model {self.model.name!r}) is not trained")

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state to checkpoint (counters, controller values)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    @property
    def temperature(self) -> float:
        """Temperature of the policy's log-probs: the sampling temperature for RL, 1 otherwise (SFT, DPO)."""
        return self.setup.sampling.temperature if self.algo.adv_estimator is not None else 1.0

    def num_mini_batches(self, ctx: CallContext) -> int:
        """Optimizer steps per epoch: the MFC's ``n_minibatches`` if set, else the algorithm's."""
        return ctx.mfc.n_minibatches or self.algo.n_minibatches


def log_probs(engine: TrainEngine, data: DataProto, temperature: float) -> DataProto | None:
    """``logp`` ``(N, T)``: log-prob of every token given the ones before (0 at starts and padding).

    ``None`` on ranks that are not on the last pipeline stage.
    """
    batch = tensors_of(data, ("input_ids", "attention_mask"))
    if "response_mask" in data.batch_keys:  # rows of a rollout: those of a prompt may share it
        batch["response_mask"] = data.batch["response_mask"]
    with temperature_scaled(engine, temperature):
        out = engine.forward(batch)
    return None if out is None else DataProto.from_dict({"logp": out["log_probs"]})


def train_epochs(
    engine: TrainEngine,
    batch: dict[str, torch.Tensor],
    loss_fn,
    *,
    epochs: int,
    num_mini_batches: int,
    loss_mask_key: str | None,
    temperature: float = 1.0,
    empty_ok: bool = False,
) -> dict[str, float]:
    """``epochs`` passes of ``num_mini_batches`` optimizer steps over ``batch``; metrics averaged over passes.
    ``empty_ok``: a mini-batch whose rows are all masked out changes no weight (see ``TrainEngine.train_step``)."""
    totals: dict[str, float] = {}
    for _ in range(epochs):
        with temperature_scaled(engine, temperature):
            metrics = engine.train_step(
                batch, loss_fn, num_mini_batches=num_mini_batches, loss_mask_key=loss_mask_key, empty_ok=empty_ok
            )
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v / epochs
    return totals


def token_mask_key(loss_agg_mode: str, key: str) -> str | None:
    """The engine's loss units: tokens of ``key`` for ``token-mean``, rows for the sequence-mean modes."""
    return key if loss_agg_mode == "token-mean" else None
