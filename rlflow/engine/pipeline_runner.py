"""Running a :class:`~rlflow.engine.train_engine.TrainEngine` stage under pipeline parallelism.

torch's pipelining schedules cut a batch into micro-batches along dim 0 and exchange
fixed-shape activation buffers between stages. The runner therefore lays a mini-batch out
as ``num_micro_batches`` blocks of equal row count: token-balanced groups of rows
(:func:`~rlflow.engine.micro_batch.split_micro_batches` with ``equal_rows``), the short
groups padded with *dummy* rows (one valid token, never shown to the loss), all trimmed to
the mini-batch's valid columns. A ``target`` tensor carries each slot's row index in the
mini-batch (``-1`` for a dummy), which is how the loss callback on the last stage finds the
rows of its micro-batch and how inference outputs are put back in order.

Every rank holds the whole mini-batch (data is replicated along pp), so ``attention_mask``
and ``position_ids`` reach every stage as keyword arguments; the first stage also gets the
token ids as its positional input, and an LM's last stage gets them as ``labels``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from rlflow.engine.micro_batch import select, split_micro_batches
from rlflow.engine.pipeline import build_schedule

if TYPE_CHECKING:
    from rlflow.engine.train_engine import TrainEngine

__all__ = ["PipelineRunner"]


class _Layout:
    """A mini-batch laid out as equal blocks of rows (see the module docstring)."""

    def __init__(self, batch: Mapping[str, torch.Tensor], split_kwargs: dict) -> None:
        mask = batch["attention_mask"]
        cols = mask.bool().any(dim=0).nonzero().flatten()
        self.cols = slice(int(cols[0]), int(cols[-1]) + 1) if cols.numel() else slice(0, mask.shape[1])
        parts = split_micro_batches(batch, equal_rows=True, trim=False, **split_kwargs)
        self.num_micro_batches = len(parts)
        self.rows = max(len(p.indices) for p in parts)
        slots: list[int] = []
        for p in parts:
            slots += p.indices.tolist() + [-1] * (self.rows - len(p.indices))
        self.target = torch.tensor(slots, dtype=torch.long)  # (n * rows,) row index or -1
        self.batch = batch
        inputs = select(batch, self.target.clamp(min=0), self.cols)
        dummy = self.target < 0
        mask = inputs["attention_mask"].clone()
        mask[dummy] = 0
        mask[dummy, 0] = 1  # one valid token: a fully masked row would give NaN attention
        inputs["attention_mask"] = mask
        self.inputs = inputs

    def micro_batch(self, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(valid slots, rows of the mini-batch)`` of one block of ``target``."""
        valid = target >= 0
        return valid, select(self.batch, target[valid].cpu(), self.cols)


class PipelineRunner:
    """Train and infer through torch pipelining schedules on the engine's ``pp`` axis."""

    def __init__(self, engine: TrainEngine) -> None:
        self.engine = engine

    def _examples(self, layout: _Layout, train: bool):
        """Meta tensors with the shapes/dtypes of one micro-batch's stage input and output."""
        e, stage = self.engine, self.engine.stage
        r, t = layout.rows, layout.cols.stop - layout.cols.start
        # requires_grad marks the activations whose gradients flow back between stages.
        hidden = torch.empty(r, t, e.hf_config.hidden_size, dtype=e.compute_dtype, device="meta", requires_grad=train)
        x = torch.empty(r, t, dtype=torch.long, device="meta") if stage.is_first else hidden
        if not stage.is_last:
            return x, hidden
        per_token = torch.empty(r, t, dtype=torch.float32, device="meta")
        if stage.kind == "value":
            return x, per_token
        logits = torch.empty(r, t, e.hf_config.vocab_size, dtype=e.compute_dtype, device="meta")
        return x, (per_token, per_token, logits) if train else (per_token, per_token)

    def _step_args(self, layout: _Layout) -> tuple[tuple, dict]:
        inp = self.engine.stage_inputs(layout.inputs)
        kwargs = {"attention_mask": inp["attention_mask"], "position_ids": inp["position_ids"]}
        if self.engine.kind == "lm":
            kwargs["labels"] = inp["input_ids"]
        args = (inp["input_ids"],) if self.engine.stage.is_first else ()
        return args, kwargs

    def _schedule(self, layout: _Layout, train: bool, loss_fn=None):
        x, out = self._examples(layout, train)
        return build_schedule(
            self.engine.stage,
            self.engine.mesh,
            device=self.engine.device,
            num_micro_batches=layout.num_micro_batches,
            input_example=x,
            output_example=out,
            loss_fn=loss_fn,
            schedule=self.engine.config.pp_schedule,
            forward_only=not train,
        )

    def train(self, mini: Mapping[str, torch.Tensor], weighted_loss: Callable) -> dict[str, float]:
        """Forward and backward one mini-batch; returns the loss callback's metric sums (last stage)."""
        e = self.engine
        layout = _Layout(mini, e.config.split_kwargs())
        sums: dict[str, float] = {}

        def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
            valid, data = layout.micro_batch(target)
            outputs = {k: v[valid] for k, v in e.named_outputs(output).items()}
            loss, mb_sums = weighted_loss(outputs, e.to_device(data))
            for k, v in mb_sums.items():
                sums[k] = sums.get(k, 0.0) + v
            return loss

        schedule = self._schedule(layout, True, loss_fn)
        args, kwargs = self._step_args(layout)
        schedule.step(*args, target=layout.target.to(e.device), return_outputs=False, **kwargs)
        return sums

    def forward(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Forward-only pass; full ``(B, T)`` outputs on the last stage, ``None`` elsewhere."""
        e = self.engine
        layout = _Layout(batch, e.config.split_kwargs())
        schedule = self._schedule(layout, False)
        args, kwargs = self._step_args(layout)
        merged = schedule.step(*args, **kwargs)
        if not e.stage.is_last:
            return None
        valid = layout.target >= 0
        rows = layout.target[valid]
        cols = torch.arange(layout.cols.start, layout.cols.stop)
        out = {}
        for key, value in e.named_outputs(merged).items():
            full = torch.zeros((*batch["attention_mask"].shape, *value.shape[2:]), dtype=torch.float32)  # (B, T[, V])
            full[rows[:, None], cols] = value[valid.to(value.device)].float().cpu()
            out[key] = full
        return out
