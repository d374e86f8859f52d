"""A training call's mini-batches: exactly ``num_mini_batches`` optimizer steps over every dp-local row."""

from __future__ import annotations

import pytest
import torch
from train_engine_helpers import actor_loss, build_model, make_batch

from rlflow.engine.optim import OptimConfig
from rlflow.engine.train_engine import EngineConfig, TrainEngine


@pytest.mark.parametrize("rows, num_mini_batches", [(6, 4), (7, 3), (8, 4)])
def test_exactly_the_asked_mini_batches_when_they_do_not_divide_the_rows(single_mesh, rows, num_mini_batches):
    # 6 rows in 4 mini-batches used to train 3 (torch.chunk), while metrics were divided by 4 and
    # the learning-rate schedule counted 4; dp ranks with other row counts took other step counts.
    batch = {k: v[:rows] for k, v in make_batch().items()}
    config = EngineConfig(device="cpu", optim=OptimConfig(lr=1e-3, warmup_steps=0, total_steps=100))
    engine = TrainEngine(build_model(seed=0), single_mesh, config)
    seen = []

    def loss_fn(outputs, data):
        seen.append(data["input_ids"][:, :1].clone())
        return actor_loss(outputs, data)

    metrics = engine.train_step(batch, loss_fn, num_mini_batches=num_mini_batches, loss_mask_key="response_mask")
    assert engine.global_step == num_mini_batches
    assert engine.scheduler.last_epoch == num_mini_batches
    assert torch.cat(seen).shape[0] == rows  # every row once
    sizes = [len(c) for c in torch.arange(rows).tensor_split(num_mini_batches)]
    assert max(sizes) - min(sizes) <= 1
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_a_mini_batch_without_loss_units_changes_no_weight_when_allowed(single_mesh):
    # algorithm.mask_truncated can leave every response of a mini-batch out of the loss.
    batch = make_batch()
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    config = EngineConfig(device="cpu", optim=OptimConfig(lr=1e-3, warmup_steps=0, total_steps=100))
    engine = TrainEngine(build_model(seed=0), single_mesh, config)
    before = [p.detach().clone() for p in engine.stage.parameters()]
    with pytest.raises(ValueError, match="no loss units under loss_mask_key='response_mask'"):
        engine.train_step(batch, actor_loss, loss_mask_key="response_mask")
    metrics = engine.train_step(batch, actor_loss, num_mini_batches=2, loss_mask_key="response_mask", empty_ok=True)
    assert metrics["empty_step_fraction"] == 1.0 and metrics["grad_norm"] == 0.0
    assert engine.global_step == 2 and engine.scheduler.last_epoch == 2
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, engine.stage.parameters()))
