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
